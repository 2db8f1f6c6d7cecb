"""`pcpstack bench isa`: decode on this CPU with both sides built for a narrower instruction set (AVX2 + FMA
by default), a stand-in for a CPU that has only that set.

Issue #21 measured the C kernels on an AVX2-only CPU at a fraction of llama.cpp's speed there. A session
without such a machine can still run the same code paths: our kernels built with `-march=haswell`
(PCPSTACK_KERNEL_ARCH) and a llama.cpp built with AVX-512 off, side by side on this CPU, each in a process of
its own. It is not the same as an AVX2-only CPU (another core, another memory system); it is the same
instructions. The native build runs in the same pass, so the cost of the narrower set is measured too.

Rows: ours at --arch and natively, decode tokens/s at the --batches sizes after --decode-context tokens
(bench/engine.py's measurement), and llama.cpp's single stream from the build in --llama-path (bench
peers' measurement), with the instruction sets llama.cpp reports it was built for.

llama.cpp for --llama-path, built without AVX-512 into a folder of its own (the README has the command):
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF ..." \\
    pip install --no-deps --target DIR llama-cpp-python
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from bench.machine import machine_facts
from bench.peers import in_own_process
from pcpstack.engine.weights import default_model_path


def _batches(text: str) -> list[int]:
    sizes = [int(x) for x in text.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--batches={text!r}: give batch sizes >= 1, e.g. 1,16")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `pcpstack bench isa`."""
    parser.add_argument(
        "--arch", default="haswell", help="gcc -march for our kernels (default haswell: AVX2 + FMA)"
    )
    parser.add_argument(
        "--llama-path",
        default=None,
        help="folder holding a llama-cpp-python built for the same set (pip install --target); without it "
        "llama.cpp is reported unavailable",
    )
    parser.add_argument("--threads", type=int, default=2, help="threads of each side")
    parser.add_argument("--repeats", type=int, default=5, help="timed decode runs per batch size")
    parser.add_argument("--decode-steps", type=int, default=32, help="timed steps per run (ours)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens per run (llama.cpp)")
    parser.add_argument("--decode-context", type=int, default=512, help="prompt tokens before decode")
    parser.add_argument("--batches", type=_batches, default=[1, 16], help="our decode batch sizes")


def _ours(gguf: Path, args: argparse.Namespace) -> dict:
    """Our decode with the kernels built for args.arch ("native": this CPU's own set)."""
    from pcpstack.engine import cpu_kernels

    os.environ[cpu_kernels.ARCH_ENV] = args.arch  # read when the library is built, below
    from bench.engine import _time_decode
    from pcpstack.engine.engine import Engine

    if cpu_kernels.library() is None:
        return {"available": False, "reason": f"our kernels did not build (or lost to torch) for {args.arch}"}
    steps = args.decode_steps * args.repeats + 1
    per_sequence = -(-(args.decode_context + steps) // 16)
    engine = Engine.load(str(gguf), block_size=16, num_blocks=max(args.batches) * per_sequence + 8)
    rows = {}
    for batch in args.batches:
        rows[f"batch_{batch}"] = _time_decode(
            engine, batch, args.decode_steps, args.repeats, args.decode_context
        )
    return {"available": True, "march": args.arch, "decode": rows}


def _llama(gguf: Path, args: argparse.Namespace) -> dict:
    """llama.cpp's single stream from the build in args.llama_path (bench peers' measurement)."""
    from bench.peers import _llama_cpp

    folder = Path(args.llama_path).resolve()
    sys.path.insert(0, str(folder))
    import llama_cpp

    if not Path(llama_cpp.__file__).resolve().is_relative_to(folder):
        raise RuntimeError(f"--llama-path={folder}: llama_cpp was imported from {llama_cpp.__file__} instead")
    system_info = llama_cpp.llama_print_system_info().decode()
    result = _llama_cpp(gguf, argparse.Namespace(**{**vars(args), "tokens": []}))
    return {**result, "path": str(folder), "system_info": system_info}


def _with(args: argparse.Namespace, **changes) -> argparse.Namespace:
    options = {key: value for key, value in vars(args).items() if not callable(value)}
    return argparse.Namespace(**{**options, **changes})


def run(args: argparse.Namespace) -> dict:
    """Ours at --arch and natively, then llama.cpp from --llama-path, each in its own process."""
    if args.threads < 1:
        raise SystemExit(f"--threads={args.threads}: must be >= 1")
    if args.llama_path is not None and not Path(args.llama_path).is_dir():
        raise SystemExit(f"--llama-path={args.llama_path} is not a folder")
    facts = machine_facts()  # before the runs: the load average says how busy the machine already was
    gguf = default_model_path()
    ours = {
        arch: in_own_process(f"pcpstack-{arch}", _ours, gguf, _with(args, arch=arch))
        for arch in (args.arch, "native")
    }
    if args.llama_path is None:
        llama = {"available": False, "reason": "no --llama-path (a llama.cpp built for the same set)"}
    else:
        llama = in_own_process("llama.cpp", _llama, gguf, args)
    result = {
        "benchmark": "isa",
        "model": gguf.name,
        "threads": args.threads,
        "repeats": args.repeats,
        "context": args.decode_context,
        "torch": torch.__version__,
        **facts,
        "pcpstack": ours,
        "llama.cpp": llama,
    }
    rate = llama.get("decode", {}).get("tokens_per_s_median") if llama.get("available") else None
    if rate:
        result["ratios"] = {
            arch: {batch: round(row["tokens_per_s"] / rate, 2) for batch, row in side["decode"].items()}
            for arch, side in ours.items()
            if side.get("available")
        }
    return result
