"""common.malloc: an engine process keeps the memory it frees for its next forward. Each case runs in a
fresh interpreter (malloc's thresholds are per process and move with its history): a round allocates four
3 MiB blocks, touches them and frees them all, after a 4 MiB block was freed first, which leaves glibc's
moving trim threshold at 8 MiB, so every round's 12 MiB free top goes back to the kernel and the next round
faults it in again; with the thresholds fixed only the first round faults."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from pcpstack.common import malloc
from pcpstack.engine.engine import Engine

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")

ROUNDS = """
import ctypes, json, resource, sys
from pcpstack.common import malloc
from pcpstack.engine.engine import Engine
kept = malloc.keep_freed_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
MIB = 1 << 20
libc.free(libc.malloc(4 * MIB))
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [libc.malloc(3 * MIB) for _ in range(4)]
    for block in blocks:
        libc.memset(block, 1, 3 * MIB)
    for block in blocks:
        libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""
PAGES_OF_A_ROUND = 4 * 3 * (1 << 20) // os.sysconf("SC_PAGE_SIZE")


def _rounds(mode: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in malloc.USER_SETTINGS} | env
    done = subprocess.run(
        [sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, env=environment, check=True
    )
    return json.loads(done.stdout)


def test_kept_memory_is_not_faulted_in_again() -> None:
    kept = _rounds("keep")
    assert kept["kept"] is True
    assert kept["faults"][0] >= PAGES_OF_A_ROUND // 2  # the first round's pages are new
    assert max(kept["faults"][1:]) < PAGES_OF_A_ROUND // 20  # the later rounds reuse them


def test_without_it_every_round_faults_its_memory_in_again() -> None:
    """The case above fails without the setting: glibc's own thresholds hand the rounds' memory back."""
    default = _rounds("default")
    assert min(default["faults"][1:]) >= PAGES_OF_A_ROUND // 2


def test_the_users_own_thresholds_stand() -> None:
    by_user = _rounds("keep", MALLOC_TRIM_THRESHOLD_=str(8 << 20))
    assert by_user["kept"] is False
    assert min(by_user["faults"][1:]) >= PAGES_OF_A_ROUND // 2


def test_a_cpu_engine_keeps_its_freed_memory(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: calls.append("kept") or True)
    Engine.load("tiny")
    assert calls == ["kept"]
