"""bench/machine.py's two-process scaling: real spawned processes doing real matmuls, alone and as a pair;
and the prefill section of the report states it beside the PCP speedups."""

from __future__ import annotations

from pathlib import Path

from bench.machine import two_process_scaling
from bench.report import render
from tests.bench.test_report import _prefill


def test_two_processes_report_their_rates_and_their_sum_over_one_alone() -> None:
    scaling = two_process_scaling(seconds=0.2, rounds=1)  # each process imports torch: ~2 s apiece
    assert scaling["alone_gflops"] > 0
    assert len(scaling["pair_gflops"]) == 2 and min(scaling["pair_gflops"]) > 0
    assert scaling["scaling"] == round(sum(scaling["pair_gflops"]) / scaling["alone_gflops"], 2)
    assert scaling["lockstep"] == round(2 * min(scaling["pair_gflops"]) / scaling["alone_gflops"], 2)
    assert scaling["rounds"] == 1


def test_the_prefill_section_states_the_ceiling_of_pcp2_over_pcp1() -> None:
    prefill = {
        **_prefill(),
        "two_process_scaling": {"alone_gflops": 140.0, "pair_gflops": [70.5, 69.5], "scaling": 1.0},
    }
    text = render({"prefill": prefill}, Path("bench/results"), {}, Path("BENCHMARKS.md"), None)
    assert (
        "Two one-thread processes together did 1.00× the fp32 matmul work of one alone on this machine "
        "in the same run (140.0 GFLOP/s alone, 70.5 + 69.5 together)"
    ) in text
