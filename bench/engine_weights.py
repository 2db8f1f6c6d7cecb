"""What holding weights in their stored form costs and saves (services/engine/weights.py).

- `load_forms`: load time and peak RSS of a fresh process that loads one model in one form ("stored": a
  GGUF's quantized blocks or a folder's 16-bit tensors; "dense": every weight in fp32), each in its own child
  process so that one form's peak never hides another's. The RSS counts the process's own baseline (Python,
  torch) and the GGUF pages it maps while reading; `baseline_rss_mb` is what the process held before loading.
- `write_synthetic_gguf`: a Llama-3.2-1B-shaped Q4_1 GGUF of random weights (dim 2048, 16 layers, hidden
  8192, 32 heads, 8 KV heads, vocabulary 128256, tied embeddings), to measure a model larger than SmolLM2;
  with `types=Q4_K_M`, its tensors in the types of llama.cpp's most used Q4_K_M files (Q4_K, with Q6_K for
  the value and down projections and the tied embedding).
- `q6_k_projection_ab`: microseconds of one Q6_K projection (a 1B model's down projection, 2048 x 8192) at
  1 and 16 rows on the block kernel against torch's dense fp32 matmul of the same weight, interleaved, over
  enough copies of the weight that they stream from memory as a model's weights do.
- `prefill_ab`: prefill seconds (wall and thread CPU) per prompt length and decode tokens/s at batch 1, both
  forms of one model loaded in one process and timed interleaved, round after round (medians with their
  spread).

`python -m bench.engine_weights [--model M] [--ab] [--synthetic-1b] [--q6-k]` prints the result as JSON;
`bench engine` includes `load_forms` in its result.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

FORMS = ("stored", "dense")
# GGUF types by tensor (its name without ".weight", or its role: "attn_v", "token_embd", ...; "default" for
# the rest), as llama.cpp's Q4_K_M writes them (it also keeps Q4_K for some value and down projections).
Q4_K_M = {"default": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}
SYNTHETIC_1B = {"dim": 2048, "layers": 16, "hidden": 8192, "heads": 32, "kv_heads": 8, "vocab": 128256}
AB_LENGTHS = (42, 512, 2048)
DECODE_STEPS = 32


def load_in_child(model: str | None, form: str, threads: int | None = None) -> dict:
    """{"load_s", "peak_rss_mb", "baseline_rss_mb", "weights_mb"} of a fresh process loading `model`
    (None: the embedded default) with its weights in `form`."""
    command = [sys.executable, "-m", "bench.engine_weights", "--child-form", form, "--model", model or ""]
    if threads:
        command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"loading {model or 'the default model'} ({form}) failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_forms(models: dict[str, str | None], forms: tuple[str, ...] = FORMS) -> dict[str, dict]:
    """{label: {form: load_in_child(...)}} for each model of `models` ({label: model path or None})."""
    return {label: {form: load_in_child(model, form) for form in forms} for label, model in models.items()}


def _child(model: str | None, form: str) -> dict:
    """Runs in the child process: load the model once and report (see load_in_child)."""
    from pcpstack.engine.weights import load_model

    baseline = _peak_rss_mb()
    started = time.perf_counter()
    loaded = load_model(model, device="cpu", dtype=torch.float32, weights=form)
    load_s = time.perf_counter() - started
    peak = _peak_rss_mb()
    return {
        "load_s": round(load_s, 3),
        "peak_rss_mb": round(peak, 1),
        "baseline_rss_mb": round(baseline, 1),
        "weights_mb": round(_weights_bytes(loaded.model) / 2**20, 1),
    }


def _peak_rss_mb() -> float:
    """This process's peak resident set in MiB: /proc's VmHWM where there is one, since getrusage's
    ru_maxrss starts a child at its parent's resident set at the fork and keeps it across exec (a parent
    holding an engine would set every child's floor); else ru_maxrss."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _weights_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights hold: its parameters and the quantized blocks (shared ones once)."""
    seen: set[int] = set()
    total = 0
    for tensor in model.parameters():
        total += tensor.numel() * tensor.element_size()
    holders = [model, *model.modules()]
    blocks = [getattr(m, "blocks", None) for m in holders] + [getattr(model, "output_blocks", None)]
    for block in blocks:
        if block is not None and id(block) not in seen:
            seen.add(id(block))
            total += block.nbytes
    return total


