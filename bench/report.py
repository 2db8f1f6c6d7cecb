"""BENCHMARKS.md and its PNG plots, regenerated from the benches' JSON results.

`python -m bench.report` (or `pcpstack bench report`) reads whatever bench/results/<area>.json files exist
(or an area's entry in all.json), writes tables of medians and spread, the ratios against the peers and
every target of the performance work with met or missed, and draws the plots under bench/plots/ with
matplotlib (the `bench` extra). An area without results says "not measured yet": the report never fills a
gap with a number. Text in bench/notes.md, if present, is copied in as the analysis of what limits a target.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

RESULTS_DIR = Path("bench") / "results"
REPORT_PATH = Path("BENCHMARKS.md")
PLOTS_DIR = Path("bench") / "plots"
NOTES_PATH = Path("bench") / "notes.md"
AREAS = ("prefill", "peers", "engine", "decode", "e2e", "kv", "registry", "isa")
NOT_MEASURED = "not measured yet"
LLAMA = "llama.cpp"
HF = "transformers"


@dataclass(frozen=True)
class Target:
    """One target of the performance work and what the results say about it."""

    name: str
    goal: float
    at_most: bool  # the goal is a ceiling (overhead) rather than a floor (speedups)
    unit: str
    value: float | None
    basis: str

    @property
    def status(self) -> str:
        if self.value is None:
            return NOT_MEASURED
        met = self.value <= self.goal if self.at_most else self.value >= self.goal
        return "met" if met else "missed"


@dataclass(frozen=True)
class Ratio:
    """pcpstack against a peer (or against itself), with what the number is made of."""

    name: str
    value: float | None
    basis: str


def load_results(folder: Path) -> dict[str, dict]:
    """Each area's results: <area>.json, else that area's entry in all.json; absent areas are left out."""
    results: dict[str, dict] = {}
    combined = folder / "all.json"
    if combined.is_file():
        payload = json.loads(combined.read_text())
        results.update({a: r for a, r in payload.items() if a in AREAS and isinstance(r, dict)})
    for area in AREAS:
        path = folder / f"{area}.json"
        if path.is_file():
            results[area] = json.loads(path.read_text())
    return results


def _num(value: float) -> str:
    """Three significant figures without scientific notation for rates in the thousands."""
    size = abs(value)
    if size >= 100:
        return f"{value:,.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def _spread(median: float, low: float, high: float, unit: str = "") -> str:
    return f"{_num(median)}{unit} ({_num(low)}–{_num(high)})"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


# --- what the results say -------------------------------------------------------------------------------


def _prefill_rows(results: dict) -> list[dict]:
    """The PCP rows (TP=1; results from before TP rows have no `tp` and are TP=1)."""
    return [r for r in _all_prefill_rows(results) if r.get("tp", 1) == 1]


def _all_prefill_rows(results: dict) -> list[dict]:
    return results.get("prefill", {}).get("results", [])


def _prefill_row(results: dict, pcp: int, tokens: int) -> dict | None:
    return next((r for r in _prefill_rows(results) if r["pcp"] == pcp and r["tokens"] == tokens), None)


def _peer(results: dict, name: str) -> dict | None:
    peer = results.get("peers", {}).get("peers", {}).get(name)
    return peer if peer and peer.get("available") else None


def _peer_prefill(results: dict, name: str, tokens: int) -> dict | None:
    peer = _peer(results, name)
    return next((r for r in peer["prefill"] if r["tokens"] == tokens), None) if peer else None


def _peer_decode(results: dict, name: str) -> float | None:
    peer = _peer(results, name)
    return peer["decode"]["tokens_per_s_median"] if peer else None


def _e2e_decode_rows(results: dict) -> list[dict]:
    """Aggregate decode tokens/s under load: clients streams, each at 1 / median TPOT."""
    return [
        {
            "streams": row["clients"],
            "context": row["prompt_tokens"],
            "tokens_per_s": row["clients"] / row["tpot_s"]["median"],
        }
        for row in results.get("e2e", {}).get("load", [])
        if row["tpot_s"]["median"] > 0
    ]


def _comparable(results: dict, model: str | None, area: str) -> str | None:
    """Why pcpstack's `model` (from `area`'s results) cannot be compared with the peers' GGUF, or None when
    it can: same model, and the same CPU as both results record it (a ratio across machines says nothing)."""
    peers = results.get("peers", {})
    peer_model = peers.get("model", "")
    if model is None:
        return "the pcpstack result does not name its model"
    if not peer_model.startswith(Path(model).name):
        return f"models differ (pcpstack {model}, peers {peer_model})"
    ours, theirs = results.get(area, {}).get("cpu_model"), peers.get("cpu_model")
    if not ours or not theirs:
        missing = area if not ours else "peers"
        return f"the {missing} results do not record their CPU model; rerun both benches on one machine"
    if ours != theirs:
        return f"measured on different CPUs ({area}: {ours}; peers: {theirs})"
    return None


def _streams_decode(results: dict, streams: int) -> list[dict]:
    """Decode tokens/s of `streams` concurrent streams, best source first: the engine's decode step at that
    batch, then the whole path (clients ÷ median TPOT)."""
    found = []
    engine = results.get("engine", {})
    batch = engine.get("decode", {}).get(f"batch_{streams}")
    if batch:
        found.append(
            {
                "tokens_per_s": batch["tokens_per_s"],
                "context": batch["context"],
                "model": engine.get("model"),
                "area": "engine",
                "source": f"engine decode batch {streams}",
            }
        )
    row = next((r for r in _e2e_decode_rows(results) if r["streams"] == streams), None)
    if row:
        source = f"e2e: {streams} clients ÷ median TPOT"
        found.append({**row, "model": results["e2e"].get("model"), "area": "e2e", "source": source})
    return found


def _tps(row: dict | None) -> float | None:
    return row["tokens_per_s"] if row else None


def prefill_against_peer(results: dict, pcp: int, tokens: int, peer: str) -> tuple[float | None, str]:
    """pcpstack PCP=`pcp` prefill tokens/s ÷ the peer's at `tokens`, and what it is made of."""
    ours, theirs = _tps(_prefill_row(results, pcp, tokens)), _tps(_peer_prefill(results, peer, tokens))
    if ours is None or theirs is None:
        missing = "bench prefill" if ours is None else f"bench peers ({peer})"
        return None, f"{NOT_MEASURED}: no {missing} result at {tokens} tokens"
    prefill = results["prefill"]
    reason = _comparable(results, prefill.get("model"), "prefill")
    if reason:
        return None, f"not comparable: {reason}"
    basis = f"{_num(ours)} ÷ {_num(theirs)} tokens/s"
    threads, peer_threads = pcp * prefill.get("threads_per_rank", 0), results["peers"].get("threads")
    if threads != peer_threads:
        basis += f"; threads differ ({threads} vs {peer_threads})"
    return ours / theirs, basis


def decode_against_peer(results: dict, streams: int, peer: str) -> tuple[float | None, str]:
    """pcpstack's aggregate decode tokens/s at `streams` streams ÷ the peer's single stream."""
    candidates, theirs = _streams_decode(results, streams), _peer_decode(results, peer)
    if not candidates or theirs is None:
        missing = "bench engine or bench e2e" if not candidates else f"bench peers ({peer})"
        return None, f"{NOT_MEASURED}: no {missing} result for {streams} stream(s)"
    ours = next((c for c in candidates if _comparable(results, c["model"], c["area"]) is None), None)
    if ours is None:
        first = candidates[0]
        return None, f"not comparable: {_comparable(results, first['model'], first['area'])}"
    basis = f"{_num(ours['tokens_per_s'])} ({ours['source']}) ÷ {_num(theirs)} tokens/s"
    peer_context = results["peers"]["peers"][peer]["decode"]["context"]
    if ours["context"] != peer_context:
        basis += f"; contexts differ ({ours['context']} vs {peer_context})"
    return ours["tokens_per_s"] / theirs, basis


