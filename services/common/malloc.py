"""Keeps an engine process's freed memory for its next forward instead of handing it back to the kernel.

A forward allocates and frees the same large activations layer after layer, prompt after prompt. glibc's
malloc returns the free top of its heap to the kernel once it is larger than a trim threshold, a threshold
it moves as it goes (twice the largest mapped block freed so far, at most 64 MiB), and the next forward gets
those pages back one minor fault at a time. Whether a process falls into that depends on the order of its
allocations: of two PCP=2 ranks prefilling 4,096 SmolLM2 tokens, one took ~365,000 minor faults every
prefill (0.65-1.0 s of system time, 12 % of its forward) and the other none, and the other then waited for
it at every layer's K/V exchange (PCP=2 1.76x PCP=1 where its CPU work alone gave 1.9x; AMD EPYC, one
thread a rank). Fixed thresholds end that: a freed top of up to TRIM_THRESHOLD_BYTES stays in the process,
and blocks up to glibc's largest mapping threshold (32 MiB) come from the heap, so the memory of one forward
is the memory of the next. A process keeps up to its peak activations resident between requests, which a
serving process holds anyway at its next long prompt.

Where the user set MALLOC_TRIM_THRESHOLD_ or MALLOC_MMAP_THRESHOLD_ (glibc's own environment variables),
theirs stand. Off glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger(__name__)

TRIM_THRESHOLD_BYTES = 1 << 30
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest glibc accepts on 64-bit
# mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


@functools.cache
def keep_freed_memory() -> bool:
    """Fixes this process's malloc thresholds as the module says (once); whether they were set here (False:
    not glibc, or the user's environment sets them)."""
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and done
    if done:
        log.debug("malloc keeps freed memory up to %d bytes for reuse", TRIM_THRESHOLD_BYTES)
    return done
