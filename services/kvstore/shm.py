"""Shared-memory segments: files in /dev/shm (tmpfs) mapped with mmap, owned by the store alone.

Every segment is created, reused and unlinked by the store, so a writer or reader that dies can leak
nothing: the segment it was filling or reading goes back to the store when its stream breaks. Segment
names carry the store's random family token (`pcpkv-<token>-<n>`); the store holds an flock on
`pcpkv-<token>.lock` for its whole life, which lets a new store find and unlink the segments of a store
that was killed (its lock is free). The lock file doubles as the same-host probe clients look for.

Freed segments stay mapped in a warm pool: on this kind of machine a fresh tmpfs page costs a page fault
and zeroing (~1 GB/s), a reused one is plain memcpy (>10 GB/s). The pool never exceeds the budget the
core leaves free (`trim`). A put reuses a pooled segment up to a quarter larger than itself as it is, so
objects of similar sizes keep landing in warm pages instead of shrinking a segment and growing it again;
the price is that tmpfs may hold up to 1.25x the store's capacity (a segment's slack is not counted
against it). A segment more than that larger is shrunk to the object (its tail pages go back
to the system).

A put of an object that lives on (a replica kept for prefix reuse) cannot recycle its segment, so the
next put would land in fresh pages: mapping them costs a page fault each on both sides (here ~0.5 ms per
MiB, 5x the copy). So after such a put the store prepares a standby segment of its size in the pool
(`SegmentStore.standby`: created at once, allocated and mapped on a worker thread) and names it to the
writer, which maps it on a thread of its own (`SegmentMaps.prefetch`) and names it back in its next put:
both mappings are then built between puts instead of inside one.

Clients keep their mappings of the store's segments too (`SegmentMaps`), since the store reuses them: with
4 KiB tmpfs pages, mapping and unmapping a segment per transfer (or a pwrite, which does the same per-page
work) costs about as much as the copy. A client copies with the CRC32C fused in (`copy_with_crc`: one C
pass, copy_crc.c, where it builds), on two threads for large objects.

Python's multiprocessing.shared_memory is not used: it registers every segment with the resource
tracker, which unlinks (and warns about) segments the store still owns when a client exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import secrets
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from pcpstack.kvstore import copy_crc
from pcpstack.kvstore.checksum import TWO_THREADS_MIN_BYTES, crc32c, crc32c_two_threads, on_two_threads
from pcpstack.kvstore.ranges import ByteRange, gather_with_crc

log = logging.getLogger(__name__)

PREFIX = "pcpkv-"
_HUGE_PAGE = 2 << 20
MAX_REUSE_SLACK = 0.25  # a pooled segment at most this share larger than a put is reused as it is
# A standby's promise to its writer lapses after this long without a put or standby request naming it: a
# writer that went away (a restarted prefill rank) must not keep room reserved, or in the end leave no
# room for other writers' standbys. A lapsed standby stays pooled, and its writer's next put may still
# take it if nobody else has.
PROMISE_TTL_S = 120.0


class Segment:
    """One store-owned tmpfs file, kept mapped read-write by the store.

    A standby segment (`later=True`) is only created here, at its size; `prepare` (on a worker thread)
    allocates its pages and maps them, and only then (`ready`) may it hold an object. Meanwhile the store
    holds an exclusive flock on the file, which a writer mapping it ahead of its put waits for
    (SegmentMaps.prefetch): two processes faulting the same fresh tmpfs pages at once wait on each page's
    lock and each pays for the faults, which cost the two together up to 1.5x the store's work alone."""

    def __init__(self, path: Path, size: int, later: bool = False) -> None:
        self.path = path
        self.size = size
        self.ready = not later
        self.failed = False
        self.promised = False  # named to a writer as its standby (SegmentStore.standby)
        self.promised_at = 0.0  # when that writer last named it or was given it (SegmentStore's clock)
        self._map: mmap.mmap | None = None
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if later:
                fcntl.flock(fd, fcntl.LOCK_EX)  # before anyone learns its name; prepare lets go
                os.ftruncate(fd, max(size, 1))  # its name and size exist at once; its pages come in prepare
                self._fd: int | None = fd
                return
            self._map = self._map_fd(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)  # the mapping keeps its own duplicate
        self._fd = None

    @staticmethod
    def _map_fd(fd: int, size: int, populate: bool = False) -> mmap.mmap:
        # fallocate makes a full /dev/shm fail here with ENOSPC instead of SIGBUS on a later write.
        os.posix_fallocate(fd, 0, max(size, 1))
        return map_shared(fd, size, "write" if populate else "")

    def prepare(self) -> None:
        """A standby's pages and its mapping, every page table entry built (safe on a worker thread: nothing
        else touches a segment that is not ready). On failure (a full /dev/shm) it is `failed` instead."""
        fd, self._fd = self._fd, None  # this thread's alone now: a destroy() meanwhile leaves it be
        assert fd is not None and not self.ready
        try:
            self._map = self._map_fd(fd, self.size, populate=True)
        except OSError:
            self.failed = True  # the pool destroys it at its next allocate, standby or trim
        finally:
            # Explicitly: the mapping holds a duplicate of fd, and with it the lock, past the close.
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self.ready = not self.failed

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
        self._mapped.resize(max(size, 1))
        self.size = size

    @property
    def _mapped(self) -> mmap.mmap:
        assert self._map is not None, f"segment {self.name} is used before it is prepared"
        return self._map

    def write(self, offset: int, data) -> None:
        """Copies data into the segment at offset."""
        self._mapped[offset : offset + len(data)] = data

    @contextlib.contextmanager
    def view(self, offset: int, length: int) -> Iterator[memoryview]:
        """A read-write view of length bytes at offset, valid inside the with block only (a view that
        outlived it would pin the mapping)."""
        with memoryview(self._mapped) as whole, whole[offset : offset + length] as part:
            yield part

    def crc32c(self, length: int) -> int:
        """CRC32C of the first length bytes, on two threads for a large segment (releases the GIL; safe
        to run in a thread)."""
        with memoryview(self._mapped) as view, view[:length] as part:
            return crc32c_two_threads(part)

    def destroy(self) -> None:
        """Unlinks the file and unmaps it. Unlinked first, whatever fails after, so that no file outlives
        the store; a mapping a view still exports (a thread reading it) is unmapped with its last view."""
        self.path.unlink(missing_ok=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()


class SegmentStore:
    """The store's segments: allocation with reuse, a warm pool, and reclaim of dead stores' leftovers."""

    def __init__(
        self,
        directory: str | Path = "/dev/shm",
        promise_ttl_s: float = PROMISE_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if promise_ttl_s <= 0:
            raise ValueError(f"promise_ttl_s must be > 0, got {promise_ttl_s}")
        self.directory = Path(directory)
        self._promise_ttl_s = promise_ttl_s
        self._clock = clock
        if not self.directory.is_dir() or not os.access(self.directory, os.W_OK):
            raise ValueError(f"shm_dir {str(self.directory)!r} is not a writable directory")
        self.token = secrets.token_hex(8)
        self._lock_path = self.directory / f"{PREFIX}{self.token}.lock"
        self._lock_fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self._pool: list[Segment] = []
        self._next = 0
        self.standby_puts = 0  # allocations that took the standby their writer named
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

    @property
    def promised_bytes(self) -> int:
        """Bytes of the pooled segments promised to writers as their standbys."""
        return sum(seg.size for seg in self._pool if seg.promised)

    def allocate(self, size: int, preferred: str = "") -> Segment:
        """A segment of at least size bytes: the pooled one named `preferred` (a standby its writer has
        mapped) if it is ready and at most a quarter larger; else the smallest pooled one that is; else
        the best-fitting pooled one resized to size (shrunk, or the largest grown); else a new one.
        Segments a worker thread is still preparing, and standbys promised to other writers, are left
        alone (trim reclaims the latter when the budget needs them)."""
        self._tidy()
        ready = [seg for seg in self._pool if seg.ready and (seg.name == preferred or not seg.promised)]
        if ready:
            warm = [seg for seg in ready if _fits(seg, size)]
            if warm:
                named = [seg for seg in warm if seg.name == preferred]
                seg = named[0] if named else min(warm, key=lambda s: s.size)
                self.standby_puts += bool(named)
                self._pool.remove(seg)
                seg.promised = False
                return seg
            bigger = [seg for seg in ready if seg.size >= size]
            seg = min(bigger, key=lambda s: s.size) if bigger else max(ready, key=lambda s: s.size)
            return self._resized_out_of_pool(seg, size)
        return Segment(self._new_path(), size)

    def _resized_out_of_pool(self, seg: Segment, size: int) -> Segment:
        """Takes a ready pooled segment out of the pool, promised to nobody, resized to size. If the resize
        fails it is unlinked (out of the pool already, never forgotten) and the error raised."""
        self._pool.remove(seg)
        seg.promised = False
        try:
            seg.resize(size)
        except BaseException:
            seg.destroy()
            raise
        return seg

    def standby(self, size: int, budget: int, held: str = "") -> tuple[Segment | None, bool]:
        """A free segment for a writer's next put of about size bytes, and whether it is new: the pooled
        standby it holds already (`held`) if that fits; else a pooled one that fits and is promised to no
        other writer (ready or being prepared); else, where the pool has no room for a new one beside the
        free segments, the smallest larger one promised to none, shrunk to size; else a new one in the
        pool, if the pool stays within budget
        bytes with it (pooled segments that fit no writer's standby and are promised to none make room,
        largest first), whose pages are still to come (run `prepare` on a worker thread); else None. The
        segment is promised to this writer, and only its puts take it (each PCP rank that pushes keeps a
        standby of its own); one it held that does not fit is no longer promised (a writer keeps one)."""
        self._tidy()
        for seg in self._pool:
            if seg.name == held:
                if _fits(seg, size):
                    self._promise(seg)  # renewed (or given back, if it had lapsed)
                    return seg, False
                seg.promised = False
        free = [seg for seg in self._pool if _fits(seg, size) and not seg.promised]
        if free:
            seg = min(free, key=lambda s: s.size)
            self._promise(seg)
            return seg, False
        if self._closed or self.promised_bytes + size > budget:
            return None, False
        larger = [seg for seg in self._pool if seg.ready and not seg.promised and seg.size > size]
        if larger and self.pooled_bytes + size > budget:
            # No room for a new one beside the free ones (a full store's evictions left them): rather than
            # unlink them for it, the smallest larger one shrunk to size (its tail pages go back), whose
            # pages are warm where a new one's must all be allocated and zeroed, during the announcing
            # writer's forward. (Growing a smaller one would fault its tail here, on the store's loop.)
            seg = self._resized_out_of_pool(min(larger, key=lambda s: s.size), size)
            self._promise(seg)
            self._pool.append(seg)
            self._trim(budget, spare_promised=True)
            return seg, False
        self._trim(budget - size, spare_promised=True)
        if self.pooled_bytes + size > budget:  # what is left unpromised is still being prepared
            return None, False
        seg = Segment(self._new_path(), size, later=True)
        self._promise(seg)
        self._pool.append(seg)
        return seg, True

    def prepare(self, seg: Segment) -> None:
        """Prepares a segment `standby` created (on a worker thread); one finished after close is unlinked."""
        seg.prepare()
        if self._closed:
            seg.destroy()

    def _new_path(self) -> Path:
        self._next += 1
        return self.directory / f"{PREFIX}{self.token}-{self._next}"

    def _promise(self, seg: Segment) -> None:
        seg.promised, seg.promised_at = True, self._clock()

    def _tidy(self) -> None:
        """Drops segments whose preparation failed, and lapses promises older than the promise TTL."""
        for seg in [seg for seg in self._pool if seg.failed]:
            self._pool.remove(seg)
            seg.destroy()
        stale = self._clock() - self._promise_ttl_s
        for seg in self._pool:
            if seg.promised and seg.promised_at < stale:
                seg.promised = False

    def recycle(self, seg: Segment) -> None:
        """Takes back a segment nobody uses any more, keeping it warm in the pool (or unlinking it once the
        store is closed: a put or get cancelled by shutdown hands its segment back after close)."""
        if self._closed:
            seg.destroy()
        else:
            self._pool.append(seg)

    def trim(self, max_pooled_bytes: int) -> None:
        """Unlinks pooled segments until the pool holds at most max_pooled_bytes: those promised to no
        writer first, largest first (one a worker thread is preparing goes at a later trim, once it is
        ready or failed)."""
        self._tidy()
        self._trim(max_pooled_bytes, spare_promised=False)

    def _trim(self, max_pooled_bytes: int, spare_promised: bool) -> None:
        ready = (seg for seg in self._pool if seg.ready and not (spare_promised and seg.promised))
        for seg in sorted(ready, key=lambda s: (s.promised, -s.size)):
            if self.pooled_bytes <= max_pooled_bytes:
                break
            self._pool.remove(seg)
            seg.destroy()

    def close(self) -> None:
        """Unlinks the pool and the lock file; segments still in use are unlinked when recycled."""
        self._closed = True
        self.trim(0)
        self._lock_path.unlink(missing_ok=True)
        os.close(self._lock_fd)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap module does not name it
_libc = ctypes.CDLL(None, use_errno=True)
_POPULATE_STEP = 8 << 20


def populate_writable(map_: mmap.mmap) -> bool:
    """Builds every page table entry of a shared mapping, writable, without touching its bytes (~0.3 ms a
    MiB here); MAP_POPULATE does not: it faults a shared mapping's pages in for reading, so the first write
    to each page faults again. Called through ctypes, which lets go of the GIL (mmap.madvise holds it, and
    would stall the caller's event loop meanwhile), _POPULATE_STEP bytes a call: each call holds the
    process's memory map lock, and one call for a 256 MiB standby (~80 ms) stalled every mmap and page
    fault of the process's other threads behind it (bench kv's shm_full gets beside it: 5.2-5.4 GB/s in
    one call, 7.8-8.5 in steps, 11.0-12.2 in steps on a thread of background priority). False
    where it could not: a kernel before 5.14, or a file the store shrank meanwhile (its tail is not
    touched: that would be a SIGBUS)."""
    place = (ctypes.c_char * len(map_)).from_buffer(map_)
    try:
        start = ctypes.addressof(place)
        for offset in range(0, len(map_), _POPULATE_STEP):
            length = min(_POPULATE_STEP, len(map_) - offset)
            if _libc.madvise(ctypes.c_void_p(start + offset), ctypes.c_size_t(length), _MADV_POPULATE_WRITE):
                return False
    finally:
        del place  # an exported buffer would keep the mapping from closing
    return True


def map_shared(fd: int, size: int, populate: str) -> mmap.mmap:
    """A shared read-write mapping of fd's first size bytes (at least one); populate: "write" builds every
    page table entry writable (a writer's), "read" read-only (a reader's: MAP_POPULATE), "" none."""
    if populate == "write":
        map_ = mmap.mmap(fd, max(size, 1))
        if populate_writable(map_):
            return map_
        map_.close()  # an older kernel, or a file shrunk meanwhile: entries for reading at least
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(fd, max(size, 1), flags=flags)


# The niceness of the threads that build standbys ahead of a put (pages, mappings): on a host of few cores a
# reader fetching the replica that was just put must not wait for them, and they have seconds to finish.
BACKGROUND_NICE = 10


def lower_thread_priority() -> None:
    """Lowers the calling thread's priority (only its: Linux schedules threads apart) by BACKGROUND_NICE,
    for work that only gets ahead of a later transfer; where the system refuses, it keeps its priority."""
    with contextlib.suppress(OSError, AttributeError):
        thread = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + BACKGROUND_NICE)
        )