def compute_ratios(results: dict) -> list[Ratio]:
    """pcpstack against llama.cpp and transformers, PCP=2 against PCP=1, the whole path against in-process."""
    ratios = []
    for tokens in sorted({r["tokens"] for r in _prefill_rows(results)}) or [2048]:
        for pcp in (2, 1):
            for peer in (LLAMA, HF):
                name = f"pcpstack PCP={pcp} ÷ {peer} prefill tokens/s at {tokens} tokens"
                ratios.append(Ratio(name, *prefill_against_peer(results, pcp, tokens, peer)))
    for key, value in results.get("prefill", {}).get("speedup", {}).items():
        ratios.append(Ratio(f"TTFT speedup {key.replace('_', ' ')}", value, "median TTFT PCP=1 ÷ PCP=n"))
    for streams in (16, 1):
        for peer in (LLAMA, HF):
            name = f"pcpstack {streams}-stream decode tokens/s ÷ {peer} single stream"
            ratios.append(Ratio(name, *decode_against_peer(results, streams, peer)))
    overhead = results.get("e2e", {}).get("overhead")
    name = "whole-path TTFT ÷ in-process prefill"
    if overhead:
        path, local = overhead["path_ttft_s"]["median"], overhead["in_process_prefill_s"]["median"]
        ratios.append(Ratio(name, path / local, f"{overhead['prompt_tokens']}-token prompt, medians"))
    else:
        ratios.append(Ratio(name, None, f"{NOT_MEASURED}: no bench e2e result"))
    return ratios


def compute_targets(results: dict) -> list[Target]:
    """The targets of the performance work (issues 8 and 21), each from the results that measure it."""
    prefill = results.get("prefill", {})
    speedup = prefill.get("speedup", {}).get("pcp2_over_pcp1_at_4096")
    overhead = results.get("e2e", {}).get("overhead")
    return [
        Target(
            "PCP=2 TTFT speedup over PCP=1 at 4096 tokens, one thread per rank",
            1.8,
            False,
            "×",
            speedup,
            f"bench prefill, {prefill.get('threads_per_rank')} thread(s) per rank, {prefill.get('model')}"
            if speedup is not None
            else f"{NOT_MEASURED}: no bench prefill result for PCP=1 and 2 at 4096 tokens",
        ),
        Target(
            "pcpstack PCP=2 prefill tokens/s ÷ llama.cpp's at 2048 tokens, same two cores",
            2.0,
            False,
            "×",
            *prefill_against_peer(results, 2, 2048, LLAMA),
        ),
        Target(
            "aggregate decode at 16 streams ÷ llama.cpp single stream, same context",
            2.0,
            False,
            "×",
            *decode_against_peer(results, 16, LLAMA),
        ),
        Target(
            "TTFT overhead of the whole path over the in-process engine",
            15.0,
            True,
            " %",
            overhead["overhead_pct"] if overhead else None,
            f"bench e2e, {overhead['prompt_tokens']}-token prompt, model {results['e2e'].get('model')}"
            if overhead
            else f"{NOT_MEASURED}: no bench e2e result",
        ),
        *_served_targets(results),
        *_reuse_targets(results),
    ]


def _floor_note(load: list[dict], batching: dict) -> str:
    """What the batched run's TTFT p50 floor (bench e2e's _ttft_floor) says of the target: the p50 that
    back-to-back forwards at that run's cost would give, against half of one prompt a forward's p50."""
    row = next((r for r in load if r["clients"] == batching["clients"] and "ttft_p50_floor_s" in r), None)
    if row is None:
        return ""
    return (
        f"; TTFT p50 floor of back-to-back forwards {_num(row['ttft_p50_floor_s'])} s against a goal of "
        f"{_num(batching['ttft_p50_s']['unbatched'] / 2)} s"
    )


def _reuse_targets(results: dict) -> list[Target]:
    """Issue 18: later turns' TTFT against a cold prefill of the same prompt (the worst later turn), and
    TTFT p50 at the most clients with batched prefill against one prompt a forward, in the same run."""
    e2e = results.get("e2e", {})
    later = [t for t in e2e.get("multi_turn", {}).get("turns", []) if t["turn"] > 1]
    worst = max(later, key=lambda t: t["warm_over_cold"]) if later else None
    batching = max(e2e.get("batching", []), key=lambda r: r["clients"], default=None)
    return [
        Target(
            "a conversation's later turn: TTFT with its earlier turns in the store ÷ a cold prefill (worst)",
            25.0,
            True,
            " %",
            round(100 * worst["warm_over_cold"], 1) if worst else None,
            f"bench e2e --multi-turn, turn {worst['turn']} of {worst['prompt_tokens']} tokens, "
            f"{e2e.get('model')}"
            if worst
            else f"{NOT_MEASURED}: no bench e2e multi-turn result",
        ),
        Target(
            "TTFT p50 under load with batched prefill ÷ one prompt a forward, same run",
            0.5,
            True,
            "×",
            round(1 / batching["p50_speedup"], 3) if batching else None,
            f"bench e2e --compare-batching, {batching['clients']} clients, {e2e.get('model')}"
            + _floor_note(e2e.get("load", []), batching)
            if batching
            else f"{NOT_MEASURED}: no bench e2e --compare-batching result",
        ),
    ]


def _lockstep_note(served: dict) -> str:
    """The ceiling of PCP=2 over PCP=1 that bench e2e measured beside its served stacks, as a clause to
    append ("" for a result from before it was measured)."""
    ceilings = [scaling["lockstep"] for scaling in served.get("two_process_scaling", [])]
    if not ceilings:
        return ""
    return (
        "; these cores' ceiling for it beside the stacks, twice the slower of two one-thread processes over "
        f"one alone (before / after the rounds): {' / '.join(f'{c:.2f}×' for c in ceilings)}"
    )


def _served_targets(results: dict) -> list[Target]:
    """Served PCP (issue 21, bench e2e's served test): PCP=2 over PCP=1 as a client measures TTFT at 4096
    tokens, and the whole path's TTFT over the same ranks' raw prefill at 2048 and 4096 tokens (the worst
    row of any PCP size)."""
    e2e = results.get("e2e", {})
    served = e2e.get("served", {})
    speedup = served.get("speedup", {}).get("pcp2_over_pcp1_at_4096")
    how = f"bench e2e served, {served.get('threads_per_rank')} thread(s) per rank, {e2e.get('model')}"
    rows = [r for r in served.get("rows", []) if r["tokens"] in (2048, 4096) and "overhead_pct" in r]
    worst = max(rows, key=lambda r: r["overhead_pct"]) if rows else None
    return [
        Target(
            "served PCP=2 TTFT speedup over PCP=1 at 4096 tokens, client-measured through a local stack",
            1.9,
            False,
            "×",
            speedup,
            how + _lockstep_note(served)
            if speedup is not None
            else f"{NOT_MEASURED}: no bench e2e served PCP=1 and 2 at 4096 tokens",
        ),
        Target(
            "whole-path TTFT over the same ranks' raw prefill at 2048 and 4096 tokens (worst row)",
            5.0,
            True,
            " %",
            worst["overhead_pct"] if worst else None,
            f"{how}; worst: PCP={worst['pcp']} at {worst['tokens']} tokens of {len(rows)} row(s)"
            if worst
            else f"{NOT_MEASURED}: no bench e2e served rows at 2048 or 4096 tokens",
        ),
    ]


# --- plots ----------------------------------------------------------------------------------------------


def _errorbar(ax, xs: list, medians: list, lows: list, highs: list, **style) -> None:
    yerr = [
        [m - lo for m, lo in zip(medians, lows, strict=True)],
        [h - m for m, h in zip(medians, highs, strict=True)],
    ]
    ax.errorbar(xs, medians, yerr=yerr, marker="o", capsize=3, **style)


