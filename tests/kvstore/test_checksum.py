"""CRC32C of an object from the CRCs of its chunks equals the CRC of the whole."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.kvstore.checksum import crc32c, crc32c_combine


@given(st.binary(max_size=300), st.binary(max_size=300))
def test_combine_equals_crc_of_concatenation(a: bytes, b: bytes):
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