# How long a writer mapping a standby ahead of its put waits for the store to finish preparing it (a 256
# MiB one takes ~0.1 s where the memory is at hand, up to ~1 s in fresh memory of a VM), and how often it
# looks. After that it maps it anyway, as it would without the wait.
PREPARED_WAIT_S = 10.0
PREPARED_POLL_S = 0.002


def wait_until_unlocked(fd: int, timeout_s: float) -> bool:
    """Waits until no other process holds an exclusive flock on fd's file (the store, preparing a standby)
    or timeout_s passes; True if it was let go. Polls rather than blocks, so that a store frozen mid-way
    cannot hold the caller forever."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(PREPARED_POLL_S)
            continue
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True


def reusable_for(segment_bytes: int, size: int) -> bool:
    """Whether a segment of segment_bytes holds an object of size bytes as it is: at least that large, at
    most MAX_REUSE_SLACK more."""
    return size <= segment_bytes <= size + int(size * MAX_REUSE_SLACK)


def _fits(seg: Segment, size: int) -> bool:
    return reusable_for(seg.size, size)


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
    return memoryview(_anonymous_map(size))


def _anonymous_map(size: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # huge pages are an optimisation only
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


_FUSED_CHUNK = 1 << 20  # a piece is checksummed right after its copy, while it is still in cache


def _copy_spans(spans: Sequence[tuple[memoryview, memoryview]], crc_of_copy: bool) -> int:
    """Copies each (dst, src) span in order and returns the CRC32C of the bytes: in one pass with the
    fused C copy, else piece by piece."""
    crc = 0
    fused = copy_crc.library()
    if fused is not None:  # its CRC is of the words it stored: the copy's, and the source's if it held still
        for dst, src in spans:
            crc = copy_crc.copy_crc32c(fused, dst, src, crc)
        return crc
    for dst, src in spans:
        for start in range(0, len(src), _FUSED_CHUNK):
            to, piece = dst[start : start + _FUSED_CHUNK], src[start : start + _FUSED_CHUNK]
            # numpy copies without the GIL (a memoryview slice assignment holds it), so two threads overlap.
            np.copyto(np.frombuffer(to, np.uint8), np.frombuffer(piece, np.uint8))
            crc = crc32c(to if crc_of_copy else piece, crc)
    return crc


def _split(spans: list[tuple[memoryview, memoryview]], at: int) -> tuple[list, list]:
    """The spans cut in two at byte `at` of their concatenation."""
    first: list[tuple[memoryview, memoryview]] = []
    for i, (dst, src) in enumerate(spans):
        if at <= len(src):
            return [*first, (dst[:at], src[:at])], [(dst[at:], src[at:]), *spans[i + 1 :]]
        first.append((dst, src))
        at -= len(src)
    return first, []


def copy_with_crc(dst: memoryview, sources: Sequence[memoryview], *, crc_of_copy: bool = False) -> int:
    """Copies sources one after another into dst and returns the CRC32C of the bytes (as read from the
    sources, or with crc_of_copy as they landed in dst). A large copy runs on two threads, each copying and
    checksumming one half (both the copy and the checksum release the GIL), the halves' CRCs combined."""
    spans, offset = [], 0
    for src in sources:
        spans.append((dst[offset : offset + len(src)], src))
        offset += len(src)
    if offset < TWO_THREADS_MIN_BYTES:
        return _copy_spans(spans, crc_of_copy)
    half = offset // 2
    first, second = _split(spans, half)
    return on_two_threads(
        lambda: _copy_spans(first, crc_of_copy), lambda: _copy_spans(second, crc_of_copy), offset - half
    )