def _plot_prefill(results: dict, ax) -> bool:
    rows = _prefill_rows(results)
    for pcp in sorted({r["pcp"] for r in rows}):
        own = sorted((r for r in rows if r["pcp"] == pcp), key=lambda r: r["tokens"])
        _errorbar(
            ax,
            [r["tokens"] for r in own],
            [r["ttft_s_median"] for r in own],
            [r["ttft_s_min"] for r in own],
            [r["ttft_s_max"] for r in own],
            label=f"pcpstack PCP={pcp}",
        )
    for name in (LLAMA, HF):
        peer = _peer(results, name)
        if peer:
            own = sorted(peer["prefill"], key=lambda r: r["tokens"])
            _errorbar(
                ax,
                [r["tokens"] for r in own],
                [r["ttft_s_median"] for r in own],
                [r["ttft_s_min"] for r in own],
                [r["ttft_s_max"] for r in own],
                label=name,
                linestyle="--",
            )
    ax.set(xlabel="prompt tokens", ylabel="TTFT (s)", title="Time to first token against prompt length")
    return bool(rows)


def _plot_decode(results: dict, ax) -> bool:
    batches = results.get("engine", {}).get("decode", {})
    engine = sorted((int(k.removeprefix("batch_")), v["tokens_per_s"]) for k, v in batches.items())
    if engine:
        ax.plot(*zip(*engine, strict=True), marker="o", label="engine decode step (batch)")
    e2e = _e2e_decode_rows(results)
    if e2e:
        ax.plot(
            [r["streams"] for r in e2e],
            [r["tokens_per_s"] for r in e2e],
            marker="s",
            label="whole path: clients ÷ median TPOT",
        )
    llama = _peer_decode(results, LLAMA)
    for name, style in ((LLAMA, ":"), (HF, "-.")):
        rate = _peer_decode(results, name)
        if rate:
            ax.axhline(rate, linestyle=style, color="grey", label=f"{name} single stream")
    if llama:
        ax.axhline(2 * llama, linestyle="--", color="red", label="target: 2× llama.cpp single stream")
    ax.set_xticks(sorted({s for s, _ in engine} | {r["streams"] for r in e2e}))
    ax.set(xlabel="concurrent streams", ylabel="tokens/s (all streams)", title="Decode throughput")
    return bool(engine or e2e)


# bench kv's paths, in order, as the report names them.
KV_PATHS = {
    "grpc": "grpc",
    "shm": "shm",
    "shm_full": "shm, full store",
    "shm_mixed": "shm, full, mixed sizes",
}


def _plot_kv(results: dict, ax) -> bool:
    kv = results.get("kv", {})
    paths = [p for p in KV_PATHS if p in kv]
    for offset, op in ((-0.2, "put"), (0.2, "get")):
        medians = [kv[p][f"{op}_mb_s"] for p in paths]
        runs = [kv[p][f"{op}_mb_s_all"] for p in paths]
        yerr = [[m - min(r) for m, r in zip(medians, runs, strict=True)]]
        yerr.append([max(r) - m for m, r in zip(medians, runs, strict=True)])
        ax.bar([i + offset for i in range(len(paths))], medians, width=0.4, yerr=yerr, capsize=3, label=op)
    ax.set_xticks(range(len(paths)), [KV_PATHS[p] for p in paths])
    ax.set(
        ylabel="MB/s", title=f"KV store throughput per path ({_num(kv.get('bytes', 0) / 2**20)} MiB objects)"
    )
    return bool(paths)


def _plot_e2e(results: dict, axes) -> bool:
    load = results.get("e2e", {}).get("load", [])
    clients = [r["clients"] for r in load]
    for ax, key, label in ((axes[0], "ttft_s", "TTFT (s)"), (axes[1], "tpot_s", "TPOT (s)")):
        _errorbar(
            ax,
            clients,
            [r[key]["median"] for r in load],
            [r[key]["min"] for r in load],
            [r[key]["max"] for r in load],
        )
        ax.set_xticks(clients)
        ax.set(xlabel="concurrent clients", ylabel=label, title=f"{label.split()[0]} under load")
    return bool(load)


PLOTS: dict[str, tuple[str, int, Callable]] = {
    "prefill": ("prefill_ttft.png", 1, _plot_prefill),
    "decode": ("decode_concurrency.png", 1, _plot_decode),
    "kv": ("kv_throughput.png", 1, _plot_kv),
    "e2e": ("e2e_load.png", 2, _plot_e2e),
}


