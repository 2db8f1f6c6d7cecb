"""`python -m bench <area>` (what `pcpstack bench <area>` runs in a checkout): one benchmark area, or all of
them, with JSON results in bench/results/, or `report` to regenerate BENCHMARKS.md and its plots.

Each area module has `add_arguments(parser)` and `run(args) -> dict`; only the named area is imported, so
one area's dependencies never weigh on another.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from bench.report import RESULTS_DIR
from pcpstack.cli.main import DefaultsHelpFormatter
from pcpstack.common.tunables import ensure_glibc_tunables

AREAS = ("engine", "registry", "kv", "prefill", "decode", "peers", "e2e", "isa", "all")


def _run_area(args: argparse.Namespace) -> int:
    payload = importlib.import_module(f"bench.{args.area}").run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.area}.json").write_text(json.dumps(payload, indent=2) + "\n")
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        print(f"{args.area}: {json.dumps(payload)}")
    return 0


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser of `pcpstack bench`; the area named in argv adds its own options."""
    parser = argparse.ArgumentParser(prog="pcpstack bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="area", required=True)
    for area in AREAS:  # all.py runs each area in its own process, then the report
        area_parser = sub.add_parser(area, help=f"benchmark {area}", formatter_class=DefaultsHelpFormatter)
        area_parser.add_argument("--json", action="store_true", help="print the results as JSON")
        area_parser.add_argument(
            "--out", default=str(RESULTS_DIR), help=f"folder for the JSON results (default {RESULTS_DIR})"
        )
        area_parser.set_defaults(handler=_run_area)
        if argv[:1] == [area]:
            importlib.import_module(f"bench.{area}").add_arguments(area_parser)
    report_parser = sub.add_parser(
        "report",
        help="regenerate BENCHMARKS.md and plots from the results",
        formatter_class=DefaultsHelpFormatter,
    )
    if argv[:1] == ["report"]:
        from bench import report

        report.add_arguments(report_parser)
        report_parser.set_defaults(handler=report.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses argv and runs the chosen area (or the report)."""
    if argv is None:
        # The malloc tunables every service process starts with (common/tunables.py): without them a
        # rank's prefill pays fresh pages for its large intermediates (2,048 tokens at PCP=1: 5.4 s with,
        # 6.3 s without), so the raw prefill would be measured slower than the served one.
        ensure_glibc_tunables()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
