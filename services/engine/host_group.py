"""Collectives among the processes of one host through shared memory, for the CPU decode TP group.

Why: a decode worker's TP ranks are processes of one host, and gloo's collectives pass every small tensor
around a ring of TCP connections. With more ranks than cores each hop waits for the next process to be
scheduled: on two cores a 9-rank all-reduce of one token's activations takes ~23 ms, and a SmolLM2 decode
step at TP=9 makes 60 of them (plus 60 DCP gathers). Here every rank writes its tensor into its own slot of a
shared segment and publishes an operation number; the others wait for the numbers (a futex, so a waiting
rank sleeps instead of spinning on a shared core) and read every slot. One wake-up per rank per operation
instead of a chain of them.

Protocol, per group (all members run the same operations in the same order, as with any collective):
- operation k writes slot [k % 2][rank], then stores k in the rank's sequence word and wakes its waiters;
- a rank waits until every member's sequence word has reached k, then reads buffer k % 2;
- a rank can be at most one operation ahead of the slowest (it needs everyone's k to finish k), so it
  writes buffer (k + 1) % 2 while others may still read buffer k % 2: two buffers are enough.
Every rank sums (or stacks) the slots in rank order, so all ranks get bit-identical results.

Failures: a wait sleeps in slices; between slices it checks that every peer process still lives and that
the collective has not run past its timeout, and raises HostGroupError otherwise (the TP engine turns that
into Unavailable). A tensor larger than a slot goes through the fallback gloo group instead (the choice
depends only on its size, so every rank makes the same one).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

# futex(2) on x86-64 only: its stores reach other cores in program order, which the protocol relies on
# (the data before the sequence word). Elsewhere host collectives are not offered and gloo is used.
_SYS_FUTEX = {"x86_64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): the words live in a segment of many processes
_WORD_STRIDE = 64  # one cache line per sequence word
_MASK, _HALF = 0xFFFFFFFF, 0x80000000
_SLICE_S = 0.2  # how often a sleeping waiter checks its peers
_SHM_DIR = Path("/dev/shm")

_libc = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX is not None else None


class HostGroupError(RuntimeError):
    """A host collective could not complete: a peer process exited or the collective timed out."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def host_collectives_available() -> bool:
    """Whether this platform has what host collectives use (Linux futexes and /dev/shm), and they are not
    turned off with PCPSTACK_HOST_COLLECTIVES=0."""
    if os.environ.get("PCPSTACK_HOST_COLLECTIVES", "1") == "0":
        return False
    return _libc is not None and _SHM_DIR.is_dir()


def _futex_wait(address: int, expected: int, timeout_s: float) -> None:
    spec = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    result = _libc.syscall(
        _SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(expected), ctypes.byref(spec), None, 0
    )
    if result == -1:
        code = ctypes.get_errno()
        if code not in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR):
            raise OSError(code, f"futex wait failed: {os.strerror(code)}")


def _futex_wake(address: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(2**31 - 1), None, None, 0)