def write_plots(results: dict, folder: Path) -> tuple[dict[str, Path], str | None]:
    """Draws each plot whose inputs exist (and removes a stale one whose inputs are gone). Returns the
    written plots by name and, when matplotlib is missing, why nothing was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return {}, f"plots not drawn: matplotlib cannot be imported ({exc}); pip install '.[bench]'"
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, (filename, panels, draw) in PLOTS.items():
        path = folder / filename
        fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
        drawn = draw(results, axes[0] if panels > 1 else axes[0][0])
        if drawn:
            for ax in axes[0]:
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize="small")
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            written[name] = path
        else:
            path.unlink(missing_ok=True)
        plt.close(fig)
    return written, None


# --- markdown -------------------------------------------------------------------------------------------


def _image(name: str, plots: dict[str, Path], report: Path) -> list[str]:
    if name not in plots:
        return []
    link = Path(os.path.relpath(plots[name].resolve(), report.resolve().parent)).as_posix()
    return [f"![{name}]({link})", ""]


def _machine(results: dict, folder: Path) -> list[str]:
    threads = {
        "prefill": lambda r: f"{r.get('threads_per_rank')} per rank",
        "peers": lambda r: f"{r.get('threads')}",
        "isa": lambda r: f"{r.get('threads')}",
        "engine": lambda r: f"{r.get('threads')}",
        "e2e": lambda r: f"{r.get('threads_per_rank')} per rank × PCP={r.get('pcp')}",
        "decode": lambda r: f"{r.get('threads_per_rank')} per rank × TP={r.get('tp')}",
    }
    rows = []
    for area in AREAS:
        if area not in results:
            rows.append([area, NOT_MEASURED, "", "", "", ""])
            continue
        result = results[area]
        path = folder / f"{area}.json"
        if not path.is_file():
            path = folder / "all.json"
        # The time the bench recorded; older results only have the file's (a checkout resets it).
        when = result.get("measured_at") or datetime.fromtimestamp(path.stat().st_mtime, UTC).strftime(
            "%Y-%m-%d %H:%M"
        )
        cpu = result.get("cpu_model") or result.get("cpu") or ""
        if result.get("cpu_flags"):  # the vector sets the kernels ran with
            cpu = f"{cpu} ({', '.join(result['cpu_flags'])})"
        cores = result.get("cpu_count") or result.get("cpus") or ""
        load = result.get("loadavg_1m_at_start")
        rows.append(
            [
                area,
                f"{path.name} ({when} UTC)",
                str(cpu),
                str(cores),
                threads[area](result) if area in threads else "",
                "" if load is None else str(load),
            ]
        )
    return [
        "## Machine",
        "",
        f"Report generated on {platform.machine()} with {os.cpu_count()} cores. Each area as its JSON says:",
        "",
        *_table(["area", "results", "CPU", "cores", "threads", "1-min load at start"], rows),
    ]


def _targets_section(targets: list[Target]) -> list[str]:
    rows = [
        [
            t.name,
            f"{'≤' if t.at_most else '≥'} {_num(t.goal)}{t.unit}",
            NOT_MEASURED if t.value is None else f"{_num(t.value)}{t.unit}",
            f"**{t.status}**",
            t.basis,
        ]
        for t in targets
    ]
    return ["## Targets", "", *_table(["target", "goal", "measured", "status", "from"], rows)]


def _ratios_section(ratios: list[Ratio]) -> list[str]:
    rows = [[r.name, NOT_MEASURED if r.value is None else f"{r.value:.2f}×", r.basis] for r in ratios]
    return ["## Ratios", "", *_table(["ratio", "value", "from"], rows)]


def _prefill_section(results: dict, plots: dict[str, Path], report: Path) -> list[str]:
    lines = ["## Prefill: TTFT against prompt length", ""]
    rows = sorted(_prefill_rows(results), key=lambda r: (r["tokens"], r["pcp"]))
    if not rows:
        lines += [f"pcpstack prefill: {NOT_MEASURED} (`pcpstack bench prefill`).", ""]
        return lines + _tensor_parallel_table(results)
    prefill = results["prefill"]
    lines += [
        f"`pcpstack bench prefill`: {prefill.get('model')}, {prefill.get('threads_per_rank')} thread(s) per "
        f"rank, {prefill.get('repeats')} repeats after a warm-up; TTFT median (min–max).",
        "",
    ]
    base = {r["tokens"]: r["ttft_s_median"] for r in rows if r["pcp"] == 1}
    header = ["tokens", "PCP", "TTFT", "tokens/s", "speedup over PCP=1"]
    table = [
        [
            str(r["tokens"]),
            str(r["pcp"]),
            _spread(r["ttft_s_median"], r["ttft_s_min"], r["ttft_s_max"], " s"),
            _num(r["tokens_per_s"]),
            f"{base[r['tokens']] / r['ttft_s_median']:.2f}×" if r["tokens"] in base else "",
        ]
        for r in rows
    ]
    if all("slowest_rank_cpu_s_median" in r for r in rows):
        # The ranks' own work, without their waits for one another: where the wall speedup is lost.
        cpu = {r["tokens"]: r["slowest_rank_cpu_s_median"] for r in rows if r["pcp"] == 1}
        header += ["slowest rank's CPU", "CPU speedup"]
        for cells, r in zip(table, rows, strict=True):
            own = r["slowest_rank_cpu_s_median"]
            cells += [f"{_num(own)} s", f"{cpu[r['tokens']] / own:.2f}×" if r["tokens"] in cpu else ""]
    lines += _table(header, table)
    scaling = prefill.get("two_process_scaling")
    if scaling:
        lines += [
            f"Two one-thread processes together did {scaling['scaling']:.2f}× the fp32 matmul work of one "
            f"alone on this machine in the same run ({scaling['alone_gflops']} GFLOP/s alone, "
            f"{' + '.join(str(g) for g in scaling['pair_gflops'])} together); ranks in step go at the "
            "slower one's pace, so the ceiling of PCP=2 over PCP=1 with one thread per rank is twice the "
            f"slower one over one alone: {prefill.get('lockstep_scaling', scaling['scaling']):.2f}×.",
            "",
        ]
    lines += _image("prefill", plots, report)
    lines += _tensor_parallel_table(results)
    lines += ["### Against the peers", ""]
    peers = [p for p in (LLAMA, HF) if _peer(results, p)]
    if not peers:
        return [*lines, f"Peers: {NOT_MEASURED} (`pcpstack bench peers`).", ""]
    pcps = sorted({r["pcp"] for r in rows})
    header = ["tokens", *(f"PCP={p} tokens/s" for p in pcps), *(f"{p} tokens/s" for p in peers)]
    header += [f"PCP={p} ÷ {peer}" for p in pcps for peer in peers]
    table = []
    for tokens in sorted({r["tokens"] for r in rows}):
        own = [_tps(_prefill_row(results, p, tokens)) for p in pcps]
        theirs = [_tps(_peer_prefill(results, peer, tokens)) for peer in peers]
        cells = [str(tokens), *("" if v is None else _num(v) for v in own)]
        cells += [NOT_MEASURED if v is None else _num(v) for v in theirs]
        for pcp in pcps:
            for peer in peers:
                ratio, basis = prefill_against_peer(results, pcp, tokens, peer)
                cells.append(basis.split(":")[0] if ratio is None else f"{ratio:.2f}×")
        table.append(cells)
    lines += _table(header, table)
    reason = _comparable(results, prefill.get("model"), "prefill")
    return [*lines, f"Not comparable: {reason}.", ""] if reason else lines


def _tensor_parallel_table(results: dict) -> list[str]:
    """TP x PCP prefill rows (`bench prefill --tp`), each against TP=1 x PCP=1 at its prompt length."""
    lines = ["### Tensor parallelism inside PCP ranks", ""]
    rows = sorted(_all_prefill_rows(results), key=lambda r: (r["tokens"], r.get("tp", 1), r["pcp"]))
    if not any(r.get("tp", 1) > 1 for r in rows):
        return [*lines, f"TP rows: {NOT_MEASURED} (`pcpstack bench prefill --tp 1,3 --pcp 1,2`).", ""]
    prefill = results["prefill"]
    lines += [
        f"Every TP x PCP pair runs TP x PCP rank processes of {prefill.get('threads_per_rank')} thread(s) on "
        f"{prefill.get('cpu_count')} core(s): more ranks use more of the cores until they outnumber them; "
        "beyond that TP adds processes and all-reduces, not compute, and these rows show what that costs.",
        "",
    ]
    base = {r["tokens"]: r["ttft_s_median"] for r in rows if r.get("tp", 1) == 1 and r["pcp"] == 1}
    table = [
        [
            str(r["tokens"]),
            str(r.get("tp", 1)),
            str(r["pcp"]),
            str(r.get("tp", 1) * r["pcp"]),
            _spread(r["ttft_s_median"], r["ttft_s_min"], r["ttft_s_max"], " s"),
            _num(r["tokens_per_s"]),
            f"{base[r['tokens']] / r['ttft_s_median']:.2f}×" if r["tokens"] in base else "",
        ]
        for r in rows
    ]
    header = ["tokens", "TP", "PCP", "ranks", "TTFT", "tokens/s", "speedup over TP=1 x PCP=1"]
    return lines + _table(header, table)


def _decode_section(results: dict, plots: dict[str, Path], report: Path) -> list[str]:
    lines = ["## Decode throughput against concurrency", ""]
    rows = []
    engine = results.get("engine", {})
    for key, batch in sorted(
        engine.get("decode", {}).items(), key=lambda kv: int(kv[0].removeprefix("batch_"))
    ):
        streams = key.removeprefix("batch_")
        rows.append(
            [
                "pcpstack engine",
                engine.get("model") or f"id {engine.get('model_id')}",
                streams,
                str(batch["context"]),
                _spread(batch["tokens_per_s"], batch["tokens_per_s_min"], batch["tokens_per_s_max"])
                if "tokens_per_s_min" in batch
                else _num(batch["tokens_per_s"]),
                f"decode step {_num(batch['step_ms'])} ms, {engine.get('threads')} thread(s), "
                f"{engine.get('decode_kernels', 'torch')} kernels",
            ]
        )
    for row in _e2e_decode_rows(results):
        rows.append(
            [
                "pcpstack whole path",
                str(results["e2e"].get("model")),
                str(row["streams"]),
                str(row["context"]),
                _num(row["tokens_per_s"]),
                "clients ÷ median TPOT",
            ]
        )
    for name in (LLAMA, HF):
        peer = _peer(results, name)
        if peer:
            d = peer["decode"]
            rows.append(
                [
                    name,
                    str(results["peers"].get("model")),
                    "1",
                    str(d["context"]),
                    _spread(d["tokens_per_s_median"], d["tokens_per_s_min"], d["tokens_per_s_max"]),
                    f"{d['tokens']} greedy tokens, {results['peers'].get('threads')} thread(s)",
                ]
            )
    if not rows:
        return [*lines, f"Decode: {NOT_MEASURED} (`pcpstack bench engine`, `bench e2e`, `bench peers`).", ""]
    lines += _table(["stack", "model", "streams", "context", "tokens/s (all streams)", "how"], rows)
    return (
        lines
        + _image("decode", plots, report)
        + _roofline_table(results)
        + _profile_table(results)
        + _weights_table(results)
    )


def _roofline_table(results: dict) -> list[str]:
    """bench engine's roofline: the bytes each decode batch's step reads against the copy bandwidth."""
    lines = ["### Decode step roofline", ""]
    engine = results.get("engine", {})
    roofline = engine.get("roofline")
    if not roofline:
        return [*lines, f"Roofline: {NOT_MEASURED} (`pcpstack bench engine`).", ""]
    copy = roofline["copy"]
    lines += [
        f"Copy bandwidth {_spread(copy['gb_s'], copy['gb_s_min'], copy['gb_s_max'], ' GB/s')} (torch copy of "
        f"{_num(copy['bytes'] / 2**20)} MiB, read plus written, {engine.get('threads')} thread(s)). A step "
        "reads the weights it streams (quantized blocks where the C kernels run) once, and each sequence's "
        "K/V; the ceiling is batch × bandwidth ÷ bytes per step.",
        "",
    ]
    rows = []
    batches = sorted(roofline["batches"].items(), key=lambda kv: int(kv[0].removeprefix("batch_")))
    for key, row in batches:
        measured = engine.get("decode", {}).get(key, {}).get("tokens_per_s")
        rows.append(
            [
                key.removeprefix("batch_"),
                _num(row["mean_context"]),
                f"{_num(row['weight_bytes'] / 1e6)} MB",
                f"{_num(row['kv_bytes'] / 1e6)} MB",
                f"{_num(row['bytes_per_step'] / 1e6)} MB",
                _num(row["ceiling_tokens_per_s"]),
                "" if measured is None else _num(measured),
                f"{100 * row['fraction_of_ceiling']:.0f} %",
            ]
        )
    header = ["batch", "context", "weights", "K/V", "bytes per step", "ceiling tokens/s", "tokens/s"]
    return lines + _table([*header, "of ceiling"], rows)


def _profile_rows(label: str, decode: dict) -> list[list[str]]:
    rows = []
    for key, row in sorted(decode.items(), key=lambda kv: int(kv[0].removeprefix("batch_"))):
        profile = row.get("profile")
        if not profile:
            continue
        step, projections, attention = profile["step_ms"], profile["projections_ms"], profile["attention_ms"]
        rows.append(
            [
                label,
                key.removeprefix("batch_"),
                _num(profile["mean_context"]),
                f"{_num(step)} ms",
                f"{_num(projections)} ms ({100 * projections / step:.0f} %)",
                _num(profile["projection_flops"] / projections / 1e6),
                f"{_num(attention)} ms ({100 * attention / step:.0f} %)",
                _num(profile["kv_bytes"] / attention / 1e6),
                f"{_num(profile['rest_ms'])} ms",
            ]
        )
    return rows


def _profile_table(results: dict) -> list[str]:
    """Where a decode step's time goes (bench/decode_profile.py), from bench engine and bench isa."""
    lines = ["### Decode step profile", ""]
    rows = _profile_rows("engine (this CPU's own set)", results.get("engine", {}).get("decode", {}))
    isa = results.get("isa", {})
    for arch, ours in isa.get("pcpstack", {}).items():
        if ours.get("available"):
            rows += _profile_rows(f"bench isa, -march={arch}", ours.get("decode", {}))
    if not rows:
        return [*lines, f"Profile: {NOT_MEASURED} (`pcpstack bench engine`, `bench isa`).", ""]
    lines += [
        "The step's parts, each timed again by itself with the same kernels and threads: every projection on "
        "its quantized blocks (random rows of the batch's size) and every layer's paged attention over the "
        "batch's own block tables (random queries). The rest is the step less both: norms, RoPE, SiLU, cache "
        "writes, threads waiting for each other, the Python around the call. A part alone starts a team of "
        "threads per call, which the fused step does not, so the parts come out a little high and the rest "
        "low (below zero where the step is short).",
        "",
    ]
    header = ["configuration", "batch", "context", "step", "projections", "GFLOP/s", "attention", "K/V GB/s"]
    return lines + _table([*header, "rest"], rows)


