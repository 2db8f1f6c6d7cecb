"""CRC32C helpers: the checksum of a whole object from the checksums of its chunks, without a second pass.

`crc32c_combine` is zlib's crc32_combine (multiplication modulo the generator polynomial in GF(2)) for the
Castagnoli polynomial, so a writer or reader that checks every chunk gets the object's CRC for free.
The CRC itself is copy_crc.c's for large buffers where that library builds, else the crc32c package's.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import crc32c as _crc32c

from pcpstack.kvstore import copy_crc

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), bit-reflected


_C_MIN_BYTES = 64 << 10  # below this the ctypes call costs more than the C loop saves


def crc32c(data, value: int = 0) -> int:
    """CRC32C of a bytes-like object, continuing from value (the GIL is released for large buffers):
    copy_crc.c's loop where it is built, else the crc32c package."""
    lib = copy_crc.library()
    if lib is not None and memoryview(data).nbytes >= _C_MIN_BYTES:
        return copy_crc.crc32c(lib, data, value)
    return _crc32c.crc32c(data, value)


TWO_THREADS_MIN_BYTES = 16 << 20  # below this a second thread costs more than it saves


def on_two_threads(first: Callable[[], int], second: Callable[[], int], second_bytes: int) -> int:
    """The CRC32C of two halves of one pass (each callable returns its half's CRC), run at once (the first
    on a helper thread: the C loops, numpy's copy and the crc32c package release the GIL) and combined."""
    with ThreadPoolExecutor(1) as helper:
        head = helper.submit(first)
        tail = second()
        return crc32c_combine(head.result(), tail, second_bytes)


def crc32c_two_threads(data: memoryview) -> int:
    """CRC32C of a large buffer, its halves checksummed at once on two threads and combined: ~1.5x faster
    than one pass when the second core is free."""
    if len(data) < TWO_THREADS_MIN_BYTES:
        return crc32c(data)
    half = len(data) // 2
    return on_two_threads(lambda: crc32c(data[:half]), lambda: crc32c(data[half:]), len(data) - half)


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the polynomial, both reflected."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _build_x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _build_x2n_table()


@lru_cache(maxsize=64)
def _x8nmodp(length: int) -> int:
    """x^(8 * length) modulo the polynomial: the operator that shifts a CRC past length zero bytes."""
    p = 1 << 31  # x^0
    k = 3
    while length:
        if length & 1:
            p = _multmodp(_X2N[k & 31], p)
        length >>= 1
        k += 1
    return p


def crc32c_combine(crc1: int, crc2: int, length2: int) -> int:
    """CRC32C of A + B given crc1 = CRC32C(A), crc2 = CRC32C(B) and length2 = len(B)."""
    return _multmodp(_x8nmodp(length2), crc1) ^ crc2
