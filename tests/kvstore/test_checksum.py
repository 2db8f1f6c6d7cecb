"""CRC32C of an object from the CRCs of its chunks equals the CRC of the whole, however it is split."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pcpstack.kvstore.checksum import crc32c, crc32c_combine, crc32c_two_threads


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combine_equals_crc_of_concatenation(a: bytes, b: bytes):
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


@pytest.mark.parametrize("size", [0, 1 << 20, (16 << 20) + 3], ids=["empty", "one-thread", "two-threads"])
def test_two_thread_crc_equals_one_pass(size: int):
    data = random.randbytes(size)
    assert crc32c_two_threads(memoryview(data)) == crc32c(data)
