"""What a benchmark ran on, recorded in its JSON so results from different machines are never compared blind:
the CPU model, the vector instruction sets the kernels care about, the cores, and how busy the machine was."""

from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

# The flags that decide which CPU kernels run and how fast (services/engine/cpu_kernels.c).
VECTOR_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "neon",
    "asimd",
)


def _cpuinfo() -> dict[str, str]:
    path = Path("/proc/cpuinfo")
    facts: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "flags", "Features") and key not in facts:
                facts[key] = value.strip()
    return facts


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, all its threads (/proc, in clock ticks of 10 ms: fine
    for runs of seconds); 0.0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_facts() -> dict:
    """CPU model, its vector flags among VECTOR_FLAGS, core count, the 1-minute load average now, and when
    (UTC; a results file's modification time changes with every checkout)."""
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {
        "cpu_model": cpu_model(),
        "cpu_flags": [flag for flag in VECTOR_FLAGS if flag in flags],
        "cpu_count": os.cpu_count(),
        "loadavg_1m_at_start": round(os.getloadavg()[0], 2),
        "measured_at": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def _matmul_rate(seconds: float, start, rates) -> None:
    """One thread's fp32 matmul GFLOP/s over `seconds`, after `start` (a barrier) lets every process go."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    torch.mm(a, b)
    start.wait()
    count, began = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - began) < seconds:
        torch.mm(a, b)
        count += 1
    rates.put(count * 2 * 512**3 / elapsed / 1e9)


def two_process_scaling(seconds: float = 2.0, rounds: int = 3) -> dict:
    """How much two single-thread processes get done together against one alone (fp32 matmul, the work of a
    prefill rank): the most PCP=2 over PCP=1 can reach on this machine with one thread per rank. Two vCPUs
    that share a physical core, or a host that slows its cores when both are busy, show here below 2x. The
    pair's rates are the medians of the slower and of the faster process of each round."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")

    def together(n: int) -> list[float]:
        start, rates = context.Barrier(n), context.Queue()
        procs = [context.Process(target=_matmul_rate, args=(seconds, start, rates)) for _ in range(n)]
        for proc in procs:
            proc.start()
        found = [rates.get(timeout=60 + seconds) for _ in procs]
        for proc in procs:
            proc.join()
        return found

    # Alone and as a pair in turn, `rounds` times: one window of a few seconds on a shared host drifts by
    # more than the difference being measured; the medians of each are compared.
    alones, pairs = [], []
    for _ in range(rounds):
        alones.append(together(1)[0])
        pairs.append(together(2))
    alone = round(statistics.median(alones), 1)
    pair = [round(statistics.median(rates), 1) for rates in zip(*(sorted(p) for p in pairs), strict=True)]
    return {
        "alone_gflops": alone,
        "pair_gflops": pair,
        "scaling": round(sum(pair) / alone, 2),
        # PCP ranks exchange K/V every layer, so a pair moves at its slower process's pace: twice the slower
        # one's rate over one alone is the ceiling of PCP=2 over PCP=1 (the sum of both rates is not).
        "lockstep": round(2 * min(pair) / alone, 2),
        "rounds": rounds,
    }
