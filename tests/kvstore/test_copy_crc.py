"""The C copy and CRC (copy_crc.c) against the crc32c package and numpy, and the fallback without it."""

from __future__ import annotations

import os
import shutil

import crc32c
import numpy as np
import pytest

from pcpstack.common import native
from pcpstack.common.config import ConfigError
from pcpstack.kvstore import checksum, copy_crc
from pcpstack.kvstore.ranges import (
    CRC_IN_PLACE_MIN_BYTES,
    ByteRange,
    ByteRepeat,
    _halves,
    crc_of_selection,
    gather_with_crc,
    selection_bytes,
)
from pcpstack.kvstore.shm import copy_with_crc

_CAN_BUILD = copy_crc._cpu_has_instructions() and bool(
    os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
)
needs_build = pytest.mark.skipif(not _CAN_BUILD, reason="no C compiler or no SSE4.2/PCLMULQDQ here")


@pytest.fixture
def fresh_library(monkeypatch):
    """library() decided again under the test's environment, and again after it."""
    copy_crc.library.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    copy_crc.library.cache_clear()


def _random(size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


# Around the lane block (3 x 4096 bytes), the 8-byte word and the streaming threshold (4 MiB).
_LENGTHS = [0, 1, 7, 8, 63, 4095, 12287, 12288, 12289, 3 * 12288 + 13, (4 << 20) + 3, (5 << 20) + 12288]


@needs_build
@pytest.mark.parametrize("length", _LENGTHS)
@pytest.mark.parametrize("start", [0, 1, 3, 8])
def test_fused_copy_equals_numpy_copy_and_crc32c_package(length: int, start: int) -> None:
    lib = copy_crc.library()
    assert lib is not None
    source = _random(length + 16, length + start)
    target = np.zeros(length + 16, np.uint8)
    src, dst = memoryview(source)[start : start + length], memoryview(target)[start : start + length]
    for value in (0, 0x12345678):
        target[:] = 0
        assert copy_crc.copy_crc32c(lib, dst, src, value) == crc32c.crc32c(src, value)
        assert bytes(target[start : start + length]) == bytes(src)
        assert not target[:start].any() and not target[start + length :].any()  # nothing written outside


@needs_build
@pytest.mark.parametrize("length", _LENGTHS)
@pytest.mark.parametrize("start", [0, 1, 3])
def test_c_crc_equals_crc32c_package(length: int, start: int) -> None:
    lib = copy_crc.library()
    assert lib is not None
    data = memoryview(_random(length + 8, length))[start : start + length]
    for value in (0, 0x9ABCDEF0):
        assert copy_crc.crc32c(lib, data, value) == crc32c.crc32c(data, value)


@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_build), False])
def test_checksum_crc32c_of_large_and_small_buffers(fresh_library, fused: bool) -> None:
    fresh_library.setenv(copy_crc.ENABLE_ENV, "1" if fused else "0")
    assert (copy_crc.library() is not None) == fused
    for data in (_random(100, 3), _random((1 << 20) + 5, 4), _random((17 << 20) + 1, 5)):
        assert checksum.crc32c(data, 77) == crc32c.crc32c(data, 77)
        assert checksum.crc32c_two_threads(memoryview(data)) == crc32c.crc32c(data)


@needs_build
def test_fused_copy_reads_read_only_sources() -> None:
    lib = copy_crc.library()
    assert lib is not None
    data = bytes(_random(100_003, 1))
    out = bytearray(len(data))
    assert copy_crc.copy_crc32c(lib, memoryview(out), memoryview(data)) == crc32c.crc32c(data)
    assert out == data


@needs_build
def test_fused_copy_refuses_unequal_lengths_and_read_only_targets() -> None:
    lib = copy_crc.library()
    assert lib is not None
    with pytest.raises(ValueError, match="equal lengths"):
        copy_crc.copy_crc32c(lib, memoryview(bytearray(9)), memoryview(bytes(8)))
    with pytest.raises(ValueError, match="read-only"):
        copy_crc.copy_crc32c(lib, memoryview(bytes(8)), memoryview(bytes(8)))


