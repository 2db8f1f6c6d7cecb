"""`pcpstack bench peers`: the same prefill and decode measurements on peer stacks, for ratios.

Peers load the same GGUF file (SmolLM2-135M-Instruct Q4_1 by default) and see the same prompts as
bench/prefill.py and bench/engine.py (random token ids, seeded as those benches seed them) with the same
number of threads:

- transformers: `AutoModelForCausalLM` from the GGUF, dequantised to float32. Prefill is one forward of the
  prompt that keeps the last position's logits; decode is `generate` (greedy), timed per token by a streamer.
- llama.cpp through llama-cpp-python (the optional `bench` extra): prefill is one `eval` of the prompt with
  n_batch covering it; decode is single-token `eval` steps, greedy on the last logits.

Each prefill is timed from the prompt to its first token; each length gets one warm-up run and --repeats
timed runs (median, min, max). Decode reports tokens/s of one stream after a prompt of --decode-context
tokens.
A peer that cannot run here is reported as {"available": false, "reason": ...}, never left out silently.
Each peer runs in a process of its own: a peer library that crashes the process (a llama.cpp build whose
instructions this machine refuses ends in SIGILL) is reported with how its process ended, and the other
peers still run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import multiprocessing
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.engine import _prompt
from bench.machine import machine_facts
from pcpstack.engine.weights import default_model_path

PEERS = ("transformers", "llama.cpp")


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _peer_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = sorted(set(names) - set(PEERS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the peers benchmark."""
    parser.add_argument(
        "--tokens", type=_int_list, default=[512, 2048, 4096], help="prompt lengths, e.g. 512,2048"
    )
    parser.add_argument("--threads", type=int, default=2, help="threads of each peer (pcpstack PCP=2: 2x1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per prompt length and of decode")
    parser.add_argument("--decode-context", type=int, default=512, help="prompt tokens before decode")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per decode run")
    parser.add_argument(
        "--peers", type=_peer_list, default=list(PEERS), help=f"peers to run (default {','.join(PEERS)})"
    )
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the embedded SmolLM2)")


def _summary(seconds: list[float]) -> dict[str, float]:
    return {
        "ttft_s_median": round(statistics.median(seconds), 4),
        "ttft_s_min": round(min(seconds), 4),
        "ttft_s_max": round(max(seconds), 4),
    }


def _time_prefill(prefill: Callable[[list[int]], int], vocab: int, args: argparse.Namespace) -> list[dict]:
    """Rows like bench/prefill.py's, for a `prefill(ids) -> first token` callable."""
    rows = []
    for n in args.tokens:
        ids = _prompt(n, vocab, n)  # seeded with the length, as bench/prefill.py seeds its prompts
        seconds = []
        for repeat in range(args.repeats + 1):
            started = time.perf_counter()
            first_token = prefill(ids)
            if repeat:  # the first run warms up allocators and caches
                seconds.append(time.perf_counter() - started)
        summary = _summary(seconds)
        rows.append(
            {
                "tokens": n,
                **summary,
                "tokens_per_s": round(n / summary["ttft_s_median"], 1),
                "first_token": first_token,
            }
        )
    return rows


def _decode_summary(rates: list[float], args: argparse.Namespace) -> dict:
    return {
        "context": args.decode_context,
        "tokens": args.decode_tokens,
        "tokens_per_s_median": round(statistics.median(rates), 2),
        "tokens_per_s_min": round(min(rates), 2),
        "tokens_per_s_max": round(max(rates), 2),
    }


