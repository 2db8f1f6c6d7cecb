"""Builds and loads copy_crc.c: a copy that computes the CRC32C of the bytes in the same pass (of one
buffer, or of a strided range's pieces), and the CRC32C alone (~15 % faster than the crc32c package on
buffers larger than the cache: it prefetches).

The library is compiled on first use with the machine's C compiler (AVX2, SSE4.2's crc32 and PCLMULQDQ,
which x86-64 CPUs have had since 2013) and cached under `~/.cache/pcpstack/kernels` (or
$PCPSTACK_KERNEL_CACHE, the engine's kernels' cache) by a hash of the source, flags and compiler, so
every process after the first loads it in milliseconds. ctypes releases the GIL during the call, so two
threads copy at once.

PCPSTACK_COPY_CRC=0 never builds it; =1 requires it (an error where it cannot be had); unset uses it
where it builds. Where it is off, the CPU lacks the instructions or no compiler works, `library()` is
None: shm.py and ranges.py copy with numpy and checksum.py uses the crc32c package (same bytes, same
CRC).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pcpstack.common import native
from pcpstack.common.config import COPY_CRC_CHOICES, COPY_CRC_ENV, ConfigError, env_choice

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("copy_crc.c")
ENABLE_ENV = COPY_CRC_ENV
_FLAGS = ("-O3", "-mavx2", "-msse4.2", "-mpclmul", "-shared", "-fPIC")
_CPU_FLAGS_NEEDED = ("avx2", "sse4_2", "pclmulqdq")
MAX_DEPTH = 8  # copy_crc.c's MAX_DEPTH: levels of repeats one gathered range may have


def _cpu_has_instructions() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return all(flag in flags for flag in _CPU_FLAGS_NEEDED)
    return False


@functools.cache
def library() -> ctypes.CDLL | None:
    """The fused copy, built first if needed; None when switched off, or (unless PCPSTACK_COPY_CRC=1
    demands it) when the CPU lacks AVX2, SSE4.2 or PCLMULQDQ or no compiler can build it: callers then
    take the numpy + crc32c path."""
    setting = env_choice(ENABLE_ENV, COPY_CRC_CHOICES)
    if setting == "0":
        return None
    lib, missing = _load()
    if lib is None:
        if setting == "1":
            rule = f"requires the fused copy, which is unavailable: {missing}"
            raise ConfigError.broken(ENABLE_ENV, setting, rule)
        log.warning("KV copies use numpy and the crc32c package (slower): %s", missing)
        return None
    return lib


def _load() -> tuple[ctypes.CDLL | None, str]:
    """The library, or None and why not."""
    if not _cpu_has_instructions():
        return None, "this CPU lacks AVX2, SSE4.2's crc32 or PCLMULQDQ"
    compiler = native.compiler()
    if compiler is None:
        return None, "no C compiler found"
    try:
        path = native.library_path(compiler, SOURCE, _FLAGS)
        if not path.exists():
            native.build(compiler, SOURCE, _FLAGS, (), path, timeout_s=120)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"building or loading {SOURCE.name} failed: {getattr(error, 'stderr', '') or error}"
    lib.copy_crc32c.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32)
    lib.copy_crc32c.restype = ctypes.c_uint32
    lib.crc32c.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32)
    lib.crc32c.restype = ctypes.c_uint32
    _u64s = ctypes.POINTER(ctypes.c_uint64)
    lib.gather_crc32c.argtypes = (
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_size_t,
        _u64s,
        _u64s,
        ctypes.c_uint32,
    )
    lib.gather_crc32c.restype = ctypes.c_uint32
    return lib, ""


def _address(buffer) -> int:
    """Address of a contiguous buffer's first byte (read-only ones too)."""
    return np.frombuffer(buffer, np.uint8).ctypes.data if buffer.nbytes else 0


def crc32c(lib: ctypes.CDLL, data, value: int = 0) -> int:
    """CRC32C of a contiguous bytes-like object, continuing from value; the GIL is released."""
    with memoryview(data) as view:
        return lib.crc32c(_address(view), view.nbytes, value) if view.nbytes else value


def copy_crc32c(lib: ctypes.CDLL, dst: memoryview, src: memoryview, value: int = 0) -> int:
    """Copies src into dst (of the same length) and returns the CRC32C of the bytes, continuing from
    value; the GIL is released for the copy."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"dst holds {dst.nbytes} bytes, src {src.nbytes}: a copy needs equal lengths")
    if dst.readonly:
        raise ValueError("dst is read-only")
    if not src.nbytes:
        return value
    return lib.copy_crc32c(_address(dst), _address(src), src.nbytes, value)


def gather_crc32c(
    lib: ctypes.CDLL,
    dst: memoryview,
    src: memoryview,
    offset: int,
    length: int,
    repeats: Sequence[tuple[int, int]],
    value: int = 0,
) -> int:
    """Copies the pieces of one strided range of src into dst, one after another, and returns their
    CRC32C continuing from value: pieces of length bytes at offset + i0 * stride0 + i1 * stride1 + ...,
    for each i below its count, repeats given as (stride, count) outermost first, in row-major order.
    Both buffers are byte-formatted; the range must lie inside src (it is checked: C would not)."""
    if len(repeats) > MAX_DEPTH:
        raise ValueError(f"{len(repeats)} levels of repeats; at most {MAX_DEPTH}")
    if offset < 0 or length < 0 or any(stride < 0 or count < 1 for stride, count in repeats):
        raise ValueError(f"offset={offset}, length={length} and strides must be >= 0, counts >= 1: {repeats}")
    end = offset + sum((count - 1) * stride for stride, count in repeats) + length
    if end > src.nbytes:
        raise ValueError(f"the range ends at byte {end}, beyond the source's {src.nbytes}")
    pieces = math.prod(count for _, count in repeats)
    if dst.nbytes != pieces * length:
        raise ValueError(f"dst holds {dst.nbytes} bytes; the range selects {pieces * length}")
    if dst.readonly:
        raise ValueError("dst is read-only")
    if not dst.nbytes:
        return value
    strides = (ctypes.c_uint64 * MAX_DEPTH)(*(stride for stride, _ in repeats))
    counts = (ctypes.c_uint64 * MAX_DEPTH)(*(count for _, count in repeats))
    return lib.gather_crc32c(
        _address(dst), _address(src) + offset, length, len(repeats), strides, counts, value
    )