def _pieces() -> list[np.ndarray]:
    # Odd lengths over 16 MiB in all, so copy_with_crc splits them over two threads inside a piece.
    return [_random(n, n) for n in (1, 4095, (9 << 20) + 7, 12289, (8 << 20) + 63)]


@pytest.mark.parametrize("crc_of_copy", [False, True])
@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_build), False])
def test_copy_with_crc_of_pieces_on_two_threads(fresh_library, fused: bool, crc_of_copy: bool) -> None:
    fresh_library.setenv(copy_crc.ENABLE_ENV, "1" if fused else "0")
    assert (copy_crc.library() is not None) == fused
    pieces = _pieces()
    whole = np.concatenate(pieces)
    out = np.zeros(whole.size, np.uint8)
    crc = copy_with_crc(memoryview(out), [memoryview(p) for p in pieces], crc_of_copy=crc_of_copy)
    assert crc == crc32c.crc32c(whole)
    assert np.array_equal(out, whole)


def test_forbidding_the_build_leaves_the_numpy_path(fresh_library, tmp_path) -> None:
    fresh_library.setenv(copy_crc.ENABLE_ENV, "0")
    fresh_library.setenv(native.CACHE_ENV, str(tmp_path))
    assert copy_crc.library() is None
    data = _random(1 << 20, 7)
    out = bytearray(data.size)
    assert copy_with_crc(memoryview(out), [memoryview(data)]) == crc32c.crc32c(data)
    assert out == data.tobytes()
    assert not list(tmp_path.iterdir())  # nothing was built


def test_without_a_compiler_the_numpy_path_serves_unless_the_c_path_is_required(fresh_library, tmp_path):
    fresh_library.setenv("CC", str(tmp_path / "no-such-cc"))
    fresh_library.setenv(native.CACHE_ENV, str(tmp_path))  # no library built earlier to load
    fresh_library.delenv(copy_crc.ENABLE_ENV, raising=False)
    assert copy_crc.library() is None
    data = _random((17 << 20) + 3, 9)
    out = bytearray(data.size)
    assert copy_with_crc(memoryview(out), [memoryview(data)]) == crc32c.crc32c(data)
    assert out == data.tobytes()
    copy_crc.library.cache_clear()
    fresh_library.setenv(copy_crc.ENABLE_ENV, "1")
    with pytest.raises(ConfigError, match="PCPSTACK_COPY_CRC='1': requires the fused copy, which is unavail"):
        copy_crc.library()


def test_bad_setting_is_refused_naming_the_variable(fresh_library) -> None:
    fresh_library.setenv(copy_crc.ENABLE_ENV, "yes")
    with pytest.raises(ConfigError, match="PCPSTACK_COPY_CRC='yes': must be one of: unset"):
        copy_crc.library()


def _numpy_gather(source: np.ndarray, byte_range: ByteRange) -> np.ndarray:
    """The range's pieces, one after another, picked by plain indexing."""
    starts = np.array([byte_range.offset])
    for repeat in byte_range.repeats:  # outermost first: row-major order of the pieces
        starts = (starts[:, None] + np.arange(repeat.count) * repeat.stride).reshape(-1)
    return np.concatenate([source[s : s + byte_range.length] for s in starts])


_RANGES = [
    ByteRange(5, 1),
    ByteRange(3, 4099, (ByteRepeat(10_000, 7),)),
    ByteRange(1, 63, (ByteRepeat(70_001, 3), ByteRepeat(128, 5), ByteRepeat(64, 2))),
    ByteRange(17, 13_000, (ByteRepeat(1 << 20, 4), ByteRepeat(20_000, 3))),
    ByteRange(11, (4 << 20) + 9, (ByteRepeat((4 << 20) + 100, 2),)),  # pieces past the streaming size
]


@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_build), False])
def test_gather_with_crc_copies_and_checksums_each_ranges_pieces(fresh_library, fused: bool) -> None:
    fresh_library.setenv(copy_crc.ENABLE_ENV, "1" if fused else "0")
    assert (copy_crc.library() is not None) == fused
    source = _random(9 << 20, 11)
    expected = np.concatenate([_numpy_gather(source, r) for r in _RANGES])
    out = np.zeros(expected.size + 5, np.uint8)
    assert gather_with_crc(memoryview(source), _RANGES, memoryview(out)) == crc32c.crc32c(expected)
    assert np.array_equal(out[: expected.size], expected) and not out[expected.size :].any()