def _transformers(gguf: Path, args: argparse.Namespace) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    transformers.utils.logging.disable_progress_bar()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - started
    vocab = model.config.vocab_size

    @torch.inference_mode()
    def prefill(ids: list[int]) -> int:
        logits = model(torch.tensor([ids]), logits_to_keep=1).logits  # (1, 1, vocab)
        return int(logits[0, -1].argmax())

    class TokenClock(BaseStreamer):
        """Time of each `put`: the prompt first, then one per generated token."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    @torch.inference_mode()
    def decode_rate(ids: list[int], new_tokens: int) -> float:
        clock = TokenClock()
        prompt = torch.tensor([ids])
        model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # no early stop at EOS: every run decodes the same count
            do_sample=False,
            pad_token_id=0,
            streamer=clock,
        )
        return (new_tokens - 1) / (clock.times[-1] - clock.times[1])  # steps after the first token

    decode_ids = _prompt(args.decode_context, vocab, 0)  # bench/engine.py's single stream
    decode_rate(decode_ids, 2)
    rates = [decode_rate(decode_ids, args.decode_tokens) for _ in range(args.repeats)]
    return {
        "available": True,
        "version": transformers.__version__,
        "dtype": "float32",
        "attention": model.config._attn_implementation,
        "vocab_size": vocab,
        "load_s": round(load_s, 2),
        "prefill": _time_prefill(prefill, vocab, args),
        "decode": _decode_summary(rates, args),
    }


def _llama_cpp(gguf: Path, args: argparse.Namespace) -> dict:
    try:
        import llama_cpp
    except ImportError as exc:
        return {"available": False, "reason": f"llama_cpp cannot be imported ({exc}); pip install '.[bench]'"}
    import numpy as np

    longest = max([*args.tokens, args.decode_context + args.decode_tokens])
    started = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=longest + 16,
        n_batch=longest,  # one llama_decode call per prompt (split into n_ubatch micro-batches inside)
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=False,
        verbose=False,
    )
    load_s = time.perf_counter() - started
    vocab = llm.n_vocab()

    def next_token() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
        return int(logits.argmax())

    def prefill(ids: list[int]) -> int:
        llm.reset()
        llm.eval(ids)
        return next_token()

    def decode_rate(ids: list[int], new_tokens: int) -> float:
        token = prefill(ids)
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = next_token()
        return (new_tokens - 1) / (time.perf_counter() - started)

    decode_ids = _prompt(args.decode_context, vocab, 0)
    decode_rate(decode_ids, 2)
    rates = [decode_rate(decode_ids, args.decode_tokens) for _ in range(args.repeats)]
    return {
        "available": True,
        "version": importlib.metadata.version("llama-cpp-python"),
        "vocab_size": vocab,
        "n_batch": llm.n_batch,
        "n_ubatch": llm.context_params.n_ubatch,
        "flash_attn": bool(llm.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED),
        "load_s": round(load_s, 2),
        "prefill": _time_prefill(prefill, vocab, args),
        "decode": _decode_summary(rates, args),
    }


PEER_RUNS: dict[str, Callable[[Path, argparse.Namespace], dict]] = {
    "transformers": _transformers,
    "llama.cpp": _llama_cpp,
}


def _peer_process(peer: Callable, gguf: Path, args: argparse.Namespace, results) -> None:
    """A peer's process: its result (or the exception it raised) goes back through results."""
    torch.set_num_threads(args.threads)
    try:
        outcome = ("result", peer(gguf, args))
    except Exception as exc:  # re-raised in the parent: a peer's own error still fails the bench
        outcome = ("error", exc)
    results.send(outcome)
    results.close()


def in_own_process(name: str, peer: Callable, gguf: Path, args: argparse.Namespace) -> dict:
    """peer(gguf, args) run in a spawned process; a process that ends before it reports (killed by a
    signal, or exited) makes the peer unavailable, with how its process ended as the reason."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    # the options only: the command line's handler (a function of the __main__ module) cannot be sent
    options = argparse.Namespace(**{key: value for key, value in vars(args).items() if not callable(value)})
    child = context.Process(target=_peer_process, args=(peer, gguf, options, send), name=f"peer-{name}")
    child.start()
    send.close()  # the child holds the only sending end: its death ends the wait below
    try:
        kind, value = receive.recv()
    except EOFError:
        kind, value = "died", None
    finally:
        receive.close()
        child.join()
    if kind == "error":
        raise value
    if kind == "result":
        return value
    code = child.exitcode
    killed = code is not None and code < 0
    how = f"was killed by {signal.Signals(-code).name}" if killed else f"exited ({code})"
    return {"available": False, "reason": f"{name}'s process {how} before reporting"}


def run(args: argparse.Namespace) -> dict:
    """Runs each requested peer; returns per-peer prefill rows and decode rates."""
    gguf = Path(args.gguf) if args.gguf else default_model_path()
    if not gguf.is_file():
        raise SystemExit(f"--gguf={gguf} is not a file; give the GGUF the engine loads")
    facts = machine_facts()
    peers = {name: in_own_process(name, PEER_RUNS[name], gguf, args) for name in args.peers}
    return {
        "benchmark": "peers",
        "model": gguf.name,
        "threads": args.threads,
        "repeats": args.repeats,
        "prompt": "random token ids, seeded with the prompt length (decode: seed 0), as bench/prefill.py",
        **facts,
        "peers": peers,
    }