def _weights_table(results: dict) -> list[str]:
    """bench engine's loads of each model with its weights stored and dense, each in a fresh process."""
    lines = ["### Weights in memory", ""]
    forms = results.get("engine", {}).get("weights", {}).get("load_forms")
    if not forms:
        return [*lines, f"Load forms: {NOT_MEASURED} (`pcpstack bench engine`).", ""]
    lines += [
        "One fresh process per row loads the model for fp32 on the CPU, weights `stored` (a GGUF's quantized "
        "blocks, a folder's 16-bit tensors) or `dense` (fp32). Its peak RSS includes its baseline before the "
        "load (Python, torch) and the GGUF pages it maps while reading.",
        "",
    ]
    rows = [
        [
            model,
            form,
            f"{_num(row['load_s'])} s",
            f"{_num(row['peak_rss_mb'])} MB",
            f"{_num(row['baseline_rss_mb'])} MB",
            f"{_num(row['weights_mb'])} MB",
        ]
        for model, by_form in forms.items()
        for form, row in by_form.items()
    ]
    return lines + _table(["model", "weights", "load", "peak RSS", "before load", "weights held"], rows)


def _store_cpu(path: dict) -> str:
    """A kv path's store CPU per object ('' in results from before it was measured)."""
    cpu = path.get("store_cpu_per_object_ms")
    return "" if cpu is None else f"{_num(cpu)} ms"


def _kv_section(results: dict, plots: dict[str, Path], report: Path) -> list[str]:
    lines = ["## KV transfer throughput per path", ""]
    kv = results.get("kv")
    if not kv:
        return [*lines, f"KV store: {NOT_MEASURED} (`pcpstack bench kv`).", ""]
    lines += [
        f"`pcpstack bench kv`: {_num(kv['bytes'] / 2**20)} MiB objects, {kv['repeats']} repeats; "
        'MB/s median (min–max). "shm, full store": the store full of kept (released) objects, each put '
        "evicting the oldest, puts 0.5 s apart (a serving store's steady state: replicas stay for prefix "
        'reuse). "mixed sizes": the same with objects of a quarter to all of that size, small and large in '
        "turn, each put announced 0.5 s ahead as a prefill rank announces its push (rates per put). Store "
        "CPU per object: all the store's work for one, its standby's pages (readied between puts) included.",
        "",
    ]
    rows = [
        [
            KV_PATHS[path],
            _spread(kv[path]["put_mb_s"], min(kv[path]["put_mb_s_all"]), max(kv[path]["put_mb_s_all"])),
            _spread(kv[path]["get_mb_s"], min(kv[path]["get_mb_s_all"]), max(kv[path]["get_mb_s_all"])),
            _store_cpu(kv[path]),
        ]
        for path in KV_PATHS
        if path in kv
    ]
    header = ["path", "put MB/s", "get MB/s", "store CPU per object"]
    return lines + _table(header, rows) + _image("kv", plots, report)


def _e2e_section(results: dict, plots: dict[str, Path], report: Path) -> list[str]:
    lines = ["## End to end under load", ""]
    e2e = results.get("e2e")
    if not e2e:
        return [*lines, f"Whole path: {NOT_MEASURED} (`pcpstack bench e2e`).", ""]
    lines += [
        f"`pcpstack bench e2e`: {e2e.get('model')}, PCP={e2e.get('pcp')} with {e2e.get('threads_per_rank')} "
        "thread(s) per rank, one decode worker; median (min–max) over all requests.",
        "",
    ]
    rows = [
        [
            str(r["clients"]),
            str(r["prompt_tokens"]),
            str(r["max_tokens"]),
            _spread(r["ttft_s"]["median"], r["ttft_s"]["min"], r["ttft_s"]["max"], " s"),
            _spread(r["tpot_s"]["median"], r["tpot_s"]["min"], r["tpot_s"]["max"], " s"),
            _num(r["output_tokens_per_s"]),
        ]
        for r in e2e.get("load", [])
    ]
    lines += _table(["clients", "prompt", "output", "TTFT", "TPOT", "output tokens/s"], rows)
    lines += _image("e2e", plots, report)
    lines += _cores_under_load(e2e)
    overhead = e2e.get("overhead")
    if overhead:
        path, local = overhead["path_ttft_s"], overhead["in_process_prefill_s"]
        lines += [
            f"Overhead at {overhead['prompt_tokens']} tokens: whole-path TTFT "
            f"{_spread(path['median'], path['min'], path['max'], ' s')} against in-process prefill "
            f"{_spread(local['median'], local['min'], local['max'], ' s')} "
            f"({overhead['in_process_threads']} threads, each beside one request): "
            f"**{_num(overhead['overhead_pct'])} %**.",
            "",
        ]
    return lines + _served_section(e2e) + _multi_turn_section(e2e) + _batching_section(e2e)