# Selections over 16 MiB, gathered in two halves on two threads: the middle byte inside a range's outer
# repeats, inside a range without repeats, and inside a range whose outer count is 1 (not cut).
_LARGE_SELECTIONS = [
    [ByteRange(3, 1000, (ByteRepeat(2000, 10_000),)), ByteRange(7, 9 << 20)],
    [ByteRange(5, 1), ByteRange(0, (17 << 20) + 1)],
    [ByteRange(9, 4096, (ByteRepeat(0, 1), ByteRepeat(8192, 4500)))],
]


@pytest.mark.parametrize("selection", range(len(_LARGE_SELECTIONS)))
@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_build), False])
def test_gather_with_crc_of_large_selections_on_two_threads(fresh_library, fused: bool, selection: int):
    fresh_library.setenv(copy_crc.ENABLE_ENV, "1" if fused else "0")
    assert (copy_crc.library() is not None) == fused
    ranges = _LARGE_SELECTIONS[selection]
    source = _random(40 << 20, selection)
    expected = np.concatenate([_numpy_gather(source, r) for r in ranges])
    assert expected.size >= 16 << 20
    out = np.zeros(expected.size, np.uint8)
    assert gather_with_crc(memoryview(source), ranges, memoryview(out)) == crc32c.crc32c(expected)
    assert np.array_equal(out, expected)


@pytest.mark.parametrize("fused", [pytest.param(True, marks=needs_build), False])
def test_the_crc_of_a_selection_in_place_is_the_crc_of_its_gathered_bytes(fresh_library, fused: bool) -> None:
    """A store answering a ranged read over shared memory checksums the selection where it lies: pieces of
    16 KiB and more one by one, ranges of smaller ones gathered first; either way the gathered bytes' CRC."""
    fresh_library.setenv(copy_crc.ENABLE_ENV, "1" if fused else "0")
    assert (copy_crc.library() is not None) == fused
    ranges = [
        *_RANGES,
        ByteRange(40, CRC_IN_PLACE_MIN_BYTES, (ByteRepeat(70_000, 3), ByteRepeat(20_000, 2))),
        ByteRange(1, CRC_IN_PLACE_MIN_BYTES - 1, (ByteRepeat(30_000, 5),)),
    ]
    source = _random(9 << 20, 12)
    expected = np.concatenate([_numpy_gather(source, r) for r in ranges])
    assert crc_of_selection(memoryview(source), ranges) == crc32c.crc32c(expected)
    for selection in _LARGE_SELECTIONS:
        source = _random(40 << 20, 13)
        expected = np.concatenate([_numpy_gather(source, r) for r in selection])
        assert crc_of_selection(memoryview(source), selection) == crc32c.crc32c(expected)


@pytest.mark.parametrize("selection", [0, 1])
def test_a_large_selection_is_cut_into_two_halves_that_keep_its_order(selection: int) -> None:
    ranges = _LARGE_SELECTIONS[selection]
    source = _random(40 << 20, selection)
    total = selection_bytes(ranges)
    first, second = _halves(ranges, total // 2)
    assert abs(selection_bytes(first) - total // 2) <= 2000  # cut between two pieces of 1000 bytes
    halves = [np.concatenate([_numpy_gather(source, r) for r in half]) for half in (first, second)]
    assert np.array_equal(np.concatenate(halves), np.concatenate([_numpy_gather(source, r) for r in ranges]))


@needs_build
def test_c_gather_refuses_a_range_beyond_its_source_or_a_wrong_sized_target() -> None:
    lib = copy_crc.library()
    assert lib is not None
    src, dst = memoryview(bytes(100)), memoryview(bytearray(30))
    with pytest.raises(ValueError, match="ends at byte 101"):
        copy_crc.gather_crc32c(lib, dst, src, 1, 10, [(45, 3)])
    with pytest.raises(ValueError, match="selects 20"):
        copy_crc.gather_crc32c(lib, dst, src, 0, 10, [(45, 2)])
    with pytest.raises(ValueError, match="at most 8"):
        copy_crc.gather_crc32c(lib, dst[:10], src, 0, 10, [(0, 1)] * 9)
