"""`bench isa`: our decode with the kernels built for AVX2 + FMA (-march=haswell) and natively, each in a
process of its own, on the real SmolLM2 weights; llama.cpp unavailable without a build folder; the report's
section from the result. A few decode steps at a short context: it checks the measurement runs and records
what it ran, not a speed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import isa
from bench.report import render


def _args(**changes) -> argparse.Namespace:
    options = dict(
        arch="haswell",
        llama_path=None,
        threads=1,
        repeats=1,
        decode_steps=2,
        decode_tokens=2,
        decode_context=16,
        batches=[1, 2],
    )
    return argparse.Namespace(**{**options, **changes})


@pytest.fixture(scope="module")
def result() -> dict:
    return isa.run(_args())


def test_ours_decodes_with_kernels_built_for_haswell_and_for_this_cpu(result: dict) -> None:
    assert set(result["pcpstack"]) == {"haswell", "native"}
    for arch, side in result["pcpstack"].items():
        assert side["available"], side
        assert side["march"] == arch
        assert set(side["decode"]) == {"batch_1", "batch_2"}
        assert all(row["tokens_per_s"] > 0 for row in side["decode"].values())


def test_without_a_llama_build_llama_cpp_is_unavailable_and_no_ratio_is_made_up(result: dict) -> None:
    assert result["llama.cpp"] == {
        "available": False,
        "reason": "no --llama-path (a llama.cpp built for the same set)",
    }
    assert "ratios" not in result


def test_the_report_shows_both_builds(result: dict) -> None:
    text = render({"isa": result}, Path("bench/results"), {}, Path("BENCHMARKS.md"), None)
    section = text.split("## Narrower instruction set on this CPU", 1)[1]
    assert "| pcpstack -march=haswell | 1 |" in section
    assert "| pcpstack -march=native | 2 |" in section
    assert "- llama.cpp: unavailable: no --llama-path" in section


def test_a_llama_path_that_is_not_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--llama-path=.*is not a folder"):
        isa.run(_args(llama_path=str(tmp_path / "missing"), batches=[1]))


def test_batches_must_be_positive() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--batches='0,4'"):
        isa._batches("0,4")