# The kinds of process bench e2e's load rows give a column of their own (cpu_s); the other services share one.
MAIN_ROLES = ("prefill", "decode", "clients")


def _cores_under_load(e2e: dict) -> list[str]:
    """CPU seconds each kind of process used during each load run, the cores' idle time, and the TTFT p50
    a set prefilling the prompts back to back at that cost would have given."""
    runs = [("default", r) for r in e2e.get("load", [])]
    runs += [("one prompt a forward", r) for r in e2e.get("load_unbatched", [])]
    runs = [(name, r) for name, r in runs if "cpu_s" in r]
    if not runs:
        return []
    lines = [
        "Where the cores went during each load run (CPU seconds; idle: the cores' idle time; elsewhere: "
        "processes outside the stack), and the TTFT p50 floor: the p50 the set would give prefilling the "
        "prompts back to back, each forward at the CPU cost it had here, never descheduled or kept waiting. "
        "Forwards: how many the set ran, and the prompts each took on average." + _batch_limit_note(runs),
        "",
    ]
    rows = [
        [
            name,
            str(r["clients"]),
            f"{_num(r['wall_s'])} s",
            *(_num(r["cpu_s"].get(role, 0.0)) for role in MAIN_ROLES),
            _num(sum(v for k, v in r["cpu_s"].items() if k not in (*MAIN_ROLES, "idle", "elsewhere"))),
            _num(r["cpu_s"]["idle"]),
            _num(r["cpu_s"].get("elsewhere", 0.0)),
            _forwards_cell(r),
            f"{_num(r['ttft_s']['median'])} s",
            f"{_num(r['ttft_p50_floor_s'])} s",
        ]
        for name, r in runs
    ]
    header = ["stack", "clients", "wall", *MAIN_ROLES, "other services", "idle", "elsewhere", "forwards"]
    return lines + _table([*header, "TTFT p50", "p50 floor"], rows)


def _batch_limit_note(runs: list[tuple[str, dict]]) -> str:
    """Where every load run took one prompt a forward because a prompt filled a batch's token limit alone:
    then batched and unbatched stacks ran the same schedule."""
    if not runs or any(r.get("prompts_per_forward") != 1 or "batch_tokens" not in r for _, r in runs):
        return ""
    limit, tokens = runs[0][1]["batch_tokens"], runs[0][1]["prompt_tokens"]
    if tokens < limit:
        return ""
    return (
        f" Every run took one prompt a forward: a batch holds at most {limit} prompt tokens (past that, a "
        "batch saves a few percent of compute and delays its first prompts' first tokens) and these prompts "
        f"have {tokens}, so both stacks ran the same schedule and their TTFTs differ by the run's noise, "
        "not by batching."
    )


def _forwards_cell(row: dict) -> str:
    """A load run's forwards and prompts per forward ("–" for a result from before bench e2e counted them)."""
    if row.get("prompts_per_forward") is None:
        return "–"
    return f"{row['forwards']} ({_num(row['prompts_per_forward'])} each)"


def _multi_turn_section(e2e: dict) -> list[str]:
    """Prefix reuse: each turn of a conversation warm (earlier turns' blocks in the store) and cold."""
    lines = ["### Prefix reuse: a conversation's later turns against cold prefills of the same prompts", ""]
    multi = e2e.get("multi_turn")
    if not multi:
        return [*lines, f"Multi-turn: {NOT_MEASURED} (`pcpstack bench e2e --multi-turn 4`).", ""]
    lines += [
        f"{multi['conversations']} conversation(s): a first prompt of {multi['history_tokens']} tokens, then "
        f"each turn the last prompt, its {multi['max_tokens']}-token answer and {multi['turn_tokens']} new "
        "tokens. Warm: the default cache salt (the store holds the earlier prompts' full blocks); cold: a "
        "salt of its own, so the whole prompt is computed. Medians (min–max) over the conversations.",
        "",
    ]

    def seconds(summary: dict) -> str:
        return _spread(summary["median"], summary["min"], summary["max"], " s")

    rows = [
        [
            str(t["turn"]),
            str(t["prompt_tokens"]),
            str(t["cached_tokens"]),
            seconds(t["warm_ttft_s"]),
            seconds(t["cold_ttft_s"]),
            f"{100 * t['warm_over_cold']:.0f} %",
            "yes" if t["same_answers"] else "**no**",
        ]
        for t in multi["turns"]
    ]
    header = ["turn", "prompt", "from the store", "warm TTFT", "cold TTFT", "warm ÷ cold", "same answer"]
    return lines + _table(header, rows)


def _batching_section(e2e: dict) -> list[str]:
    """TTFT under load with batched prefill (the default) and without, from the same run."""
    rows = e2e.get("batching")
    if not rows:
        return []
    lines = [
        "### Batched prefill under load",
        "",
        "The load test again on a stack whose set takes one prompt a forward (`--prefill-batch-max 1`), "
        "in the same run. TTFT p50 / p90:",
        "",
    ]
    table = [
        [
            str(r["clients"]),
            f"{_num(r['ttft_p50_s']['batched'])} / {_num(r['ttft_p90_s']['batched'])} s",
            f"{_num(r['ttft_p50_s']['unbatched'])} / {_num(r['ttft_p90_s']['unbatched'])} s",
            f"{r['p50_speedup']:.2f}×",
        ]
        for r in rows
    ]
    return lines + _table(["clients", "batched", "one a forward", "p50 speedup"], table)


