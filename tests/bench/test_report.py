"""The report generator on small results shaped exactly like the benches' JSON (captured from smoke runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report
from bench.e2e import TTFT_PHASES
from bench.report import write_report

MODEL = "SmolLM2-135M-Instruct"
CPU = "AMD EPYC 7B13"  # every area of one run records the same CPU
PHASE_SECONDS = (0.01, 0.0, 0.02, 0.07, 24.0, 0.4, 3.3, 0.2)  # one request's TTFT of 28 s by phase


def _prefill(model: str = MODEL) -> dict:
    def row(tokens: int, pcp: int, ttft: float) -> dict:
        return {
            "tokens": tokens,
            "pcp": pcp,
            "ttft_s_median": ttft,
            "ttft_s_min": ttft * 0.9,
            "ttft_s_max": ttft * 1.2,
            "tokens_per_s": round(tokens / ttft, 1),
        }

    return {
        "benchmark": "prefill",
        "model": model,
        "threads_per_rank": 1,
        "repeats": 3,
        "cpu_model": CPU,
        "cpu_count": 2,
        "results": [row(2048, 1, 20.48), row(4096, 1, 50.0), row(2048, 2, 13.6533), row(4096, 2, 25.0)],
        "speedup": {"pcp2_over_pcp1_at_2048": 1.5, "pcp2_over_pcp1_at_4096": 2.0},
    }


def _peer(tokens_per_s: float, decode_tokens_per_s: float) -> dict:
    return {
        "available": True,
        "version": "0.3.36",
        "vocab_size": 49152,
        "load_s": 0.12,
        "prefill": [
            {
                "tokens": 2048,
                "ttft_s_median": round(2048 / tokens_per_s, 4),
                "ttft_s_min": round(2048 / tokens_per_s, 4),
                "ttft_s_max": round(2048 / tokens_per_s, 4),
                "tokens_per_s": tokens_per_s,
                "first_token": 282,
            }
        ],
        "decode": {
            "context": 512,
            "tokens": 32,
            "tokens_per_s_median": decode_tokens_per_s,
            "tokens_per_s_min": decode_tokens_per_s - 1,
            "tokens_per_s_max": decode_tokens_per_s + 1,
        },
    }


def _peers(llama: dict | None = None) -> dict:
    return {
        "benchmark": "peers",
        "model": f"{MODEL}.Q4_1.gguf",
        "threads": 2,
        "repeats": 3,
        "prompt": "random token ids",
        "cpu_model": CPU,
        "cpu_count": 2,
        "loadavg_1m_at_start": 0.1,
        "peers": {"transformers": _peer(50.0, 20.0), "llama.cpp": llama or _peer(100.0, 100.0)},
    }


def _engine() -> dict:
    return {
        "model_id": "26e3bf0ce738dd94",
        "device": "cpu",
        "dtype": "float32",
        "threads": 2,
        "cpu_model": CPU,
        "torch": "2.13.0+cpu",
        "prefill": {str(n): {"median_s": n / 200, "min_s": n / 210, "max_s": n / 190} for n in (512, 2048)},
        "decode": {
            "batch_1": {"context": 512, "tokens_per_s": 80.0, "step_ms": 12.5},
            "batch_8": {
                "context": 512,
                "tokens_per_s": 400.0,
                "step_ms": 20.0,
                # 2 GFLOP in 10 ms of projections, 100 MB of K/V in 5 ms of attention, 5 ms left.
                "profile": {
                    "step_ms": 20.0,
                    "projections_ms": 10.0,
                    "attention_ms": 5.0,
                    "rest_ms": 5.0,
                    "mean_context": 560.0,
                    "projection_flops": 2_000_000_000,
                    "kv_bytes": 100_000_000,
                },
            },
        },
        "roofline": {
            "copy": {"bytes": 256 * 2**20, "gb_s": 10.0, "gb_s_min": 9.0, "gb_s_max": 11.0},
            "batches": {
                # 100 MB a step at 10 GB/s: 100 steps/s; 80 tokens/s is 80 % of the ceiling.
                "batch_1": _roofline_row(80_000_000, 20_000_000, 100.0, 0.8),
                "batch_8": _roofline_row(80_000_000, 160_000_000, 333.3, 1.2),
            },
        },
    }


def _roofline_row(weights: int, kv: int, ceiling: float, fraction: float) -> dict:
    return {
        "mean_context": 560.5,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "bytes_per_step": weights + kv,
        "ceiling_tokens_per_s": ceiling,
        "fraction_of_ceiling": fraction,
    }


def _e2e() -> dict:
    def summary(median: float) -> dict:
        return {"median": median, "min": median * 0.8, "max": median * 1.5}

    return {
        "benchmark": "e2e",
        "model": MODEL,
        "pcp": 2,
        "threads_per_rank": 1,
        "cpu_model": CPU,
        "cpu_count": 2,
        "load": [
            {
                "clients": clients,
                "prompt_tokens": 512,
                "max_tokens": 32,
                "ttft_s": summary(0.5 * clients),
                "tpot_s": summary(tpot),
                "output_tokens_per_s": round(clients / tpot / 2, 1),
            }
            for clients, tpot in ((1, 0.02), (4, 0.025), (16, 0.05))
        ],
        "overhead": {
            "prompt_tokens": 2048,
            "path_ttft_s": summary(11.25),
            "in_process_prefill_s": summary(10.0),
            "in_process_threads": 2,
            "overhead_pct": 12.5,
        },
        "served": {
            "threads_per_rank": 1,
            "repeats": 3,
            "rows": [
                _served_row(1, 2048, 20.0, 19.0),
                _served_row(2, 2048, 10.5, 10.0),
                _served_row(1, 4096, 50.0, 48.0),
                _served_row(2, 4096, 28.0, 24.0),
            ],
            "speedup": {"pcp2_over_pcp1_at_2048": 1.905, "pcp2_over_pcp1_at_4096": 1.786},
            "raw_speedup": {"pcp2_over_pcp1_at_2048": 1.9, "pcp2_over_pcp1_at_4096": 2.0},
            "speedup_paired": {"pcp2_over_pcp1_at_2048": 1.88, "pcp2_over_pcp1_at_4096": 1.83},
            "raw_speedup_paired": {"pcp2_over_pcp1_at_2048": 1.95, "pcp2_over_pcp1_at_4096": 2.04},
            "breakdown": [
                {
                    "pcp": 2,
                    "tokens": 4096,
                    "request": "last",
                    "trace_id": "ab" * 16,
                    "ttft_s": 28.0,
                    "phases_s": dict(zip(TTFT_PHASES, PHASE_SECONDS, strict=True)),
                    "critical_pcp_rank": 1,
                    "critical_rank_cpu_s": 21.84,  # 90 % of its 24.4 s of forward and push
                    "kv_fetch_s": 0.5,
                    "kv_bytes": 188743680,
                }
            ],
        },
    }


def _served_row(pcp: int, tokens: int, served: float, raw: float) -> dict:
    return {
        "pcp": pcp,
        "tokens": tokens,
        "served_ttft_s": {"median": served, "min": served, "max": served * 1.1},
        "raw_prefill_s": {"median": raw, "min": raw, "max": raw},
        "overhead_pct": round(100 * (served - raw) / raw, 1),
        "overhead_paired_pct": round(100 * (served - raw) / raw - 2, 1),  # its rounds drifted
        "first_request_ttft_s": served * 1.25,
        "store_cpu_s": {"median": tokens / 8192, "min": tokens / 8192, "max": tokens / 4096},
    }


def _kv() -> dict:
    def path(put: float, get: float) -> dict:
        return {
            "put_mb_s": put,
            "get_mb_s": get,
            "put_mb_s_all": [put / 2, put, put * 1.1],
            "get_mb_s_all": [get / 2, get, get * 1.1],
        }

    return {
        "bytes": 1 << 20,
        "repeats": 3,
        "chunk_bytes": 1 << 20,
        "glibc_tunables": "",
        "cpus": 2,
        "grpc": path(1000.0, 800.0),
        "shm": path(3000.0, 2000.0),
        "shm_full": path(2500.0, 1900.0),
        # The store's CPU per object; the full store's path stands for results from before it was measured.
        "shm_mixed": {**path(2400.0, 1800.0), "store_cpu_per_object_ms": 78.0},
    }


def _registry() -> dict:
    return {
        "nodes": 20,
        "sets": 10,
        "assembly_s": 0.398,
        "heartbeat_window_s": 1.0,
        "registry_cpu_pct_of_one_core": 11.9,
        "clients_cpu_pct_of_one_core": 22.2,
        "targets": {"assembly_s": "< 1", "registry_cpu_pct_of_one_core": "< 25"},
    }


def _write(folder: Path, **areas: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for area, result in areas.items():
        (folder / f"{area}.json").write_text(json.dumps(result))
    return folder


def _generate(tmp_path: Path, **areas: dict) -> tuple[str, Path]:
    results = _write(tmp_path / "results", **areas)
    report, _ = write_report(results, tmp_path / "BENCHMARKS.md", tmp_path / "plots", tmp_path / "notes.md")
    return report.read_text(), tmp_path / "plots"


def _line(text: str, starts: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(starts))


def test_full_results_give_tables_ratios_targets_and_plots(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    text, plots = _generate(
        tmp_path,
        prefill=_prefill(),
        peers=_peers(),
        engine=_engine(),
        e2e=_e2e(),
        kv=_kv(),
        registry=_registry(),
    )
    assert "2.00× | **met**" in _line(text, "| PCP=2 TTFT speedup over PCP=1 at 4096")
    assert "| tokens | PCP | TTFT | tokens/s | speedup over PCP=1 |\n" in text  # no CPU columns without them
    # 2048 / 13.6533 s = 150 tokens/s against llama.cpp's 100
    assert "1.50× | **missed**" in _line(text, "| pcpstack PCP=2 prefill tokens/s ÷ llama.cpp's at 2048")
    # 16 clients ÷ 0.05 s TPOT = 320 tokens/s against llama.cpp's 100 single stream
    assert "3.20× | **met**" in _line(text, "| aggregate decode at 16 streams")
    assert "12.5 % | **met**" in _line(text, "| TTFT overhead of the whole path")
    assert "| 3.00× |" in _line(text, "| pcpstack PCP=2 ÷ transformers prefill tokens/s at 2048")
    assert "| 1.12× |" in _line(text, "| whole-path TTFT ÷ in-process prefill")
    assert "| 2048 | 2 | 13.7 s (12.3–16.4) | 150 | 1.50× |" in text
    assert "| shm | 3,000 (1,500–3,300) | 2,000 (1,000–2,200) |" in text
    assert "| shm, full store | 2,500 (1,250–2,750) | 1,900 (950–2,090) |  |" in text
    assert "| shm, full, mixed sizes | 2,400 (1,200–2,640) | 1,800 (900–1,980) | 78.0 ms |" in text
    assert "| 16 | 512 | 32 | 8.00 s (6.40–12.0) | 0.05 s (0.04–0.075) | 160 |" in text
    # 28 s served against 24 s raw at PCP=2 and 4096 tokens: the worst row, 16.7 %.
    assert "1.79× | **missed**" in _line(text, "| served PCP=2 TTFT speedup over PCP=1 at 4096")
    worst = _line(text, "| whole-path TTFT over the same ranks' raw prefill")
    assert "| 16.7 % | **missed** |" in worst and "worst: PCP=2 at 4096 tokens of 4 row(s)" in worst
    # overhead, its paired median, served ÷ PCP=1 and paired, raw ÷ PCP=1 and paired
    row = "| 4096 | 2 | 28.0 s (28.0–30.8) | 24.0 s (24.0–24.0) | 16.7 % | 14.7 % | 1.79× | 1.83× |"
    assert f"{row} 2.00× | 2.04× | 35.0 s | 0.5 s (0.5–1.00) |" in text
    phases = "| 28.0 | 0.01 | 0 | 0.02 | 0.07 | 24.0 | 0.4 | 3.30 | 0.2 | 0.5 | 90 % |"
    assert f"| 4096 | 2 | last {phases}" in text
    roofline = text.split("### Decode step roofline", 1)[1]
    assert "Copy bandwidth 10.0 GB/s (9.00–11.0)" in roofline
    assert "| 1 | 560 | 80.0 MB | 20.0 MB | 100 MB | 100 | 80.0 | 80 % |" in roofline
    profile = text.split("### Decode step profile", 1)[1].split("###", 1)[0]
    row = "| engine (this CPU's own set) | 8 | 560 | 20.0 ms | 10.0 ms (50 %) | 200 | 5.00 ms (25 %) | 20.0 |"
    assert f"{row} 5.00 ms |" in profile
    assert "| 1 |" not in profile  # a batch measured without a profile has no row
    for name in ("prefill_ttft", "decode_concurrency", "kv_throughput", "e2e_load"):
        assert (plots / f"{name}.png").read_bytes().startswith(b"\x89PNG")
        assert f"(plots/{name}.png)" in text


def test_missing_results_say_not_measured_yet_and_drop_stale_plots(tmp_path) -> None:
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "prefill_ttft.png").write_bytes(b"stale")
    text, plots = _generate(tmp_path, kv=_kv())
    targets = text.split("## Targets")[1].split("## Ratios")[0]
    assert targets.count("| not measured yet | **not measured yet** |") == 8
    assert "pcpstack prefill: not measured yet" in text
    assert "Whole path: not measured yet" in text
    assert not (plots / "prefill_ttft.png").exists()
    assert "prefill_ttft.png" not in text


def test_prefix_reuse_and_batching_rows_give_their_tables_and_issue_18_targets(tmp_path) -> None:
    def turn(number: int, warm: float, cold: float, cached: int) -> dict:
        return {
            "turn": number,
            "prompt_tokens": 1350 + 80 * (number - 1),
            "cached_tokens": cached,
            "cold_cached_tokens": 0,
            "warm_ttft_s": {"median": warm, "min": warm, "max": warm},
            "cold_ttft_s": {"median": cold, "min": cold, "max": cold},
            "warm_over_cold": round(warm / cold, 3),
            "same_answers": True,
        }

    e2e = {
        **_e2e(),
        "multi_turn": {
            "history_tokens": 1350,
            "turn_tokens": 48,
            "max_tokens": 32,
            "conversations": 3,
            "turns": [turn(1, 4.0, 4.0, 0), turn(2, 0.6, 4.2, 1280), turn(3, 1.3, 4.3, 1408)],
        },
        "batching": [
            {
                "clients": 16,
                "ttft_p50_s": {"batched": 4.0, "unbatched": 6.0},
                "ttft_p90_s": {"batched": 6.0, "unbatched": 9.0},
                "p50_speedup": 1.5,
            }
        ],
    }
    e2e["load"][2] |= {
        "wall_s": 10.0,
        "cpu_s": {
            "clients": 0.3,
            "registry": 0.1,
            "kvstore": 0.2,
            "prefill": 12.0,
            "decode": 4.0,
            "idle": 3.1,
            "elsewhere": 0.3,
        },
        "ttft_p50_floor_s": 3.188,
        "forwards": 16,
        "prompts_per_forward": 1.0,
        "batch_tokens": 512,
    }
    text, _ = _generate(tmp_path, e2e=e2e)
    cores = "| default | 16 | 10.0 s | 12.0 | 4.00 | 0.3 | 0.3 | 3.10 | 0.3 |"
    assert f"{cores} 16 (1.00 each) | 8.00 s | 3.19 s |" in text
    # 512-token prompts fill a batch's 512 tokens alone: the report says both stacks ran the same schedule.
    assert "Every run took one prompt a forward: a batch holds at most 512 prompt tokens" in text
    assert "| 2 | 1430 | 1280 |" in text and "| 14 % | yes |" in text
    # The worst later turn (3: 1.3 s of 4.3 s) sets the target's value: 30.2 % misses 25 %.
    assert "| 30.2 % | **missed** |" in _line(text, "| a conversation's later turn")
    batching = _line(text, "| TTFT p50 under load with batched prefill")
    assert "| 0.667× | **missed** |" in batching
    assert "TTFT p50 floor of back-to-back forwards 3.19 s against a goal of 3.00 s" in batching
    assert "| 16 | 4.00 / 6.00 s | 6.00 / 9.00 s | 1.50× |" in text


def test_unavailable_peer_is_reported_with_its_reason(tmp_path) -> None:
    unavailable = {"available": False, "reason": "llama_cpp cannot be imported (No module named 'llama_cpp')"}
    text, _ = _generate(tmp_path, prefill=_prefill(), peers=_peers(unavailable))
    assert "- llama.cpp: unavailable: llama_cpp cannot be imported" in text
    assert "**not measured yet**" in _line(text, "| pcpstack PCP=2 prefill tokens/s ÷ llama.cpp's at 2048")
    assert "| 3.00× |" in _line(text, "| pcpstack PCP=2 ÷ transformers prefill tokens/s at 2048")


def test_results_of_another_model_are_not_compared_with_the_peers(tmp_path) -> None:
    text, _ = _generate(tmp_path, prefill=_prefill(model="tiny"), peers=_peers())
    line = _line(text, "| pcpstack PCP=2 prefill tokens/s ÷ llama.cpp's at 2048")
    assert "**not measured yet**" in line
    assert "not comparable: models differ" in line
    assert "Not comparable: models differ (pcpstack tiny" in text


def test_results_from_another_cpu_are_not_compared_with_the_peers(tmp_path) -> None:
    prefill = {**_prefill(), "cpu_model": "Intel Xeon", "measured_at": "2026-11-30 19:03"}
    text, _ = _generate(tmp_path, prefill=prefill, peers=_peers())
    line = _line(text, "| pcpstack PCP=2 prefill tokens/s ÷ llama.cpp's at 2048")
    assert "**not measured yet**" in line
    assert f"measured on different CPUs (prefill: Intel Xeon; peers: {CPU})" in line
    assert "| prefill | prefill.json (2026-11-30 19:03 UTC) | Intel Xeon |" in text


def test_notes_are_copied_in_as_the_analysis(tmp_path) -> None:
    (tmp_path / "notes.md").write_text("Decode is bound by the attention gather.\n")
    text, _ = _generate(tmp_path, kv=_kv())
    assert "## What limits the missed targets\n\nDecode is bound by the attention gather." in text


def test_dcp_rows_report_each_ranks_kv_against_dcp1_and_the_cpu_flags(tmp_path) -> None:
    row = {"kv_blocks_per_rank": [256] * 9, "kv_bytes_per_rank": 256 * 1024, "block_bytes": 1024}
    decode = {
        "model": MODEL,
        "tp": 9,
        "context": 4096,
        "batch": 1,
        "threads_per_rank": 1,
        "cpu_model": "Some CPU",
        "cpu_flags": ["avx2", "fma"],
        "cpu_count": 2,
        "dcp": {
            "1": {**row, "tokens_per_s": 9.0, "tokens_per_s_min": 8.0, "tokens_per_s_max": 10.0},
            "3": {
                "kv_blocks_per_rank": [86] * 9,
                "kv_bytes_per_rank": 86 * 1024,
                "block_bytes": 1024,
                "tokens_per_s": 6.0,
                "tokens_per_s_min": 5.5,
                "tokens_per_s_max": 6.5,
            },
        },
    }
    text, _ = _generate(tmp_path, decode=decode)
    section = text.split("## Decode context parallelism: KV per rank", 1)[1]
    assert "| 1 | 0.2 MiB | 256 | 1.00 | 9.00 (8.00–10.0) |" in section
    assert "| 3 | 0.1 MiB | 86 | 0.34 | 6.00 (5.50–6.50) |" in section
    assert _line(text, "| decode |").split("|")[3].strip() == "Some CPU (avx2, fma)"
    assert "gloo ÷ host" not in section  # not measured: no table


def test_the_collectives_table_sets_gloo_against_the_host_group(tmp_path) -> None:
    timing = {"median": 2.0, "min": 1.5, "max": 2.5}
    collectives = {
        "ranks": 9,
        "gather_ranks": 3,
        "shape": [2, 576],
        "ops": 20,
        "gloo_all_reduce_ms": {"median": 24.0, "min": 23.0, "max": 25.0},
        "host_all_reduce_ms": timing,
        "gloo_all_gather_ms": {"median": 4.0, "min": 3.0, "max": 5.0},
        "host_all_gather_ms": timing,
    }
    row = {"kv_blocks_per_rank": [1], "kv_bytes_per_rank": 1024, "block_bytes": 1024, "tokens_per_s": 1.0}
    decode = {
        "model": MODEL,
        "tp": 9,
        "dcp": {"1": {**row, "tokens_per_s_min": 1.0, "tokens_per_s_max": 1.0}},
        "collectives": collectives,
    }
    text, _ = _generate(tmp_path, decode=decode)
    assert "| all-reduce of 9 ranks | 24.0 ms (23.0–25.0) | 2.00 ms (1.50–2.50) | 12.0× |" in text
    assert "| all-gather of 3 ranks | 4.00 ms (3.00–5.00) | 2.00 ms (1.50–2.50) | 2.0× |" in text


def test_served_rows_without_raw_prefill_leave_the_overhead_target_not_measured(tmp_path) -> None:
    e2e = _e2e()
    for row in e2e["served"]["rows"]:  # as `bench e2e --no-raw-prefill` writes them
        del row["raw_prefill_s"], row["overhead_pct"], row["overhead_paired_pct"]
    del e2e["served"]["raw_speedup_paired"]
    text, _ = _generate(tmp_path, e2e=e2e)
    assert "**not measured yet**" in _line(text, "| whole-path TTFT over the same ranks' raw prefill")
    assert "1.79× | **missed**" in _line(text, "| served PCP=2 TTFT speedup over PCP=1 at 4096")
    assert "| 4096 | 2 | 28.0 s (28.0–30.8) | not measured yet |  |  | 1.79× | 1.83× |  |  | 35.0 s |" in text


def test_served_pcp_shows_the_ceiling_measured_beside_the_stacks(tmp_path) -> None:
    e2e = _e2e()
    e2e["served"]["two_process_scaling"] = [
        {"alone_gflops": 100.0, "pair_gflops": [90.0, 98.0], "scaling": 1.88, "rounds": 3, "lockstep": 1.8},
        {"alone_gflops": 100.0, "pair_gflops": [96.0, 99.0], "scaling": 1.95, "rounds": 3, "lockstep": 1.92},
    ]
    text, _ = _generate(tmp_path, e2e=e2e)
    target = _line(text, "| served PCP=2 TTFT speedup over PCP=1 at 4096")
    assert "1.79× | **missed**" in target and "(before / after the rounds): 1.80× / 1.92× |" in target
    assert "(100.0 GFLOP/s alone, 90.0 + 98.0 together; 100.0 GFLOP/s alone, 96.0 + 99.0 together)" in text
    assert "could reach at most 1.80× / 1.92× on these cores then." in text
    # A result from before the ceiling was measured says nothing of it.
    text, _ = _generate(tmp_path, e2e=_e2e())
    assert "ceiling" not in _line(text, "| served PCP=2 TTFT speedup over PCP=1 at 4096")
    assert "could reach at most" not in text


def test_prefill_rows_with_rank_cpu_give_the_cpu_speedup_and_the_lockstep_ceiling(tmp_path) -> None:
    prefill = _prefill()
    for row, cpu in zip(prefill["results"], (20.0, 49.0, 11.0, 28.0), strict=True):
        row["slowest_rank_cpu_s_median"] = cpu
    prefill["two_process_scaling"] = {"alone_gflops": 100.0, "pair_gflops": [80.0, 110.0], "scaling": 1.9}
    prefill["lockstep_scaling"] = 1.6
    text, _ = _generate(tmp_path, prefill=prefill)
    assert "| 4096 | 2 | 25.0 s (22.5–30.0) | 164 | 2.00× | 28.0 s | 1.75× |" in text
    assert "| 2048 | 1 | 20.5 s (18.4–24.6) | 100 | 1.00× | 20.0 s | 1.00× |" in text
    assert "twice the slower one over one alone: 1.60×." in text


def test_a_load_run_shows_its_forwards_and_whether_batching_could_take_its_prompts() -> None:
    run = {"prompt_tokens": 512, "forwards": 16, "prompts_per_forward": 1.0, "batch_tokens": 512}
    assert report._forwards_cell(run) == "16 (1.00 each)"
    assert report._forwards_cell({"prompt_tokens": 512}) == "–"  # a result from before forwards were counted
    assert "both stacks ran the same schedule" in report._batch_limit_note([("default", run)])
    # Shorter prompts that the set batched: nothing to explain.
    batched = run | {"prompt_tokens": 128, "forwards": 5, "prompts_per_forward": 3.2}
    assert report._batch_limit_note([("default", batched), ("one prompt a forward", run)]) == ""
