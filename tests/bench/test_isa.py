"""`bench isa`: our decode with the kernels built for AVX2 + FMA (-march=haswell) and natively, each in a
process of its own, on the real SmolLM2 weights; llama.cpp unavailable without a build folder; the report's
section from the result; ratios paired within rounds. A few decode steps at a short context: it checks the
measurement runs and records what it ran, not a speed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import isa
from bench.report import _isa_cpu_note, render
from pcpstack.engine import cpu_kernels


def _args(**changes) -> argparse.Namespace:
    options = dict(
        arch="haswell",
        llama_path=None,
        threads=1,
        repeats=1,
        rounds=1,
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
        assert side["mtune"] in cpu_kernels.TUNINGS  # the tuning its first build chose here
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

    def name(arch: str) -> str:
        tuning = result["pcpstack"][arch]["mtune"]
        return f"pcpstack -march={arch}" + (f" -mtune={tuning}" if tuning else "")

    assert f"| {name('haswell')} | 1 |" in section
    assert f"| {name('native')} | 2 |" in section
    assert "- llama.cpp: unavailable: no --llama-path" in section


def test_a_llama_path_that_is_not_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"--llama-path=.*is not a folder"):
        isa.run(_args(llama_path=str(tmp_path / "missing"), batches=[1]))


def test_a_llama_build_that_cannot_be_imported_is_reported_unavailable_not_a_crash(tmp_path: Path) -> None:
    # As a --no-deps --target install without diskcache: llama_cpp's own import fails inside the folder.
    package = tmp_path / "llama_cpp"
    package.mkdir()
    (package / "__init__.py").write_text("import diskcache_not_installed_here\n")
    result = isa.run(_args(llama_path=str(tmp_path), batches=[1]))
    llama = result["llama.cpp"]
    assert llama["available"] is False
    assert "cannot be imported (No module named 'diskcache_not_installed_here')" in llama["reason"]
    assert result["pcpstack"]["native"]["available"]  # our side was still measured
    assert "ratios" not in result


def test_batches_must_be_positive() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="--batches='0,4'"):
        isa._batches("0,4")


def test_rounds_must_be_positive() -> None:
    with pytest.raises(SystemExit, match="--rounds=0: must be >= 1"):
        isa.run(_args(rounds=0))


def _decode(rate: float) -> dict:
    return {"tokens_per_s": rate, "tokens_per_s_min": rate - 1, "tokens_per_s_max": rate + 1, "profile": rate}


def _round(haswell_16: float, native_16: float, llama: float) -> tuple[dict, dict]:
    ours = {
        arch: {"available": True, "march": arch, "decode": {"batch_16": _decode(rate)}}
        for arch, rate in (("haswell", haswell_16), ("native", native_16))
    }
    rate = {"tokens_per_s_median": llama, "tokens_per_s_min": llama - 1, "tokens_per_s_max": llama + 1}
    return ours, {"available": True, "version": "0.3", "decode": rate}


def test_each_ratio_is_paired_within_a_round_and_each_row_is_its_median_round() -> None:
    # llama.cpp drifts from 100 to 160 between rounds; ours drifts with it: paired ratios stay near 3,
    # while the medians of each side alone (420 / 150) would read 2.8x.
    rounds = [_round(300, 500, 100), _round(480, 600, 160), _round(420, 550, 150)]
    ours, llama, ratios = isa._combine(rounds)
    row = ours["haswell"]["decode"]["batch_16"]
    assert row["tokens_per_s"] == 420 and row["profile"] == 420  # the median round's own row, whole
    assert row["rounds_tokens_per_s"] == [300, 480, 420]
    assert llama["decode"]["tokens_per_s_median"] == 150
    assert llama["decode"]["rounds_tokens_per_s"] == [100, 160, 150]
    assert ratios["haswell"]["batch_16"] == {"median": 3.0, "min": 2.8, "max": 3.0, "rounds": [3.0, 3.0, 2.8]}
    assert ratios["native"]["batch_16"]["rounds"] == [5.0, 3.75, 3.67]
    text = render(
        {"isa": {"rounds": 3, "pcpstack": ours, "llama.cpp": llama, "ratios": ratios}},
        Path("bench/results"),
        {},
        Path("BENCHMARKS.md"),
        None,
    )
    section = text.split("## Narrower instruction set on this CPU", 1)[1]
    assert "| pcpstack -march=haswell | 16 | 420 (300–480) | 3.00× (2.80–3.00) |" in section
    ours["native"]["mtune"] = "generic"  # a library built with gcc's generic tuning says so
    isa_result = {"rounds": 3, "pcpstack": ours, "llama.cpp": llama}
    text = render({"isa": isa_result}, Path("bench/results"), {}, Path("BENCHMARKS.md"), None)
    assert "| pcpstack -march=native -mtune=generic | 16 | 550 (500–600) |" in text
    assert "| llama.cpp (same set) | 1 | 150 (100–160) | 1.00× |" in section
    assert "3 rounds" in section


def test_a_round_without_llama_cpp_leaves_no_ratio() -> None:
    missing = {"available": False, "reason": "llama.cpp's process was killed by SIGKILL before reporting"}
    rounds = [_round(300, 500, 100), (_round(480, 600, 160)[0], missing)]
    ours, llama, ratios = isa._combine(rounds)
    assert llama == missing and ratios == {}
    assert ours["native"]["decode"]["batch_16"]["rounds_tokens_per_s"] == [500, 600]


def test_the_report_says_whether_its_cpu_had_the_wider_set_or_only_avx2() -> None:
    wide = _isa_cpu_note({"cpu_model": "AMD EPYC", "cpu_flags": ["avx2", "fma", "avx512f"]})
    assert wide.startswith("A stand-in for a CPU without AVX-512")
    narrow = _isa_cpu_note({"cpu_model": "AMD EPYC", "cpu_flags": ["avx2", "fma"]})
    assert narrow.startswith("This CPU (AMD EPYC: avx2, fma) has no AVX-512")
    assert "not a stand-in" in narrow
