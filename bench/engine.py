"""Engine benchmark: prefill seconds at 512 and 2048 tokens and decode tokens/s at batch 1, 8 and 16 (512
tokens of context each) on the embedded model by default, and the load time and peak RSS of the model with
its weights stored and dense (and of synthetic 1B-shaped GGUFs, Q4_1 and Q4_K_M-like), each load in its own
child process (bench/engine_weights.py). `python -m bench.engine --json` runs it alone."""

import argparse
import json
import statistics
import time

import torch

from bench.decode_profile import profile_step
from bench.engine_weights import Q4_K_M, load_forms, synthetic_1b_forms
from bench.machine import machine_facts
from bench.roofline import add_roofline
from pcpstack.common.config import served_model_name
from pcpstack.engine.engine import Engine
from pcpstack.engine.weights import weights_form

PREFILL_LENGTHS = (512, 2048)
DECODE_BATCHES = (1, 8, 16)
DECODE_CONTEXT = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `pcpstack bench engine`."""
    parser.add_argument(
        "--model", default=None, help="GGUF file, Hugging Face folder or 'tiny' (default: SmolLM2)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed prefill runs per length, timed decode runs per batch"
    )
    parser.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per batch size")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="run dtype (default: device's)"
    )
    parser.add_argument(
        "--synthetic-1b",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the load time and peak RSS of synthetic 1B-shaped GGUFs, Q4_1 and Q4_K_M-like (~0.8 GB "
        "each, written to a temporary folder; a dense load needs ~8 GB)",
    )


def _prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _time_prefill(engine: Engine, length: int, repeats: int) -> dict[str, float]:
    ids = _prompt(length, engine.args.vocab_size, length)
    engine.prefill("warmup", ids)
    engine.free("warmup")
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.prefill("bench", ids)
        seconds.append(time.perf_counter() - start)
        engine.free("bench")
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds)}


def _time_decode(
    engine: Engine, batch: int, steps: int, repeats: int, context: int = DECODE_CONTEXT
) -> dict[str, float]:
    """`repeats` timed runs of `steps` steps, one after another on the same sequences (the context grows
    from `context` by steps * repeats + 1 tokens)."""
    seqs = [("decode", i) for i in range(batch)]
    tokens = [
        int(engine.prefill(s, _prompt(context, engine.args.vocab_size, i)).argmax())
        for i, s in enumerate(seqs)
    ]
    tokens = engine.decode_step(seqs, tokens).argmax(-1).tolist()  # warm-up step
    rates, step_ms = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            tokens = engine.decode_step(seqs, tokens).argmax(-1).tolist()
        elapsed = time.perf_counter() - start
        rates.append(batch * steps / elapsed)
        step_ms.append(1000 * elapsed / steps)
    # Where the step's time went (bench/decode_profile.py), on these sequences as they now stand.
    profile = profile_step(engine, seqs, statistics.median(step_ms))
    for s in seqs:
        engine.free(s)
    return {
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_min": min(rates),
        "tokens_per_s_max": max(rates),
        "step_ms": statistics.median(step_ms),
        **({"profile": profile} if profile is not None else {}),
    }


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark and return a JSON-serialisable result."""
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    decode_tokens = args.decode_steps * args.repeats + 1
    engine = Engine.load(args.model, dtype=dtype, block_size=16, num_blocks=blocks_for_bench(decode_tokens))
    result = {
        "model": served_model_name(args.model),
        "model_id": engine.loaded.model_id,
        "device": str(engine.device),
        "dtype": str(engine.loaded.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        **machine_facts(),
        "torch": torch.__version__,
        # Whether decode ran on the C block kernels (services/engine/cpu_kernels.c) or plain PyTorch.
        "decode_kernels": "c-blocks" if engine.model.output_blocks is not None else "torch",
        "prefill": {str(n): _time_prefill(engine, n, args.repeats) for n in PREFILL_LENGTHS},
        "decode": {
            f"batch_{b}": {
                "context": DECODE_CONTEXT,
                **_time_decode(engine, b, args.decode_steps, args.repeats),
            }
            for b in DECODE_BATCHES
        },
    }
    # The roofline (bench/roofline.py): bytes per step, the bandwidth-bound ceiling and the fraction reached.
    result = add_roofline(engine, result, timed_steps=args.decode_steps * args.repeats)
    # Each load form in a child process of its own: one form's peak RSS never hides another's.
    forms = load_forms({served_model_name(args.model): args.model})
    if args.synthetic_1b:
        forms["synthetic-1b"] = synthetic_1b_forms()
        forms["synthetic-1b-q4_k_m"] = synthetic_1b_forms(types=Q4_K_M, label="Q4_K_M")
    return {**result, "weights": {"form": weights_form(), "load_forms": forms}}


def blocks_for_bench(decode_tokens: int) -> int:
    """Blocks for the largest footprint: the largest decode batch of 512-token prompts plus `decode_tokens`
    each, or one 2048-token prompt."""
    per_sequence = -(-(DECODE_CONTEXT + decode_tokens) // 16)
    return max(max(DECODE_BATCHES) * per_sequence, 2048 // 16) + 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the result as one line of JSON")
    args = parser.parse_args()
    result = run(args)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