def _served_section(e2e: dict) -> list[str]:
    """Served PCP: client TTFT against the same ranks' raw prefill, and one request's TTFT by phase."""
    lines = ["### Served PCP: the whole path against the same ranks' raw prefill", ""]
    served = e2e.get("served")
    if not served:
        return [*lines, f"Served PCP: {NOT_MEASURED} (`pcpstack bench e2e --served-pcp 1,2`).", ""]
    lines += [
        f"Every PCP size's stack and raw rank set is up at once; each serves one request at a time "
        f"({served.get('threads_per_rank')} thread(s) per rank, {served.get('repeats')} round(s) after a "
        "warm-up, every prompt new), the sizes taking turns, and raw prefill is the same ranks run as "
        "`bench prefill` runs them, once beside each timed request (the stacks idle); the order of sizes, "
        "and of request and raw prefill, flips every other round, so what is compared ran side by side. "
        "Medians (min–max). The paired columns are the median over rounds of what ran back to back in one "
        "round (a request against its raw prefill, PCP=1 against PCP=2): the drift between rounds cancels "
        "there, and a gap between a paired figure and its ratio of medians is that drift. Every request and "
        "raw prefill starts once all stacks have settled. KV store CPU: the store's CPU seconds from each "
        "timed request's start to its last token: the replica's put and a standby segment's pages (readied "
        "during the ranks' forward when the pushing rank holds none of the size it announces, and for "
        "every rank of the set right after a forward whose size repeats the one before; on a 2-core machine "
        "the former comes out of a PCP=2 set's cores).",
        "",
    ]

    def base(key: str) -> dict[int, float]:
        return {r["tokens"]: r[key]["median"] for r in served["rows"] if r["pcp"] == 1 and key in r}

    served_base, raw_base = base("served_ttft_s"), base("raw_prefill_s")

    def speedup(base: dict[int, float], row: dict, key: str) -> str:
        if row["tokens"] not in base or key not in row:
            return ""
        return f"{base[row['tokens']] / row[key]['median']:.2f}×"

    def seconds(summary: dict | None) -> str:
        return _spread(summary["median"], summary["min"], summary["max"], " s") if summary else NOT_MEASURED

    def paired(row: dict, key: str) -> str:
        value = served.get(key, {}).get(f"pcp{row['pcp']}_over_pcp1_at_{row['tokens']}")
        return "" if value is None else f"{value:.2f}×"

    rows = [
        [
            str(r["tokens"]),
            str(r["pcp"]),
            seconds(r["served_ttft_s"]),
            seconds(r.get("raw_prefill_s")),
            f"{_num(r['overhead_pct'])} %" if "overhead_pct" in r else "",
            f"{_num(r['overhead_paired_pct'])} %" if "overhead_paired_pct" in r else "",
            speedup(served_base, r, "served_ttft_s"),
            paired(r, "speedup_paired"),
            speedup(raw_base, r, "raw_prefill_s"),
            paired(r, "raw_speedup_paired"),
            f"{_num(r['first_request_ttft_s'])} s" if "first_request_ttft_s" in r else "",
            seconds(r["store_cpu_s"]) if "store_cpu_s" in r else "",
        ]
        for r in sorted(served["rows"], key=lambda r: (r["tokens"], r["pcp"]))
    ]
    header = ["tokens", "PCP", "served TTFT", "raw prefill", "overhead", "overhead, paired"]
    header += ["served ÷ PCP=1", "paired", "raw ÷ PCP=1", "paired", "first request's TTFT", "KV store CPU"]
    lines += _table(header, rows)
    scalings = served.get("two_process_scaling", [])
    ceilings = [scaling["lockstep"] for scaling in scalings]
    if scalings:
        measured = "; ".join(
            f"{s['alone_gflops']} GFLOP/s alone, {' + '.join(str(g) for g in s['pair_gflops'])} together"
            for s in scalings
        )
        lines += [
            "Beside the idle stacks, before and after the rounds, one fp32 matmul process alone and two at "
            f"once ({measured}): ranks in step go at the slower one's pace, so PCP=2 over PCP=1 could reach "
            f"at most {' / '.join(f'{ceiling:.2f}×' for ceiling in ceilings)} on these cores then.",
            "",
        ]
    breakdown = sorted(served.get("breakdown", []), key=lambda b: (b["tokens"], b["pcp"]))
    if not breakdown:
        return lines
    phases = list(breakdown[0]["phases_s"])
    lines += [
        "Requests' TTFT by phase, from their traces (seconds): the first request of each length (the "
        "warm-up, which pays for first-touch allocations as a one-off `generate --local` does) and the "
        "last timed one. The phases follow one another and add up to the TTFT; the KV fetch overlaps the "
        "first token's trip to the client and is not part of it. The last column is the critical rank's CPU "
        "time over its forward and push: under 100 % the rank waited for a core.",
        "",
    ]
    rows = [
        [
            str(b["tokens"]),
            str(b["pcp"]),
            b.get("request", "last"),
            _num(b["ttft_s"]),
            *(_num(b["phases_s"][p]) for p in phases),
            "" if b.get("kv_fetch_s") is None else _num(b["kv_fetch_s"]),
            _busy(b),
        ]
        for b in breakdown
    ]
    header = ["tokens", "PCP", "request", "TTFT", *(p.replace("_", " ") for p in phases), "KV fetch"]
    header.append("rank CPU ÷ forward + push")
    return lines + _table(header, rows)


def _busy(breakdown: dict) -> str:
    """The critical rank's CPU time over its forward and push wall time: under 100 % it waited for a core."""
    wall = breakdown["phases_s"].get("forward", 0) + breakdown["phases_s"].get("kv_push", 0)
    cpu = breakdown.get("critical_rank_cpu_s")
    return f"{100 * cpu / wall:.0f} %" if cpu and wall > 0 else ""


def _dcp_section(results: dict) -> list[str]:
    """`bench decode`: KV bytes per rank and decode tokens/s of a TP decode worker at each DCP size."""
    lines = ["## Decode context parallelism: KV per rank", ""]
    decode = results.get("decode")
    if not decode or not decode.get("dcp"):
        command = "`pcpstack bench decode --dcp 1,3 --tp 9 --context 4096`"
        return [*lines, f"DCP rows: {NOT_MEASURED} ({command}).", ""]
    lines += [
        f"`pcpstack bench decode`: {decode.get('model')}, TP={decode.get('tp')}, {decode.get('batch')} "
        f"sequence(s) of {decode.get('context')} tokens, {decode.get('threads_per_rank')} thread(s) per rank "
        f"on {decode.get('cpu_count')} core(s). KV per rank is the largest rank's blocks times one rank's "
        "block bytes: DCP divides it. With more ranks than cores, tokens/s measures the collectives' cost, "
        "not a speedup.",
        "",
    ]
    sizes = sorted(decode["dcp"], key=int)
    base = decode["dcp"].get("1", {}).get("kv_bytes_per_rank")
    rows = []
    for size in sizes:
        row = decode["dcp"][size]
        share = f"{row['kv_bytes_per_rank'] / base:.2f}" if base else ""
        rows.append(
            [
                size,
                f"{row['kv_bytes_per_rank'] / 2**20:.1f} MiB",
                str(max(row["kv_blocks_per_rank"])),
                share,
                _spread(row["tokens_per_s"], row["tokens_per_s_min"], row["tokens_per_s_max"]),
            ]
        )
    header = ["DCP", "KV per rank", "blocks per rank", "÷ DCP=1", "decode tokens/s"]
    return lines + _table(header, rows) + _collectives_lines(decode.get("collectives") or {})


def _collectives_lines(found: dict) -> list[str]:
    """The TP group's collectives on their own (bench/collectives.py), gloo against the host group."""
    if not found:
        return []
    shape = "×".join(str(n) for n in found["shape"])
    rows = []
    for op, ranks in (("all_reduce", found["ranks"]), ("all_gather", found["gather_ranks"])):
        gloo, host = found[f"gloo_{op}_ms"], found[f"host_{op}_ms"]
        rows.append(
            [
                f"{op.replace('_', '-')} of {ranks} ranks",
                _spread(gloo["median"], gloo["min"], gloo["max"], " ms"),
                _spread(host["median"], host["min"], host["max"], " ms"),
                f"{gloo['median'] / host['median']:.1f}×",
            ]
        )
    intro = (
        f"The collectives of a decode step on their own: one step's activations ({shape} fp32), the slowest "
        f"rank's mean over {found['ops']} operations, median (min–max) over rounds; gloo over loopback TCP "
        "against the shared-memory host group the CPU decode worker uses."
    )
    return [intro, "", *_table(["collective", "gloo", "host group", "gloo ÷ host"], rows)]


def _registry_section(results: dict) -> list[str]:
    lines = ["## Registry", ""]
    registry = results.get("registry")
    if not registry:
        return [*lines, f"Registry: {NOT_MEASURED} (`pcpstack bench registry`).", ""]
    if "backends" not in registry:  # results of the bench before it measured backends apart
        goals = registry.get("targets", {})
        rows = [
            [key.replace("_", " "), _num(registry[key]), goals.get(key, "")]
            for key in ("assembly_s", "registry_cpu_pct_of_one_core", "clients_cpu_pct_of_one_core")
            if key in registry
        ]
        lines += [f"{registry.get('nodes')} prefill nodes in {registry.get('sets')} sets.", ""]
        return lines + _table(["measure", "value", "target"], rows)
    lines += [
        f"{registry.get('nodes')} prefill nodes in {registry.get('sets')} sets, lease "
        f"{registry.get('lease_s', 3.0):g} s (heartbeats every third of it); every node a NodeSession in "
        "the bench's process. CPU is % of one core over the heartbeat window.",
        "",
    ]
    goals = registry.get("targets", {})

    def cpu(measured: dict, name: str) -> str:
        key = f"{name}_cpu_pct_of_one_core"
        return f"{_num(measured[key])} %" if key in measured else "–"

    rows = [
        [
            backend,
            f"{_num(measured['assembly_s'])} s",
            goals.get(backend, {}).get("assembly_s", ""),
            f"{_num(measured['ready_s'])} s" if "ready_s" in measured else "–",
            cpu(measured, "registry"),
            cpu(measured, "etcd"),
            cpu(measured, "clients"),
        ]
        for backend, measured in registry["backends"].items()
    ]
    header = ["backend", "all assigned after the last registered", "target", "all routable after ready"]
    lines += _table([*header, "registry CPU", "etcd CPU", "clients CPU"], rows)
    if "failover_s_median" in registry:
        runs = ", ".join(f"{t:g}" for t in registry.get("failover_s", []))
        lines += [
            f"Leader failover (2 replicas on a 3-member etcd; SIGKILL of the leader until the other answers "
            f"as leader): median {_num(registry['failover_s_median'])} s of {runs} s; target "
            f"{goals.get('failover_s_median', '< 3 s')}.",
            "",
        ]
    return lines


