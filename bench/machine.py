"""What a benchmark ran on, recorded in its JSON so results from different machines are never compared blind:
the CPU model, the vector instruction sets the kernels care about, the cores, and how busy the machine was."""

from __future__ import annotations

import os
import platform
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