def _alive(pid: int) -> bool:
    """Whether a process exists and has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class HostGroup:
    """The members `ranks` (global ranks of the default process group) of one host's group, this process
    being one of them. Build it with `HostGroup.create`, on every member of the world in the same order."""

    def __init__(
        self,
        segment: mmap.mmap,
        rank: int,
        pids: Sequence[int],
        slot_bytes: int,
        timeout_s: float,
        fallback: dist.ProcessGroup,
    ) -> None:
        self.rank = rank
        self.size = len(pids)
        self.fallback = fallback
        self._segment = segment
        self._pids = list(pids)
        self._slot_bytes = slot_bytes
        self._timeout_s = timeout_s
        self._op = 0
        self._words = [ctypes.c_int32.from_buffer(segment, r * _WORD_STRIDE) for r in range(self.size)]
        self._addresses = [ctypes.addressof(word) for word in self._words]
        data = self.size * _WORD_STRIDE
        whole = torch.frombuffer(segment, dtype=torch.uint8, count=2 * self.size * slot_bytes, offset=data)
        self._buffers = whole.view(2, self.size, slot_bytes)

    @classmethod
    def create(
        cls,
        ranks: Sequence[int],
        tag: str,
        slot_bytes: int,
        timeout_s: float,
        fallback: dist.ProcessGroup,
    ) -> HostGroup | None:
        """Collective over the whole default group (every process calls it, members or not): the first
        member creates the segment, the members map it, and it is unlinked once all have, so nothing is left
        behind however the processes end. Returns the group on its members, None elsewhere. `tag` must be
        unique among the groups alive on this host (e.g. the rendezvous port and the group's first rank)."""
        me = dist.get_rank()
        pids = torch.zeros(dist.get_world_size(), dtype=torch.long)
        pids[me] = os.getpid()
        dist.all_reduce(pids)
        path = _SHM_DIR / f"pcpstack-host-group-{tag}"
        size = len(ranks)
        total = size * _WORD_STRIDE + 2 * size * slot_bytes
        if me == ranks[0]:
            with open(path, "wb") as file:
                try:
                    # Reserved now: a full /dev/shm fails the start here, not a decode step later (SIGBUS).
                    os.posix_fallocate(file.fileno(), 0, total)
                except OSError as exc:
                    raise HostGroupError(
                        f"host collectives need {total} bytes in {_SHM_DIR} ({exc.strerror}); give the "
                        "process more shared memory (a container's shm size) or set "
                        "PCPSTACK_HOST_COLLECTIVES=0 to use gloo"
                    ) from None
        dist.barrier()
        segment = None
        if me in ranks:
            with open(path, "r+b") as file:
                segment = mmap.mmap(file.fileno(), total)
        dist.barrier()
        if me == ranks[0]:
            path.unlink(missing_ok=True)
        if segment is None:
            return None
        member_pids = [int(pids[r]) for r in ranks]
        return cls(segment, list(ranks).index(me), member_pids, slot_bytes, timeout_s, fallback)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the group in place (rank order, identical on every rank); returns it."""
        if tensor.nbytes > self._slot_bytes:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.fallback)
            return tensor
        slots = self._exchange(tensor)
        torch.sum(slots, dim=0, out=tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[size, *tensor.shape]: every member's tensor, in rank order."""
        if tensor.nbytes > self._slot_bytes:
            gathered = [torch.empty_like(tensor) for _ in range(self.size)]
            dist.all_gather(gathered, tensor.contiguous(), group=self.fallback)
            return torch.stack(gathered)
        return self._exchange(tensor).clone()

    def close(self) -> None:
        """Unmaps the segment (after the last operation)."""
        self._words, self._addresses, self._buffers = [], [], None
        with contextlib.suppress(BufferError):  # a view still exported: the mapping goes with the process
            self._segment.close()

    def _exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        """Publishes this rank's tensor and waits for everyone's; a view [size, *shape] of the slots (valid
        until this rank's next operation)."""
        self._op = (self._op + 1) & _MASK
        op = self._op
        nbytes = tensor.nbytes
        buffer = self._buffers[op & 1]
        buffer[self.rank, :nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        self._words[self.rank].value = op  # after the data (x86-64 keeps stores in order)
        _futex_wake(self._addresses[self.rank])
        deadline = None
        for rank in range(self.size):
            if rank != self.rank:
                deadline = self._wait(rank, op, deadline)
        return buffer[:, :nbytes].view(tensor.dtype).view(self.size, *tensor.shape)

    def _wait(self, rank: int, op: int, deadline: float | None) -> float | None:
        word, address = self._words[rank], self._addresses[rank]
        while True:
            seen = word.value
            if ((seen - op) & _MASK) < _HALF:  # seen >= op, modulo the 32-bit wrap
                return deadline
            _futex_wait(address, seen, _SLICE_S)
            if ((word.value - op) & _MASK) < _HALF:
                return deadline
            now = time.monotonic()
            if deadline is None:
                deadline = now + self._timeout_s
            if not _alive(self._pids[rank]):
                raise HostGroupError(f"host collective: rank {rank} (pid {self._pids[rank]}) has exited")
            if now > deadline:
                raise HostGroupError(
                    f"host collective: rank {rank} did not reach operation {op} in {self._timeout_s:.0f} s"
                )
