"""`pcpstack bench all`: every benchmark area with its own defaults, then BENCHMARKS.md and its plots.

Each area runs as its own `python -m bench <area> --out DIR` process, so one area's threads, memory and
loaded models never weigh on the next and each parses only its own options. --smoke runs every area at the
tiny sizes CI uses (SMOKE_ARGS). The report goes to BENCHMARKS.md and bench/plots/ when the results go to
bench/results/, and next to the results (DIR/BENCHMARKS.md, DIR/plots/) otherwise, so a smoke run never
overwrites the real report.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from bench.report import NOTES_PATH, PLOTS_DIR, REPORT_PATH, RESULTS_DIR, load_results, write_report

AREAS = ("registry", "kv", "engine", "prefill", "decode", "peers", "e2e")
SMOKE_ARGS: dict[str, list[str]] = {
    "engine": [
        *("--model", "tiny", "--threads", "1", "--repeats", "1", "--decode-steps", "2"),
        "--no-synthetic-1b",
    ],
    # etcd only (the memory backend runs the same measurement): a 3-member etcd and one leader failover
    "registry": ["--nodes", "20", "--duration", "1", "--lease", "3", "--backend", "etcd", "--failovers", "1"],
    "kv": ["--bytes", "1MiB", "--repeats", "1"],
    "prefill": ["--tokens", "64", "--pcp", "1,2", "--model", "tiny", "--repeats", "1"],
    # One TP group only (DCP=2 of TP=4): each size starts four rank processes.
    "decode": [
        *("--model", "tiny", "--tp", "4", "--dcp", "2"),
        *("--context", "64", "--steps", "2", "--repeats", "1", "--collective-rounds", "1"),
    ],
    "peers": ["--tokens", "32", "--repeats", "1", "--decode-context", "32", "--decode-tokens", "4"],
    "e2e": [
        *("--model", "tiny", "--concurrency", "1,2", "--prompt-tokens", "16", "--max-tokens", "4"),
        *("--overhead-tokens", "64", "--repeats", "2"),
        # Served PCP, both sizes' stacks up together, two rounds (the second in flipped order): served
        # TTFT, its breakdown from real spans, and the raw prefill beside each timed request.
        *("--served-pcp", "1,2", "--served-tokens", "64", "--scaling-seconds", "0.3"),
        # Two turns: the second reads the first's 18 full prefix blocks of 16 (288 tokens) from the store.
        *("--multi-turn", "2", "--history-tokens", "300", "--turn-tokens", "8"),
    ],
}


def _area_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = sorted(set(names) - set(AREAS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown area(s) {unknown}; choose from {', '.join(AREAS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `pcpstack bench all`."""
    parser.add_argument(
        "--areas", type=_area_list, default=list(AREAS), help=f"areas to run (default {','.join(AREAS)})"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, as CI runs them")


def run(args: argparse.Namespace) -> dict:
    """Runs each area in turn, writes the report, returns {area: result}; raises if an area failed (after
    writing the report from the areas that succeeded)."""
    out = Path(args.out)
    failed = []
    for area in args.areas:
        print(f"bench all: {area}", file=sys.stderr, flush=True)
        command = [sys.executable, "-m", "bench", area, "--out", str(out)]
        command += SMOKE_ARGS[area] if args.smoke else []
        if subprocess.run(command, stdout=subprocess.DEVNULL).returncode:
            failed.append(area)
    if out.resolve() == RESULTS_DIR.resolve():
        write_report(out, REPORT_PATH, PLOTS_DIR, NOTES_PATH)
    else:
        write_report(out, out / REPORT_PATH.name, out / "plots", NOTES_PATH)
    if failed:
        raise RuntimeError(f"bench all: {', '.join(failed)} failed (their errors are above)")
    results = load_results(out)
    return {area: results[area] for area in args.areas}