def _peers_section(results: dict) -> list[str]:
    lines = ["## Peers", ""]
    peers = results.get("peers")
    if not peers:
        return [*lines, f"Peers: {NOT_MEASURED} (`pcpstack bench peers`).", ""]
    lines += [
        f"`pcpstack bench peers`: {peers.get('model')}, {peers.get('threads')} threads, "
        f"{peers.get('repeats')} repeats; prompts: {peers.get('prompt')}.",
        "",
    ]
    rows = []
    for name, peer in peers.get("peers", {}).items():
        if not peer.get("available"):
            lines += [f"- {name}: unavailable: {peer.get('reason')}"]
            continue
        details = ", ".join(
            f"{key} {peer[key]}"
            for key in ("version", "dtype", "attention", "n_batch", "n_ubatch", "flash_attn", "load_s")
            if key in peer
        )
        lines += [f"- {name}: {details}"]
        rows += [
            [
                name,
                str(r["tokens"]),
                _spread(r["ttft_s_median"], r["ttft_s_min"], r["ttft_s_max"], " s"),
                _num(r["tokens_per_s"]),
                str(r["first_token"]),
            ]
            for r in peer["prefill"]
        ]
    lines.append("")
    if rows:
        lines += _table(["peer", "tokens", "TTFT", "tokens/s", "first token"], rows)
    return lines


def _over_rounds(rate: float, row: dict) -> str:
    """A rate (its median round's) with the spread of every round's rate (bench/isa.py)."""
    return _spread(rate, min(row["rounds_tokens_per_s"]), max(row["rounds_tokens_per_s"]), "")


def _isa_cpu_note(isa: dict) -> str:
    """What bench isa's rows stand for: on a CPU with AVX-512, a stand-in for one without; on a CPU that
    has none (its flags say so), that CPU's own measurement."""
    flags = isa.get("cpu_flags")
    if flags is not None and "avx512f" not in flags:
        return (
            f"This CPU ({isa.get('cpu_model')}: {', '.join(flags)}) has no AVX-512: the AVX2 + FMA builds "
            "are its own instruction set, so these rows are an AVX2-only CPU's measurement, not a stand-in."
        )
    return (
        "A stand-in for a CPU without AVX-512: the same instructions on this CPU, not another CPU's cores "
        "and memory."
    )


def _isa_section(results: dict) -> list[str]:
    """Decode with both sides built for a narrower instruction set on this CPU (bench/isa.py)."""
    lines = ["## Narrower instruction set on this CPU", ""]
    isa = results.get("isa")
    if not isa:
        return [*lines, f"{NOT_MEASURED} (`pcpstack bench isa --llama-path DIR`).", ""]
    llama = isa.get("llama.cpp", {})
    rate = llama.get("decode", {}).get("tokens_per_s_median") if llama.get("available") else None
    rounds = isa.get("rounds")
    lines += [
        f"`pcpstack bench isa`: {isa.get('model')}, {isa.get('threads')} threads, {isa.get('context')} "
        f"tokens of context, {isa.get('repeats')} runs a round, {rounds} round{'s' * (rounds != 1)}: rates "
        "are the rounds' median (their spread), and each ratio to llama.cpp is the median of the ratios "
        "taken within a round, minutes apart (their spread). " + _isa_cpu_note(isa),
        "",
    ]
    if rate is None:
        lines += [f"- llama.cpp: unavailable: {llama.get('reason')}"]
    else:
        lines += [
            f"- llama.cpp {llama.get('version')} from `{llama.get('path')}`: {llama.get('system_info')}"
        ]
    rows = []
    for arch, side in isa.get("pcpstack", {}).items():
        if not side.get("available"):
            lines += [f"- pcpstack -march={arch}: unavailable: {side.get('reason')}"]
            continue
        for batch, row in side["decode"].items():
            paired = isa.get("ratios", {}).get(arch, {}).get(batch)
            ratio = _spread(paired["median"], paired["min"], paired["max"], "×") if paired else ""
            streams = batch.removeprefix("batch_")
            name = f"pcpstack -march={arch}" + (f" -mtune={side['mtune']}" if side.get("mtune") else "")
            rows.append([name, streams, _over_rounds(row["tokens_per_s"], row), ratio])
    if rate is not None:
        rows.append(["llama.cpp (same set)", "1", _over_rounds(rate, llama["decode"]), "1.00×"])
    lines.append("")
    if rows:
        lines += _table(["decode", "streams", "tokens/s", "÷ llama.cpp 1 stream"], rows)
    return lines


def _families_section() -> list[str]:
    """The model families the engine serves (engine/families.py) and what the tests verify of each."""
    from pcpstack.engine.families import FAMILIES

    rows = [
        [
            f.name,
            f"`{f.hf_model_type}`",
            ", ".join(f"`{a}`" for a in f.gguf_architectures) or "none",
            "yes" if f.qkv_bias else "if the config says so",
            "caps the context" if f.sliding_window_by_default else "if use_sliding_window (caps the context)",
            f.verified,
        ]
        for f in FAMILIES
    ]
    header = ["family", "config model_type", "GGUF architecture", "q/k/v biases", "sliding window"]
    return ["## Model families", "", *_table([*header, "verified against transformers"], rows), ""]


def render(results: dict, folder: Path, plots: dict[str, Path], report: Path, notes: str | None) -> str:
    """The whole BENCHMARKS.md text."""
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `python -m bench.report` from `{folder.as_posix()}/*.json`; do not edit by hand: "
        "rerun the benches (`pcpstack bench all`) and regenerate. Medians over repeats with the spread as "
        "(min–max); ratios are of medians. Full runs are by hand on a quiet machine; CI only smoke-runs.",
        "",
        *_machine(results, folder),
        *_targets_section(compute_targets(results)),
        *_ratios_section(compute_ratios(results)),
        *_prefill_section(results, plots, report),
        *_decode_section(results, plots, report),
        *_dcp_section(results),
        *_kv_section(results, plots, report),
        *_e2e_section(results, plots, report),
        *_registry_section(results),
        *_peers_section(results),
        *_isa_section(results),
        *_families_section(),
    ]
    if notes:
        lines += ["## What limits the missed targets", "", notes.strip(), ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(
    folder: Path = RESULTS_DIR,
    report: Path = REPORT_PATH,
    plots_dir: Path = PLOTS_DIR,
    notes: Path = NOTES_PATH,
) -> tuple[Path, list[str]]:
    """Writes the report and its plots; returns the report's path and warnings (e.g. no matplotlib)."""
    results = load_results(folder)
    plots, plots_missing = write_plots(results, plots_dir)
    text = render(results, folder, plots, report, notes.read_text() if notes.is_file() else None)
    if plots_missing:
        text = text.replace("\n## Machine", f"\n_{plots_missing}_\n\n## Machine", 1)
    report.write_text(text)
    return report, [plots_missing] if plots_missing else []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `python -m bench.report` (and `pcpstack bench report`)."""
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="folder of <area>.json results")
    parser.add_argument("--report", type=Path, default=REPORT_PATH, help="markdown file to write")
    parser.add_argument("--plots", type=Path, default=PLOTS_DIR, help="folder for the PNG plots")
    parser.add_argument("--notes", type=Path, default=NOTES_PATH, help="analysis to copy in, if it exists")


def run(args: argparse.Namespace) -> int:
    """Regenerates the report; prints where it went."""
    if not args.results.is_dir():
        print(f"--results={args.results} is not a folder; run `pcpstack bench <area>` first", file=sys.stderr)
        return 2
    report, warnings = write_report(args.results, args.report, args.plots, args.notes)
    for warning in warnings:
        print(warning, file=sys.stderr)
    print(f"wrote {report}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
