"""A CPU prefill rank keeps the memory its forwards free for the next ones (prefill.rank.keep_freed_memory):
glibc then serves a long prompt's large activations from its heap instead of mapping each one afresh."""

import os
import subprocess
import sys

import pytest

# Run in a fresh process: the allocator setting is process-wide and cannot be undone.
CHILD = """
import ctypes, sys, torch
from pcpstack.prefill.rank import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost",
    )]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
before = libc.mallinfo2().hblkhd
activation = torch.ones(16 << 20)  # 64 MiB, above glibc's largest threshold for serving from its heap
mapped = libc.mallinfo2().hblkhd - before
del activation
print(kept, mapped, libc.mallinfo2().arena)
"""
MIB = 1 << 20


def _child(mode: str, **env: str) -> tuple[bool, int, int]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**environ, **env},
    )
    kept, mapped, heap = done.stdout.split()
    return kept == "True", int(mapped), int(heap)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_a_rank_serves_large_activations_from_the_heap_and_keeps_them_once_freed():
    kept, mapped, heap = _child("keep")
    assert kept
    assert mapped == 0  # no mapping of its own
    assert heap >= 64 * MIB  # still held after the free, for the next forward
    kept, mapped, _ = _child("default")
    assert not kept and mapped >= 64 * MIB  # glibc's default: mapped apart, unmapped when freed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_a_rank_leaves_malloc_alone_when_the_environment_tunes_it():
    kept, mapped, _ = _child("keep", MALLOC_TRIM_THRESHOLD_="1048576")
    assert not kept and mapped >= 64 * MIB
