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

This machine's speed drifts by a third over a day and by 10-25 % within minutes, and llama.cpp's single
stream with it, so one run of each side minutes apart says little about their ratio. --rounds runs all three
--rounds times (every other round in the reverse order), and each ratio to llama.cpp is taken within a
round, between runs a few minutes apart: the report gives the median of those paired ratios and their
spread. Each side's row is its median round's, with every round's rate beside it.

llama.cpp for --llama-path, built without AVX-512 into a folder of its own (the README has the command):
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF ..." \\
    pip install --no-deps --target DIR llama-cpp-python diskcache
(--no-deps keeps the venv's numpy; llama_cpp imports diskcache, which the folder must then hold itself)
"""

from __future__ import annotations

import argparse
import os
import statistics
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
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of all three sides, for ratios paired within a round"
    )
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

    lib = cpu_kernels.library()
    if lib is None:
        return {"available": False, "reason": f"our kernels did not build (or lost to torch) for {args.arch}"}
    steps = args.decode_steps * args.repeats + 1
    per_sequence = -(-(args.decode_context + steps) // 16)
    engine = Engine.load(str(gguf), block_size=16, num_blocks=max(args.batches) * per_sequence + 8)
    rows = {}
    for batch in args.batches:
        rows[f"batch_{batch}"] = _time_decode(
            engine, batch, args.decode_steps, args.repeats, args.decode_context
        )
    return {"available": True, "march": args.arch, "mtune": cpu_kernels.tuned_as(lib), "decode": rows}


def _llama(gguf: Path, args: argparse.Namespace) -> dict:
    """llama.cpp's single stream from the build in args.llama_path (bench peers' measurement)."""
    from bench.peers import _llama_cpp

    folder = Path(args.llama_path).resolve()
    sys.path.insert(0, str(folder))
    try:
        import llama_cpp
    except ImportError as exc:  # e.g. a --no-deps install without diskcache, which llama_cpp imports
        reason = f"llama_cpp in --llama-path={folder} cannot be imported ({exc}); see the module's docstring"
        return {"available": False, "reason": reason}
    if not Path(llama_cpp.__file__).resolve().is_relative_to(folder):
        raise RuntimeError(f"--llama-path={folder}: llama_cpp was imported from {llama_cpp.__file__} instead")
    system_info = llama_cpp.llama_print_system_info().decode()
    result = _llama_cpp(gguf, argparse.Namespace(**{**vars(args), "tokens": []}))
    return {**result, "path": str(folder), "system_info": system_info}


def _with(args: argparse.Namespace, **changes) -> argparse.Namespace:
    options = {key: value for key, value in vars(args).items() if not callable(value)}
    return argparse.Namespace(**{**options, **changes})


def _median_round(rates: list[float]) -> int:
    """The index of the round whose rate is the median (the lower middle one for an even count)."""
    order = sorted(range(len(rates)), key=rates.__getitem__)
    return order[(len(order) - 1) // 2]


def _one_round(gguf: Path, args: argparse.Namespace, reverse: bool) -> tuple[dict, dict]:
    """Ours at --arch and natively, and llama.cpp, each in its own process ({arch: ours}, llama)."""
    archs = list(dict.fromkeys((args.arch, "native")))  # --arch native runs once
    sides = [*(("ours", arch) for arch in archs), ("llama", None)]
    ours, llama = {}, {"available": False, "reason": "no --llama-path (a llama.cpp built for the same set)"}
    for kind, arch in reversed(sides) if reverse else sides:
        if kind == "ours":
            ours[arch] = in_own_process(f"pcpstack-{arch}", _ours, gguf, _with(args, arch=arch))
        elif args.llama_path is not None:
            llama = in_own_process("llama.cpp", _llama, gguf, args)
    return {arch: ours[arch] for arch in archs}, llama


def _llama_rate(llama: dict) -> float | None:
    return llama.get("decode", {}).get("tokens_per_s_median") if llama.get("available") else None


def _combine(rounds: list[tuple[dict, dict]]) -> tuple[dict, dict, dict]:
    """(ours, llama, ratios) over the rounds: each side's median round's result with every round's rate
    beside it, and each ratio to llama.cpp as the median of the rounds' own ratios with their spread."""
    ours = {}
    for arch in rounds[0][0]:
        sides = [r[0][arch] for r in rounds]
        if not all(side.get("available") for side in sides):
            ours[arch] = next(side for side in sides if not side.get("available"))
            continue
        decode = {}
        for batch in sides[0]["decode"]:
            rates = [side["decode"][batch]["tokens_per_s"] for side in sides]
            row = sides[_median_round(rates)]["decode"][batch]
            decode[batch] = {**row, "rounds_tokens_per_s": rates}
        ours[arch] = {**sides[0], "decode": decode}
    llamas = [r[1] for r in rounds]
    rates = [_llama_rate(llama) for llama in llamas]
    if any(rate is None for rate in rates):
        return ours, next(llama for llama in llamas if _llama_rate(llama) is None), {}
    llama = llamas[_median_round(rates)]
    llama = {**llama, "decode": {**llama["decode"], "rounds_tokens_per_s": rates}}
    ratios = {}
    for arch, side in ours.items():
        if not side.get("available"):
            continue
        ratios[arch] = {}
        for batch, row in side["decode"].items():
            paired = [
                round(ours_rate / rate, 2)
                for ours_rate, rate in zip(row["rounds_tokens_per_s"], rates, strict=True)
            ]
            ratios[arch][batch] = {
                "median": round(statistics.median(paired), 2),
                "min": min(paired),
                "max": max(paired),
                "rounds": paired,
            }
    return ours, llama, ratios


def run(args: argparse.Namespace) -> dict:
    """--rounds rounds of ours at --arch and natively and llama.cpp from --llama-path, each in its own
    process; the ratios to llama.cpp paired within each round."""
    if args.threads < 1:
        raise SystemExit(f"--threads={args.threads}: must be >= 1")
    if args.rounds < 1:
        raise SystemExit(f"--rounds={args.rounds}: must be >= 1")
    if args.llama_path is not None and not Path(args.llama_path).is_dir():
        raise SystemExit(f"--llama-path={args.llama_path} is not a folder")
    facts = machine_facts()  # before the runs: the load average says how busy the machine already was
    gguf = default_model_path()
    rounds = []
    for number in range(args.rounds):
        print(f"bench isa: round {number + 1} of {args.rounds}", file=sys.stderr, flush=True)
        rounds.append(_one_round(gguf, args, reverse=number % 2 == 1))
    ours, llama, ratios = _combine(rounds)
    result = {
        "benchmark": "isa",
        "model": gguf.name,
        "threads": args.threads,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "context": args.decode_context,
        "torch": torch.__version__,
        **facts,
        "pcpstack": ours,
        "llama.cpp": llama,
    }
    if ratios:
        result["ratios"] = ratios
    return result