_T = TypeVar("_T")


async def to_thread_to_the_end(func: Callable[..., _T], *args) -> _T:
    """func(*args) on a worker thread, for work through a segment's mapping. A caller cancelled meanwhile
    waits for the thread all the same, then gets its cancellation: the segment is handed back (and may be
    reused or shrunk, which would kill a client still copying with SIGBUS) only once nothing touches it."""
    work = asyncio.ensure_future(asyncio.to_thread(func, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        while not work.done():
            with contextlib.suppress(asyncio.CancelledError):  # a repeated cancel waits too
                await asyncio.wait([work])
        if not work.cancelled():
            work.exception()  # seen: the caller's cancellation is what it gets, not the thread's error
        raise


class _Mapping:
    """One kept mapping and how many transfers use it now (one in use is never unmapped)."""

    def __init__(self, map_: mmap.mmap) -> None:
        self.map = map_
        self.users = 0
        self.stale = False


class SegmentMaps:
    """A client's mappings of one store's segments, kept from one transfer to the next.

    tmpfs gives 4 KiB pages here, so mapping a 256 MiB segment builds 65k page-table entries and unmapping
    it tears them down again: about the cost of the copy itself, and the same per-page work makes a pwrite
    into tmpfs no cheaper. The store reuses its segments from a warm pool, so a client that keeps its
    mappings copies at memory speed from the second transfer on. A kept mapping would hold the memory of a
    segment the store has unlinked, so every transfer first drops the mappings whose file is gone, at most
    max_mapped are kept (the least recently used dropped first), and close() drops them all.
    Thread-safe: transfers run on worker threads.
    """

    def __init__(self, directory: str, max_mapped: int = 4) -> None:
        if max_mapped < 1:
            raise ValueError(f"max_mapped must be >= 1, got {max_mapped}")
        self.directory = directory
        self._max_mapped = max_mapped
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def mapped(self) -> list[str]:
        """Names of the segments mapped now, least recently used first."""
        with self._lock:
            return list(self._maps)

    @contextlib.contextmanager
    def _view(self, name: str, size: int, populate: str) -> Iterator[memoryview]:
        """A view of the first size bytes of segment name, through a kept mapping."""
        mapping = self._acquire(name, size, populate)
        try:
            with memoryview(mapping.map) as whole, whole[:size] as part:
                yield part
        finally:
            with self._lock:
                mapping.users -= 1
                if mapping.stale and not mapping.users:
                    mapping.map.close()

    def _acquire(self, name: str, size: int, populate: str) -> _Mapping:
        with self._lock:
            for gone in [n for n in self._maps if not os.path.exists(os.path.join(self.directory, n))]:
                self._drop(gone)
            mapping = self._maps.get(name)
            if mapping is not None and len(mapping.map) < size:  # the store grew the segment since
                self._drop(name)
                mapping = None
            if mapping is None:
                mapping = _Mapping(self._map_file(name, size, populate))
                self._keep(name, mapping)
            self._maps.move_to_end(name)
            mapping.users += 1
            return mapping

    def _keep(self, name: str, mapping: _Mapping) -> None:
        """Keeps a new mapping as the most recently used, dropping the least recently used beyond max."""
        self._maps[name] = mapping
        while len(self._maps) > self._max_mapped:
            self._drop(next(iter(self._maps)))

    def prefetch(self, name: str) -> bool:
        """Maps segment name now, every page table entry built, and keeps the mapping, so that a later
        transfer through it copies at once: a writer runs it on a thread of its own for the standby the
        store named (shm.SegmentStore.standby), between its puts. Other transfers are not held up
        meanwhile. False if it cannot be mapped (gone already: nothing is kept)."""
        with self._lock:
            if self._closed:
                return False
            if name in self._maps:
                return True
        try:
            map_ = self._map_file(name, 0, "write", prepared_within_s=PREPARED_WAIT_S)
        except (OSError, ValueError):
            return False
        with self._lock:
            if self._closed or name in self._maps:  # closed, or a transfer mapped it meanwhile
                map_.close()
                return not self._closed
            self._keep(name, _Mapping(map_))
            return True

    def _map_file(self, name: str, size: int, populate: str, prepared_within_s: float = 0.0) -> mmap.mmap:
        """Maps the whole file; populate: "write" builds every page table entry writable (a writer's),
        "read" read-only (a reader's), "" none (a ranged read touches only its pages). prepared_within_s:
        first wait up to that long for the store to finish preparing it (a standby: Segment.prepare)."""
        fd = os.open(os.path.join(self.directory, name), os.O_RDWR)
        try:
            if prepared_within_s and not wait_until_unlocked(fd, prepared_within_s):
                log.warning(
                    "the store still prepares segment %s after %.0f s; mapping it anyway",
                    name,
                    prepared_within_s,
                )
            held = os.fstat(fd).st_size
            if held < size:  # touching a mapping past the file's end would kill this process (SIGBUS)
                raise ValueError(f"segment {name!r} holds {held} bytes, fewer than the {size} to copy")
            # The whole file: the store reuses a segment for objects up to its size, so a larger object
            # next time needs no new mapping.
            return map_shared(fd, held, populate)
        finally:
            os.close(fd)

    def _drop(self, name: str) -> None:
        mapping = self._maps.pop(name)
        mapping.stale = True
        if not mapping.users:
            mapping.map.close()

    def fill(self, name: str, data: memoryview | Sequence[memoryview]) -> int:
        """Writes data (one buffer, or pieces one after another) into the store's segment and returns its
        CRC32C, computed over the writer's own bytes (writer side of the fast path). Pieces let a writer
        send an object straight from where it lives (a sequence's KV cache blocks) without gathering it."""
        pieces = [data] if isinstance(data, memoryview) else data
        size = sum(len(piece) for piece in pieces)
        with self._view(name, size, "write") as segment:
            return copy_with_crc(segment, pieces)

    def copy_out(self, name: str, out: memoryview) -> int:
        """Copies the segment's first len(out) bytes into out and returns their CRC32C, computed over the
        copy (reader side of the fast path)."""
        with self._view(name, len(out), "read") as segment:
            return copy_with_crc(out, [segment], crc_of_copy=True)

    def copy_ranges(self, name: str, size: int, ranges: list[ByteRange], out: memoryview) -> int:
        """Copies the selected ranges of the segment (of size bytes) into out and returns their CRC32C; a
        segment not mapped yet is mapped without populating it, so only the pages the ranges touch are
        read."""
        with self._view(name, size, "") as segment:
            return gather_with_crc(segment, ranges, out)

    def close(self) -> None:
        """Drops every mapping (one in use goes when its transfer ends); a prefetch keeps nothing after."""
        with self._lock:
            self._closed = True
            for name in list(self._maps):
                self._drop(name)


class ReceiveBuffers:
    """The buffers a client's gets land in, reused once their reader has let go of them.

    A fresh anonymous buffer is paid for at first touch: a page fault and the kernel zeroing every page,
    which on this VM costs more than copying the object into it. A buffer handed out stays in the pool;
    once nothing but the pool refers to it (its memoryview, and every array or tensor made from it, are
    gone) the next get of a size it fits reuses it, already faulted in. The pool holds at most
    max_pooled_bytes (buffers in use beyond that are forgotten, freed when their reader drops them);
    small buffers (under 2 MiB) and, with max_pooled_bytes=0, all buffers are fresh each time.
    """

    def __init__(self, max_pooled_bytes: int) -> None:
        if max_pooled_bytes < 0:
            raise ValueError(f"max_pooled_bytes must be >= 0, got {max_pooled_bytes}")
        self._max_pooled_bytes = max_pooled_bytes
        self._buffers: list[mmap.mmap] = []  # least recently handed out first
        self._lock = threading.Lock()

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the buffers the pool holds, in use or not."""
        with self._lock:
            return sum(len(buffer) for buffer in self._buffers)

    def _unused(self, index: int) -> bool:
        # The pool's list and getrefcount's argument are the only references: no view of it is alive.
        return sys.getrefcount(self._buffers[index]) == 2

    def take(self, size: int) -> memoryview:
        """A writable buffer of size bytes (contents undefined: the caller overwrites all of it)."""
        if size < _HUGE_PAGE or size > self._max_pooled_bytes:
            return anonymous_buffer(size)
        with self._lock:
            fits = [
                i
                for i in range(len(self._buffers))
                if size <= len(self._buffers[i]) <= 2 * size and self._unused(i)
            ]
            if fits:
                buffer = self._buffers.pop(min(fits, key=lambda i: len(self._buffers[i])))
            else:
                while self._buffers and sum(map(len, self._buffers)) + size > self._max_pooled_bytes:
                    if self._unused(0):
                        self._buffers[0].close()
                    del self._buffers[0]
                buffer = _anonymous_map(size)
            self._buffers.append(buffer)
            with memoryview(buffer) as whole:
                return whole[:size]

    def close(self) -> None:
        """Forgets every buffer (one in use is freed when its reader drops it)."""
        with self._lock:
            self._buffers.clear()
