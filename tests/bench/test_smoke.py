"""Every benchmark runs end to end at tiny sizes, so none can rot; full runs are by hand (see README)."""

from __future__ import annotations

import json
import subprocess

import pytest

from bench.all import SMOKE_ARGS
from bench.engine_weights import write_synthetic_gguf
from bench.kv import PATHS as KV_PATHS
from pcpstack.cli.launch import cli_command

# A Llama GGUF small enough for the peers' smoke run (random Q4_1 weights, a byte-level tokenizer).
TINY_GGUF_SHAPE = {"dim": 64, "hidden": 128, "heads": 4, "kv_heads": 2, "layers": 2, "vocab": 512}


@pytest.mark.slow
@pytest.mark.parametrize("area", sorted(SMOKE_ARGS))
def test_benchmark_smoke_run_writes_json(area, tmp_path, child_env) -> None:
    extra = []
    if area == "peers":  # transformers takes ~30 s to read SmolLM2's GGUF; a tiny one runs the same code
        extra = ["--gguf", str(write_synthetic_gguf(tmp_path / "tiny.gguf", TINY_GGUF_SHAPE))]
    run = subprocess.run(
        cli_command(
            "bench",
            area,
            "--json",
            "--out",
            str(tmp_path),
            *SMOKE_ARGS[area],
            *extra,
        ),
        capture_output=True,
        text=True,
        env=child_env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads((tmp_path / f"{area}.json").read_text())
    assert saved == json.loads(run.stdout)
    assert saved  # each bench reports something
    if area == "peers":  # transformers loaded the file and ran; llama.cpp too, or it says why not
        # (llama-cpp-python is the optional [bench] extra: a fresh clone's venv has no llama.cpp)
        peers = saved["peers"]
        assert peers["transformers"]["available"], peers["transformers"]
        assert peers["llama.cpp"]["available"] or peers["llama.cpp"]["reason"], peers["llama.cpp"]
    if area == "kv":  # every path, the full store's included, moved the bytes it was given
        assert all(saved[path]["put_mb_s"] > 0 and saved[path]["get_mb_s"] > 0 for path in KV_PATHS)
        assert all(saved[path]["store_cpu_per_object_ms"] >= 0 for path in KV_PATHS)  # reported for each
        assert len(set(saved["shm_mixed"]["sizes"])) > 1
    if area == "e2e":  # the second turn took the first turn's 18 full prefix blocks of 16 from the store
        second = saved["multi_turn"]["turns"][1]
        assert (second["cached_tokens"], second["cold_cached_tokens"]) == (288, 0)
        assert second["same_answers"]
        # Both sizes' served requests and the raw prefills beside them, measured in each of two rounds.
        rows = saved["served"]["rows"]
        assert [row["pcp"] for row in rows] == [1, 2]
        for row in rows:
            assert row["served_ttft_s"]["n"] == row["raw_prefill_s"]["n"] == 2
            assert row["served_ttft_s"]["median"] > 0 and row["raw_prefill_s"]["median"] > 0
            assert row["store_cpu_s"]["n"] == 2 and row["store_cpu_s"]["min"] >= 0
            assert "overhead_paired_pct" in row
        for key in ("speedup", "raw_speedup", "speedup_paired", "raw_speedup_paired"):
            assert set(saved["served"][key]) == {"pcp2_over_pcp1_at_64"}, key
        # The cores' ceiling for PCP=2 over PCP=1, measured beside the stacks before and after the rounds.
        scalings = saved["served"]["two_process_scaling"]
        assert len(scalings) == 2
        assert all(s["alone_gflops"] > 0 and 0 < s["lockstep"] <= 2.5 for s in scalings)
        # Where the cores went under load: every kind of process of the stack is counted (the tiny
        # model's forwards may each take less than the 10 ms clock tick, so only the total must show).
        roles = {"prefill", "decode", "kvstore", "registry", "clients", "idle", "elsewhere"}
        for row in saved["load"]:
            assert roles <= set(row["cpu_s"]) and row["wall_s"] > 0
            # The set's metrics counted the forwards of the run: together they took every client's prompt.
            assert 1 <= row["forwards"] <= row["clients"]
            assert row["forwards"] * row["prompts_per_forward"] == pytest.approx(row["clients"], rel=0.01)
        assert sum(row["cpu_s"][r] for row in saved["load"] for r in roles - {"idle", "elsewhere"}) > 0