def random_q4_k(
    rng: np.random.Generator, rows: int, cols: int, d_range: tuple[float, float] = (1e-5, 5e-5)
) -> np.ndarray:
    """Random Q4_K bytes [rows, cols / 256 * 144] (gguf has no Q4_K quantizer): any bits for the sub-block
    scales, mins and nibbles, fp16 d and dmin drawn from `d_range`."""
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    d_dmin = rng.uniform(*d_range, (rows, cols // 256, 2)).astype(np.float16)
    blocks[..., 0:4] = d_dmin.view(np.uint8).reshape(rows, -1, 4)
    return blocks.reshape(rows, -1)


def random_q6_k(
    rng: np.random.Generator, rows: int, cols: int, d_range: tuple[float, float] = (1e-6, 5e-6)
) -> np.ndarray:
    """Random Q6_K bytes [rows, cols / 256 * 210] (gguf has no Q6_K quantizer): any bits for q and the int8
    sub-block scales, fp16 d drawn from `d_range`."""
    blocks = rng.integers(0, 256, (rows, cols // 256, 210), dtype=np.uint8)
    d = rng.uniform(*d_range, (rows, cols // 256, 1)).astype(np.float16)
    blocks[..., 208:210] = d.view(np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def write_synthetic_gguf(
    path: Path, shape: dict[str, int] = SYNTHETIC_1B, seed: int = 0, types: dict[str, str] | None = None
) -> Path:
    """A Llama GGUF of `shape` with random projections and embedding in `types` (see Q4_K_M; default all
    Q4_1; Q4_1, Q4_K, Q6_K or F16), bytes drawn directly (quantized values uniform, fp16 scales small and
    finite), fp32 norms, a byte-level tokenizer; tied embeddings. Returns `path`."""
    import gguf

    rng = np.random.default_rng(seed)
    dim, hidden, heads, kv_heads = shape["dim"], shape["hidden"], shape["heads"], shape["kv_heads"]
    head_dim = dim // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_embedding_length(dim)
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_tokenizer_model("gpt2")
    # Distinct one-character tokens (no surrogate code points), one merge making the last.
    codes = (c for c in range(0x100, 0x110000) if not 0xD800 <= c <= 0xDFFF)
    tokens = [chr(next(codes)) for _ in range(shape["vocab"] - 1)]
    tokens.append(tokens[0] + tokens[1])
    writer.add_token_list(tokens)
    writer.add_token_types([1] * shape["vocab"])
    writer.add_token_merges([f"{tokens[0]} {tokens[1]}"])
    writer.add_eos_token_id(shape["vocab"] - 1)

    def q4_1(rows: int, cols: int) -> np.ndarray:
        blocks = rng.integers(0, 256, (rows, cols // 32, 20), dtype=np.uint8)
        scale = rng.uniform(0.002, 0.02, (rows, cols // 32)).astype(np.float16)
        blocks[..., 0:2] = scale.view(np.uint8).reshape(rows, -1, 2)
        blocks[..., 2:4] = (scale * -8).view(np.uint8).reshape(rows, -1, 2)
        return blocks.reshape(rows, -1)

    def f16(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)

    makers = {
        "Q4_1": q4_1,
        "Q4_K": lambda rows, cols: random_q4_k(rng, rows, cols),
        "Q6_K": lambda rows, cols: random_q6_k(rng, rows, cols),
        "F16": f16,
    }
    chosen = types or {}

    def put(name: str, rows: int, cols: int) -> None:
        stem = name.removesuffix(".weight")
        kind = chosen.get(stem) or chosen.get(stem.split(".")[-1]) or chosen.get("default", "Q4_1")
        raw_dtype = None if kind == "F16" else gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, makers[kind](rows, cols), raw_dtype=raw_dtype)

    put("token_embd.weight", shape["vocab"], dim)
    writer.add_tensor("output_norm.weight", np.ones(dim, dtype=np.float32))
    for i in range(shape["layers"]):
        blk = f"blk.{i}."
        put(f"{blk}attn_q.weight", heads * head_dim, dim)
        put(f"{blk}attn_k.weight", kv_heads * head_dim, dim)
        put(f"{blk}attn_v.weight", kv_heads * head_dim, dim)
        put(f"{blk}attn_output.weight", dim, heads * head_dim)
        put(f"{blk}ffn_gate.weight", hidden, dim)
        put(f"{blk}ffn_up.weight", hidden, dim)
        put(f"{blk}ffn_down.weight", dim, hidden)
        writer.add_tensor(f"{blk}attn_norm.weight", np.ones(dim, dtype=np.float32))
        writer.add_tensor(f"{blk}ffn_norm.weight", np.ones(dim, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def synthetic_1b_forms(
    forms: tuple[str, ...] = FORMS, types: dict[str, str] | None = None, label: str = "Q4_1"
) -> dict[str, dict]:
    """load_in_child of the synthetic 1B-shaped GGUF (its tensors in `types`, see write_synthetic_gguf) per
    form, written to a temporary folder first."""
    with tempfile.TemporaryDirectory(prefix="pcpstack-1b-") as folder:
        path = write_synthetic_gguf(Path(folder) / f"synthetic-1b.{label}.gguf", types=types)
        result = {form: load_in_child(str(path), form) for form in forms}
        size_mb = path.stat().st_size / 2**20
    return {form: {**r, "file_mb": round(size_mb, 1)} for form, r in result.items()}


def _median(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def q6_k_projection_ab(
    rows: tuple[int, ...] = (1, 16), rounds: int = 7, threads: int = 1, n: int = 2048, k: int = 8192
) -> dict:
    """Microseconds of x [rows, k] @ W^T for a random Q6_K W [n, k]: the block kernel (quant.BlockWeight in
    the q6_k form) against torch's dense fp32 matmul of the dequantized W, interleaved call by call, each
    call on the next of enough copies of W (256 MB of fp32) that they stream from memory. Medians over
    `rounds` passes through the copies, with their spread."""
    import torch.nn.functional as F

    from pcpstack.engine.quant import from_gguf

    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    copies = max(1, (256 << 20) // (n * k * 4))
    weights = [from_gguf(random_q6_k(rng, n, k, (1e-6, 1e-4)), "Q6_K") for _ in range(copies)]
    dense = [w.dequantize() for w in weights]
    result: dict = {"shape": [n, k], "threads": threads, "copies": copies, "rounds": rounds}
    result["q6_k_bytes_per_weight"] = round(weights[0].nbytes / (n * k), 3)
    for m in rows:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        times: dict[str, list[float]] = {"blocks_us": [], "dense_us": []}
        for _ in range(rounds):
            for blocks, weight in zip(weights, dense, strict=True):
                started = time.perf_counter()
                blocks.matmul(x)
                times["blocks_us"].append((time.perf_counter() - started) * 1e6)
                started = time.perf_counter()
                F.linear(x, weight)
                times["dense_us"].append((time.perf_counter() - started) * 1e6)
        result[f"rows_{m}"] = {name: _median(values) for name, values in times.items()}
    return result


def prefill_ab(
    model: str | None, lengths: tuple[int, ...] = AB_LENGTHS, rounds: int = 3, threads: int = 1
) -> dict:
    """Prefill seconds per prompt length and decode tokens/s at batch 1 (DECODE_STEPS steps after a
    512-token prompt) for both forms of `model`, loaded in this process, timed interleaved (the order of the
    forms alternates every round)."""
    from pcpstack.engine.engine import Engine
    from pcpstack.engine.weights import load_model

    torch.set_num_threads(threads)
    blocks = max((*lengths, 512 + DECODE_STEPS * rounds + 8)) // 16 + 8
    engines = {
        form: Engine(load_model(model, "cpu", torch.float32, weights=form), block_size=16, num_blocks=blocks)
        for form in FORMS
    }
    vocab = engines["stored"].args.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths}
    for engine in engines.values():  # warm-up: first calls allocate and build
        engine.prefill("warmup", prompts[min(lengths)])
        engine.free("warmup")
    prefill: dict[str, dict[str, list[float]]] = {str(n): {f: [] for f in FORMS} for n in lengths}
    prefill_cpu: dict[str, dict[str, list[float]]] = {str(n): {f: [] for f in FORMS} for n in lengths}
    decode: dict[str, list[float]] = {f: [] for f in FORMS}
    for r in range(rounds):
        order = FORMS if r % 2 == 0 else tuple(reversed(FORMS))
        for n in lengths:
            for form in order:
                started, started_cpu = time.perf_counter(), time.thread_time()
                engines[form].prefill("ab", prompts[n])
                prefill[str(n)][form].append(time.perf_counter() - started)
                prefill_cpu[str(n)][form].append(time.thread_time() - started_cpu)
                engines[form].free("ab")
        for form in order:
            engine = engines[form]
            token = int(engine.prefill("decode", prompts[max(lengths)][:512]).argmax())
            started = time.perf_counter()
            for _ in range(DECODE_STEPS):
                token = int(engine.decode_step(["decode"], [token])[0].argmax())
            decode[form].append(DECODE_STEPS / (time.perf_counter() - started))
            engine.free("decode")
    return {
        "threads": threads,
        "rounds": rounds,
        "prefill_s": {n: {f: _median(v) for f, v in forms.items()} for n, forms in prefill.items()},
        # On one thread all of a prefill's work runs on this thread: its CPU time, which time spent waiting
        # for a core on a busy machine does not inflate.
        "prefill_thread_cpu_s": {
            n: {f: _median(v) for f, v in forms.items()} for n, forms in prefill_cpu.items()
        },
        "decode_batch_1_tokens_per_s": {f: _median(v) for f, v in decode.items()},
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    parser.add_argument("--ab", action="store_true", help="prefill/decode A/B of the two forms")
    parser.add_argument("--rounds", type=int, default=3, help="A/B rounds")
    parser.add_argument(
        "--synthetic-1b", action="store_true", help="also the synthetic 1B-shaped GGUFs (Q4_1, Q4_K_M-like)"
    )
    parser.add_argument("--q6-k", action="store_true", help="one Q6_K projection: kernel against dense")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--child-form", choices=FORMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = args.model or None
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child_form:
        print(json.dumps(_child(model, args.child_form)))
        return
    if args.q6_k:
        print(json.dumps({"q6_k_projection": q6_k_projection_ab(threads=args.threads or 1)}, indent=2))
        return
    result: dict = {"load_forms": load_forms({model or "default": model})}
    if args.synthetic_1b:
        result["load_forms"]["synthetic-1b"] = synthetic_1b_forms()
        result["load_forms"]["synthetic-1b-q4_k_m"] = synthetic_1b_forms(types=Q4_K_M, label="Q4_K_M")
    if args.ab:
        result["ab"] = prefill_ab(model, rounds=args.rounds, threads=args.threads or 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
