"""Shared-memory segments: files in /dev/shm (tmpfs) mapped with mmap, owned by the store alone.

Every segment is created, reused and unlinked by the store, so a writer or reader that dies can leak
nothing: the segment it was filling or reading goes back to the store when its stream breaks. Segment
names carry the store's random family token (`pcpkv-<token>-<n>`); the store holds an flock on
`pcpkv-<token>.lock` for its whole life, which lets a new store find and unlink the segments of a store
that was killed (its lock is free). The lock file doubles as the same-host probe clients look for.

Freed segments stay mapped in a warm pool: on this kind of machine a fresh tmpfs page costs a page fault
and zeroing (~1 GB/s), a reused one is plain memcpy (>10 GB/s). The pool never exceeds the budget the
core leaves free (`trim`).

Python's multiprocessing.shared_memory is not used: it registers every segment with the resource
tracker, which unlinks (and warns about) segments the store still owns when a client exits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path

from pcpstack.kvstore.checksum import crc32c, crc32c_two_threads
from pcpstack.kvstore.ranges import ByteRange, gather_with_crc, selection_bytes

PREFIX = "pcpkv-"
_HUGE_PAGE = 2 << 20


class Segment:
    """One store-owned tmpfs file, kept mapped read-write by the store."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            self._map = self._map_fd(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)  # the mapping keeps its own duplicate

    @staticmethod
    def _map_fd(fd: int, size: int) -> mmap.mmap:
        # fallocate makes a full /dev/shm fail here with ENOSPC instead of SIGBUS on a later write.
        os.posix_fallocate(fd, 0, max(size, 1))
        return mmap.mmap(fd, max(size, 1))

    @property
    def name(self) -> str:
        """File name inside the segment directory."""
        return self.path.name

    def resize(self, size: int) -> None:
        """Grows or shrinks the file and its mapping; shrinking returns the tail pages to the system."""
        if size == self.size:
            return
        if size > self.size:
            fd = os.open(self.path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        self._map.resize(max(size, 1))
        self.size = size

    def write(self, offset: int, data) -> None:
        """Copies data into the segment at offset."""
        self._map[offset : offset + len(data)] = data

    @contextlib.contextmanager
    def view(self, offset: int, length: int) -> Iterator[memoryview]:
        """A read-write view of length bytes at offset, valid inside the with block only (a view that
        outlived it would pin the mapping)."""
        with memoryview(self._map) as whole, whole[offset : offset + length] as part:
            yield part

    def crc32c(self, length: int) -> int:
        """CRC32C of the first length bytes, on two threads for a large segment (releases the GIL; safe
        to run in a thread)."""
        with memoryview(self._map) as view, view[:length] as part:
            return crc32c_two_threads(part)

    def destroy(self) -> None:
        """Unmaps and unlinks the file."""
        self._map.close()
        self.path.unlink(missing_ok=True)


class SegmentStore:
    """The store's segments: allocation with reuse, a warm pool, and reclaim of dead stores' leftovers."""

    def __init__(self, directory: str | Path = "/dev/shm") -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir() or not os.access(self.directory, os.W_OK):
            raise ValueError(f"shm_dir {str(self.directory)!r} is not a writable directory")
        self.token = secrets.token_hex(8)
        self._lock_path = self.directory / f"{PREFIX}{self.token}.lock"
        self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self._pool: list[Segment] = []
        self._next = 0
        self._closed = False
        self.reclaimed_orphans = reclaim_orphans(self.directory)

    @property
    def probe_name(self) -> str:
        """Name of the lock file, which clients look for to decide that they share this memory."""
        return self._lock_path.name

    @property
    def pooled_bytes(self) -> int:
        """Bytes held by free segments kept for reuse."""
        return sum(seg.size for seg in self._pool)

    def allocate(self, size: int) -> Segment:
        """A segment of exactly size bytes: the best-fitting pooled one resized, or a new one."""
        if self._pool:
            bigger = [seg for seg in self._pool if seg.size >= size]
            seg = min(bigger, key=lambda s: s.size) if bigger else max(self._pool, key=lambda s: s.size)
            self._pool.remove(seg)
            try:
                seg.resize(size)
            except OSError:
                seg.destroy()
                raise
            return seg
        self._next += 1
        return Segment(self.directory / f"{PREFIX}{self.token}-{self._next}", size)

    def recycle(self, seg: Segment) -> None:
        """Takes back a segment nobody uses any more, keeping it warm in the pool (or unlinking it once the
        store is closed: a put or get cancelled by shutdown hands its segment back after close)."""
        if self._closed:
            seg.destroy()
        else:
            self._pool.append(seg)

    def trim(self, max_pooled_bytes: int) -> None:
        """Unlinks pooled segments, largest first, until the pool holds at most max_pooled_bytes."""
        self._pool.sort(key=lambda s: s.size)
        while self._pool and self.pooled_bytes > max_pooled_bytes:
            self._pool.pop().destroy()

    def close(self) -> None:
        """Unlinks the pool and the lock file; segments still in use are unlinked when recycled."""
        self._closed = True
        self.trim(0)
        self._lock_path.unlink(missing_ok=True)
        os.close(self._lock_fd)


def reclaim_orphans(directory: Path) -> int:
    """Unlinks the segments and lock file of every store whose lock is free (it died); returns the count."""
    reclaimed = 0
    for lock_path in directory.glob(f"{PREFIX}*.lock"):
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            os.close(fd)
            continue  # its store is alive
        token = lock_path.name[len(PREFIX) : -len(".lock")]
        for seg_path in directory.glob(f"{PREFIX}{token}-*"):
            seg_path.unlink(missing_ok=True)
            reclaimed += 1
        lock_path.unlink(missing_ok=True)
        os.close(fd)
    return reclaimed


def shares_memory_with(shm_dir: str, probe: str) -> bool:
    """True when this process sees the store's probe file, i.e. the shared-memory path can work."""
    return bool(shm_dir and probe) and os.access(os.path.join(shm_dir, probe), os.R_OK | os.W_OK)


def anonymous_buffer(size: int) -> memoryview:
    """A writable buffer of size bytes that torch.frombuffer and numpy can wrap; large ones ask for
    transparent huge pages, which fault in ~4x faster than 4 KiB pages."""
    if size < _HUGE_PAGE:
        return memoryview(bytearray(size))
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # huge pages are an optimisation only
        buf.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(buf)


_COPY_CHUNK = 4 << 20


def _copy_with_crc(dst: memoryview, src: memoryview) -> int:
    """Copies src into dst and returns src's CRC32C, a few MiB at a time so the checksum reads each piece
    while it is still in cache (about 30 % faster than a copy and then a second pass over cold memory)."""
    crc = 0
    for offset in range(0, len(src), _COPY_CHUNK):
        piece = src[offset : offset + _COPY_CHUNK]
        dst[offset : offset + _COPY_CHUNK] = piece
        crc = crc32c(piece, crc)
    return crc


_WRITE_CHUNK = 1 << 20


def fill_segment(shm_dir: str, name: str, data: memoryview | Sequence[memoryview]) -> int:
    """Writes data (one buffer, or pieces written one after another) into the store's segment and returns
    its CRC32C (writer side of the fast path).

    pwrite, not a mapping: building and tearing down the page tables of a writable 4 KiB-page mapping
    costs about as much as the copy itself here, and pwrite fills the file's pages without them (256 MiB
    in 55 ms, not 64). Each piece is checksummed right after it is written, while it is still in cache.
    Pieces let a writer send an object straight from where it lives (a sequence's KV cache blocks) instead
    of gathering it into one buffer first.
    """
    pieces = [data] if isinstance(data, memoryview) else data
    fd = os.open(os.path.join(shm_dir, name), os.O_WRONLY)
    try:
        crc = offset = 0
        for buffer in pieces:
            for start in range(0, len(buffer), _WRITE_CHUNK):
                piece = buffer[start : start + _WRITE_CHUNK]
                written = 0
                while written < len(piece):
                    written += os.pwrite(fd, piece[written:], offset + written)
                crc = crc32c(piece, crc)
                offset += len(piece)
        return crc
    finally:
        os.close(fd)


def copy_segment(shm_dir: str, name: str, size: int) -> tuple[memoryview, int]:
    """A private copy of the store's segment and its CRC32C (reader side of the fast path)."""
    out = anonymous_buffer(size)
    fd = os.open(os.path.join(shm_dir, name), os.O_RDONLY)
    try:
        with (
            mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ) as seg,
            memoryview(seg) as view,
        ):
            return out, _copy_with_crc(out, view)
    finally:
        os.close(fd)


def copy_ranges(shm_dir: str, name: str, size: int, ranges: list[ByteRange]) -> tuple[memoryview, int]:
    """A private copy of the selected ranges of the store's segment (of size bytes) and its CRC32C: only
    the pages the ranges touch are read (no MAP_POPULATE of the whole segment)."""
    out = anonymous_buffer(selection_bytes(ranges))
    fd = os.open(os.path.join(shm_dir, name), os.O_RDONLY)
    try:
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as seg:
            return out, gather_with_crc(seg, ranges, out)
    finally:
        os.close(fd)
