"""A decode engine of T tensor-parallel ranks behind the surface the decode batch uses of `Engine`.

The process that builds it is TP rank 0, the leader: it serves the batch. It spawns T-1 follower processes;
every rank joins one world (ParallelLayout(tp_size=T, pcp_size=1), tcp:// on loopback) and loads its
Megatron shard of the model (engine.parallel). Each rank keeps a plain `Engine` over its shard, whose cache
holds only the rank's K/V heads.

Every operation is one small command the leader broadcasts on the gloo `control` group (CPU tensors, so it
works the same whatever device the model runs on): a header [op, a, b] and, for a decode step, the step's
sequence numbers and tokens. Then every rank runs the same operation on its shard, in the same order, so the
ranks' block allocators stay identical; the model's all-reduces join the partial sums. The LM head is
replicated, so the leader returns its own logits. Adopting a replica, the leader holds the whole model's K/V
and sends each follower only its K/V head range (point to point on `control`), never the whole replica.

Decode context parallelism (`dcp_size` D > 1, engine.dcp): the D consecutive TP ranks of a DCP group hold
the same K/V head(s), and each stores only its interleaved token blocks of them; the ranks' attention
gathers over the group. Each rank's allocator then differs (rank 0 of a group owns block 0, so it never needs
fewer blocks than the others: the leader's count is the one admission needs). `kv_parts` says which heads and
positions each rank stores; `adopt_parts` takes a replica already cut that way.

`layout` is the WHOLE model's KvLayout: its fingerprint is what prefill stores replicas under and what
routers match, whatever TP either side runs.

A failed rank must not hang the batch: the leader checks its followers are alive before each command, and
every collective has the group's timeout, so a dead follower makes the next call raise Unavailable, and
every call after it too. When no command has been sent for a while the leader sends a no-op, so an idle
follower's wait never reaches the collective timeout.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.distributed as dist

from pcpstack.common.errors import Unavailable
from pcpstack.common.lifetime import exit_with_spawning_process
from pcpstack.common.logs import setup_logging
from pcpstack.common.ports import free_port
from pcpstack.engine.config import ModelArgs
from pcpstack.engine.dcp import DcpShard, KvPart
from pcpstack.engine.device import device_for_rank
from pcpstack.engine.engine import Engine
from pcpstack.engine.host_group import HostGroup, host_collectives_available
from pcpstack.engine.kv_cache import KvLayout, PagedKVCache
from pcpstack.engine.parallel import ParallelGroups, ParallelLayout, TensorParallelShard, init_parallel_groups
from pcpstack.engine.weights import load_model

log = logging.getLogger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
# How long the followers may take to load their shards (a large model from a slow disk).
_LOAD_TIMEOUT_S = 900.0
_MASTER_ADDR = "127.0.0.1"
# Per rank and buffer of a host group: a decode step's largest exchange is [batch, dim] fp32 activations, so
# 256 KiB covers the default --max-batch of 16 up to a 4096-dim model (113 sequences of SmolLM2); larger
# ones go through gloo. Small, since containers often get a 64 MB /dev/shm (TP=9 x DCP=3: 9 MiB in all).
_HOST_SLOT_BYTES = 256 << 10

# Command codes of the header [op, a, b] the leader broadcasts.
_OP_NOOP, _OP_ADOPT, _OP_DECODE, _OP_FREE, _OP_STOP, _OP_BLOCKS = range(6)
_HEADER = 3


@dataclass(frozen=True)
class FollowerSpec:
    """What a follower process needs to join the group and load its shard."""

    model: str | None
    tp_rank: int
    tp_size: int
    dcp_size: int
    master_port: int
    device_kind: str  # cpu, cuda, npu; empty: what is present
    dtype: torch.dtype | None
    block_size: int
    num_blocks: int
    timeout_s: float
    threads: int
    log_level: str


def _device(spec: FollowerSpec) -> torch.device:
    # Every rank of a decode worker runs on one host: its local index is its TP rank.
    return device_for_rank(spec.tp_rank, spec.device_kind or None)


def _join(spec: FollowerSpec, device: torch.device) -> tuple[ParallelGroups, TensorParallelShard, DcpShard]:
    """Joins the world; with DCP also creates every DCP group (consecutive TP ranks), in the same order on
    every rank since group creation is collective over the world. Returns the groups, and this rank's TP
    shard and DCP shard with the groups they sum and gather over: on the CPU, shared-memory host groups
    (engine.host_group; every rank of a decode worker is on one host), which do a step's small collectives
    ~30 times faster than gloo's ring on a machine with fewer cores than ranks."""
    layout = ParallelLayout(spec.tp_size, 1)
    groups = init_parallel_groups(
        layout, spec.tp_rank, _MASTER_ADDR, spec.master_port, device, spec.timeout_s
    )
    on_host = device.type == "cpu" and host_collectives_available()
    tp_group = groups.tp_group
    if on_host:
        tp_group = HostGroup.create(
            range(spec.tp_size), f"{spec.master_port}-tp", _HOST_SLOT_BYTES, spec.timeout_s, groups.tp_group
        )
    shard = TensorParallelShard(groups.tp_rank, spec.tp_size, tp_group)
    size = spec.dcp_size
    if size == 1:
        return groups, shard, DcpShard(0, 1, spec.block_size)
    timeout = timedelta(seconds=spec.timeout_s)
    members = [list(range(g * size, (g + 1) * size)) for g in range(spec.tp_size // size)]
    dcp_groups = [dist.new_group(ranks, timeout=timeout) for ranks in members]
    mine = dcp_groups[spec.tp_rank // size]
    if on_host:
        for ranks, fallback in zip(members, dcp_groups, strict=True):
            created = HostGroup.create(
                ranks, f"{spec.master_port}-dcp{ranks[0]}", _HOST_SLOT_BYTES, spec.timeout_s, fallback
            )
            mine = created or mine
    return groups, shard, DcpShard(spec.tp_rank % size, size, spec.block_size, mine)


def _shard_engine(
    spec: FollowerSpec, shard: TensorParallelShard, dcp: DcpShard, device: torch.device
) -> Engine:
    loaded = load_model(spec.model, device, spec.dtype, shard=shard)
    return Engine(loaded, block_size=spec.block_size, num_blocks=spec.num_blocks, dcp=dcp)


def _header(op: int, a: int = 0, b: int = 0) -> torch.Tensor:
    return torch.tensor([op, a, b], dtype=torch.long)


def _as_bytes(kv: torch.Tensor) -> torch.Tensor:
    """A K/V slice as flat bytes on the CPU, whatever its dtype (gloo and numpy lack some dtypes)."""
    return kv.contiguous().cpu().view(torch.uint8).reshape(-1)


def follower_main(spec: FollowerSpec, conn: Connection) -> None:
    """Entry point of a follower process: join, load, report, then run the leader's commands until STOP or
    until the group fails (the leader died or timed out)."""
    torch.set_num_threads(spec.threads)
    setup_logging(f"decode-tp-rank-{spec.tp_rank}", spec.log_level)
    exit_with_spawning_process(f"decode TP rank {spec.tp_rank}")
    started = False
    try:
        device = _device(spec)
        conn.send("joining")  # imported and on its device: the leader may open the rendezvous
        groups, shard, dcp = _join(spec, device)
        engine = _shard_engine(spec, shard, dcp, device)
        conn.send("ready")
        started = True
        _follow(engine, groups.control)
    except Exception as exc:
        # A failure to start is the leader's to report (it refuses the worker's start with it).
        if started:
            log.exception("decode TP rank %d failed", spec.tp_rank)
        try:
            conn.send(f"TP rank {spec.tp_rank} failed: {type(exc).__name__}: {exc}")
        except OSError:
            pass  # the leader has gone
        finally:
            # Not sys.exit: a broken process group can hang in its destructor.
            os._exit(1)
    os._exit(0)


@torch.inference_mode()
def _follow(engine: Engine, control: dist.ProcessGroup) -> None:
    """Runs the leader's commands on this rank's shard, in the leader's order."""
    layout = engine.layout
    while True:
        header = _header(_OP_NOOP)
        dist.broadcast(header, src=0, group=control)
        op, a, b = header.tolist()
        if op == _OP_STOP:
            return
        if op == _OP_ADOPT:
            seq, num_tokens = a, b
            local = engine.dcp.local_count(num_tokens)
            shape = (layout.num_layers, 2, local, layout.num_kv_heads, layout.head_dim)
            itemsize = torch.empty(0, dtype=layout.torch_dtype).element_size()
            data = torch.empty(itemsize * torch.Size(shape).numel(), dtype=torch.uint8)
            dist.recv(data, src=0, group=control)
            engine.adopt_sequence(seq, data.view(layout.torch_dtype).view(shape), num_tokens)
        elif op == _OP_DECODE:
            step = torch.empty((2, a), dtype=torch.long)
            dist.broadcast(step, src=0, group=control)
            engine.decode_step(step[0].tolist(), step[1].tolist(), logits=False)
        elif op == _OP_FREE:
            engine.free(a)
        elif op == _OP_BLOCKS:
            _gather_blocks_in_use(engine, control)


def _gather_blocks_in_use(engine: Engine, control: dist.ProcessGroup) -> list[int]:
    """Every rank's allocated KV blocks, in rank order (a collective on `control`)."""
    used = engine.allocator.num_blocks - engine.allocator.num_free
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(control))]
    dist.all_gather(counts, torch.tensor([used], dtype=torch.long), group=control)
    return [int(c) for c in counts]


class TensorParallelEngine:
    """Rank 0 of a decode TP group: adopt_sequence, decode_step and free run on every rank's shard.

    Build it with `start`; `close` stops the followers. Safe to call from one thread at a time plus its own
    keep-alive thread (a lock orders them).
    """

    def __init__(
        self,
        leader: Engine,
        groups: ParallelGroups,
        followers: list[BaseProcess],
        full_args: ModelArgs,
        timeout_s: float,
    ) -> None:
        self._leader = leader
        self._control = groups.control
        self._followers = followers
        self.tp_size = groups.layout.tp_size
        self.args = full_args
        self.tokenizer = leader.tokenizer
        self.device = leader.device
        loaded = leader.loaded
        self.layout = KvLayout.for_model(loaded.model_id, full_args, loaded.dtype, leader.block_size)
        self._timeout_s = timeout_s
        # Each rank's K/V heads of the whole model and token blocks, for adoption.
        self._kv_heads = [
            TensorParallelShard(rank, self.tp_size).kv_head_range(full_args) for rank in range(self.tp_size)
        ]
        dcp = leader.dcp
        self._dcp_shards = [
            DcpShard(rank % dcp.size, dcp.size, dcp.block_size) for rank in range(self.tp_size)
        ]
        # Sequence ids travel as ints; the batch's ids are any hashable.
        self._numbers: dict[Hashable, int] = {}
        self._next_number = 0
        self._lock = threading.Lock()
        self._failure = ""
        self._closed = False
        # Called once, from whichever thread finds the group failed, with the reason (the worker then stops).
        self.on_failure: Callable[[str], None] | None = None
        self._last_command = time.monotonic()
        self._keepalive = threading.Thread(target=self._keep_alive, name="decode-tp-keepalive", daemon=True)
        self._keepalive.start()

    @classmethod
    def start(
        cls,
        model: str | Path | None,
        tp_size: int,
        *,
        device_kind: str = "",
        dtype: torch.dtype | None = None,
        block_size: int,
        num_blocks: int,
        timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        threads: int = 0,
        dcp_size: int = 1,
    ) -> TensorParallelEngine:
        """Spawns the followers, joins the group as rank 0 and loads every rank's shard.

        Every rank, this process included, runs `threads` torch threads (0: the host's cores / tp_size).
        With `dcp_size` D > 1 each group of D consecutive ranks splits the tokens of its K/V head(s).

        ValueError when the model cannot be split `tp_size` ways (or its K/V heads `dcp_size` ways) or a
        rank has no device; Unavailable when a follower fails to start.
        """
        if tp_size < 2:
            raise ValueError(f"tensor_parallel_size={tp_size}: a single rank runs the plain Engine")
        if dcp_size < 1 or tp_size % dcp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size}, decode_context_parallel_size={dcp_size}: DCP needs "
                "tp % dcp == 0 and tp >= dcp"
            )
        # T ranks share the host's cores; each taking all of them would oversubscribe every collective.
        threads = threads or max(1, (os.cpu_count() or 1) // tp_size)
        torch.set_num_threads(threads)
        # Every rank is on this host: a free port, not a configured one (decode configs refuse master_port).
        port = free_port(_MASTER_ADDR)
        specs = [
            FollowerSpec(
                model=None if model is None else str(model),
                tp_rank=rank,
                tp_size=tp_size,
                dcp_size=dcp_size,
                master_port=port,
                device_kind=device_kind,
                dtype=dtype,
                block_size=block_size,
                num_blocks=num_blocks,
                timeout_s=timeout_s,
                threads=threads,
                log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            )
            for rank in range(tp_size)
        ]
        device = _device(specs[0])
        ctx = mp.get_context("spawn")
        followers, conns = [], []
        for spec in specs[1:]:
            parent, child = ctx.Pipe()
            process = ctx.Process(target=follower_main, args=(spec, child), daemon=True)
            process.start()
            child.close()
            followers.append(process)
            conns.append(parent)
        try:
            # A follower that died importing would leave the rendezvous waiting its whole timeout.
            _wait_for(followers, conns, "joining", _LOAD_TIMEOUT_S)
            groups, shard, dcp = _join(specs[0], device)
            leader = _shard_engine(specs[0], shard, dcp, device)
            _check_dcp_heads(leader.loaded.full_args, tp_size, dcp_size)
            _wait_for(followers, conns, "ready", _LOAD_TIMEOUT_S)
        except BaseException:
            _stop_processes(followers, grace_s=0)
            _destroy_group()
            raise
        finally:
            for conn in conns:
                conn.close()
        return cls(leader, groups, followers, leader.loaded.full_args, timeout_s)

    @property
    def follower_pids(self) -> list[int]:
        """Process ids of the follower ranks 1..T-1, in rank order."""
        return [process.pid for process in self._followers]

    # --- the surface the batch uses -------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self._leader.block_size

    @property
    def cache(self) -> PagedKVCache:
        """The leader's cache (every rank has as many blocks, holding its own K/V heads)."""
        return self._leader.cache

    @property
    def dcp_size(self) -> int:
        """Ranks of a DCP group, over which each sequence's tokens are split (1: no DCP)."""
        return self._leader.dcp_size

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks one rank needs for a sequence of `num_tokens` tokens (the leader's, the most)."""
        return self._leader.blocks_for(num_tokens)

    def kv_parts(self, num_tokens: int) -> list[KvPart]:
        """The K/V heads and token positions each rank stores of a `num_tokens` sequence, in rank order."""
        return [
            KvPart(rank, heads, dcp.owned_runs(num_tokens))
            for rank, (heads, dcp) in enumerate(zip(self._kv_heads, self._dcp_shards, strict=True))
        ]

    def adopt_sequence(self, seq_id: Hashable, kv: torch.Tensor, num_tokens: int) -> None:
        """Starts `seq_id` from a whole-model replica [layers, 2, num_tokens, n_kv_heads, head_dim]: each
        rank receives and stores only its own K/V heads (and with DCP, its own token blocks)."""
        layout = self.layout
        expected = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"KV replica has shape {tuple(kv.shape)}, this model expects {expected}")
        parts = []
        for heads, dcp in zip(self._kv_heads, self._dcp_shards, strict=True):
            part = kv[:, :, :, heads.start : heads.stop]
            if dcp.size > 1:
                part = part.index_select(2, dcp.owned_positions(num_tokens).to(kv.device))
            parts.append(part)
        self.adopt_parts(seq_id, parts, num_tokens)

    def adopt_parts(self, seq_id: Hashable, parts: Sequence[torch.Tensor], num_tokens: int) -> None:
        """Starts `seq_id` from a replica cut as `kv_parts(num_tokens)` says: parts[r] is [layers, 2,
        len(owned positions of rank r), len(kv_heads of rank r), head_dim] in the layout's dtype, tokens in
        position order. The leader keeps parts[0]; each follower is sent only its own part.

        ValueError on a wrong number of parts, shape or dtype, before anything reaches a follower.
        """
        layout = self.layout
        if len(parts) != self.tp_size:
            raise ValueError(f"got {len(parts)} KV parts, this engine has {self.tp_size} ranks")
        for part, want in zip(parts, self.kv_parts(num_tokens), strict=True):
            expected = (layout.num_layers, 2, want.num_tokens, len(want.kv_heads), layout.head_dim)
            if tuple(part.shape) != expected:
                raise ValueError(
                    f"KV part of TP rank {want.tp_rank} has shape {tuple(part.shape)}, expected {expected}"
                )
            if part.dtype != layout.torch_dtype:
                raise ValueError(f"KV part has dtype {part.dtype}, this model's cache holds {layout.dtype}")
        with self._lock:
            self._check_alive()
            if seq_id in self._numbers:
                raise ValueError(f"sequence {seq_id!r} already exists")
            number = self._next_number
            # The leader first: a part it refuses (no blocks) never reaches the followers.
            self._leader.adopt_sequence(number, parts[0], num_tokens)
            self._next_number += 1
            self._numbers[seq_id] = number
            with self._collective("adopt"):
                dist.broadcast(_header(_OP_ADOPT, number, num_tokens), src=0, group=self._control)
                for rank, part in enumerate(parts[1:], start=1):
                    dist.send(_as_bytes(part), dst=rank, group=self._control)

    def blocks_in_use(self) -> list[int]:
        """Every rank's allocated KV blocks, in rank order (asks the followers)."""
        with self._lock:
            self._check_alive()
            with self._collective("blocks in use"):
                dist.broadcast(_header(_OP_BLOCKS), src=0, group=self._control)
                return _gather_blocks_in_use(self._leader, self._control)

    @torch.inference_mode()
    def decode_step(self, seq_ids: Sequence[Hashable], token_ids: Sequence[int]) -> torch.Tensor:
        """Appends one token to each sequence on every rank; the logits [len(seq_ids), vocab]."""
        if len(seq_ids) != len(token_ids):
            raise ValueError(f"decode_step got {len(seq_ids)} sequences but {len(token_ids)} tokens")
        with self._lock:
            self._check_alive()
            unknown = [s for s in seq_ids if s not in self._numbers]
            if unknown:
                raise KeyError(f"unknown sequences {unknown}: adopt them first")
            numbers = [self._numbers[s] for s in seq_ids]
            step = torch.tensor([numbers, list(token_ids)], dtype=torch.long)
            with self._collective("decode step"):
                dist.broadcast(_header(_OP_DECODE, len(numbers)), src=0, group=self._control)
                dist.broadcast(step, src=0, group=self._control)
                return self._leader.decode_step(numbers, list(token_ids))

    def free(self, seq_id: Hashable) -> None:
        """Releases a sequence's blocks on every rank; unknown ids are ignored (as Engine.free does)."""
        with self._lock:
            number = self._numbers.pop(seq_id, None)
            if number is None:
                return
            self._leader.free(number)
            if self._failure or self._closed:
                return  # the followers are gone with their blocks
            with self._collective("free"):
                dist.broadcast(_header(_OP_FREE, number), src=0, group=self._control)

    def close(self) -> None:
        """Stops the followers (STOP, then a kill for any that does not exit) and leaves the group."""
        acquired = self._lock.acquire(timeout=self._timeout_s)
        try:
            if self._closed:
                return
            self._closed = True
            if acquired and not self._failure:
                try:
                    dist.broadcast(_header(_OP_STOP), src=0, group=self._control)
                except Exception as exc:  # a follower already gone: it is killed below
                    log.warning("could not send STOP to the decode TP ranks: %s", exc)
            _stop_processes(self._followers, grace_s=10)
            # the leader's shared-memory segments are unmapped now; the followers' went with their processes
            for group in (self._leader.loaded.shard.group, self._leader.dcp.group):
                if isinstance(group, HostGroup):
                    group.close()
            _destroy_group()
        finally:
            if acquired:
                self._lock.release()

    # --- failures ---------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        """Raises Unavailable when the group has failed, is closed, or a follower has exited."""
        if self._closed:
            raise Unavailable("the decode worker's tensor-parallel group is closed")
        dead = [rank for rank, p in enumerate(self._followers, start=1) if not p.is_alive()]
        if dead and not self._failure:
            codes = [self._followers[r - 1].exitcode for r in dead]
            self._failed(f"TP rank(s) {dead} exited (exit codes {codes})")
        if self._failure:
            raise Unavailable(f"the decode worker's tensor-parallel group failed: {self._failure}")

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Turns any failure of the commands and collectives inside it into Unavailable, and marks the
        group failed: after one failed collective the ranks no longer agree on where they are."""
        self._last_command = time.monotonic()
        try:
            yield
        except Unavailable:
            raise
        except Exception as exc:
            raise self._fail(what, exc) from exc

    def _fail(self, what: str, exc: BaseException) -> Unavailable:
        if not self._failure:
            self._failed(f"{what} failed: {type(exc).__name__}: {exc}")
        return Unavailable(f"the decode worker's tensor-parallel group failed: {self._failure}")

    def _failed(self, reason: str) -> None:
        self._failure = reason
        log.error("decode tensor-parallel group failed: %s", reason)
        if self.on_failure is not None:
            self.on_failure(reason)

    def _keep_alive(self) -> None:
        """Checks every second that the followers live, so one that dies while the batch is idle is noticed
        (and on_failure called) at once; sends a no-op when no command went out for a third of the timeout,
        so that a follower waiting for the next command does not time out."""
        interval = self._timeout_s / 3
        while not self._closed and not self._failure:
            time.sleep(min(interval, 1.0))
            with self._lock:
                if self._closed or self._failure:
                    return
                try:
                    self._check_alive()
                    if time.monotonic() - self._last_command >= interval:
                        with self._collective("keep-alive"):
                            dist.broadcast(_header(_OP_NOOP), src=0, group=self._control)
                except Exception:  # recorded in _failure; the next call raises it
                    return


def _check_dcp_heads(args: ModelArgs, tp_size: int, dcp_size: int) -> None:
    """Refuses a DCP size whose groups of consecutive TP ranks do not all hold the same K/V heads."""
    for first in range(0, tp_size, dcp_size):
        heads = {TensorParallelShard(r, tp_size).kv_head_range(args) for r in range(first, first + dcp_size)}
        if len(heads) > 1:
            raise ValueError(
                f"tensor_parallel_size={tp_size}, num_kv_heads={args.n_kv_heads}, decode_context_parallel_"
                f"size={dcp_size}: (tp // num_kv_heads) must be >= dcp and divisible by dcp"
            )


def _wait_for(followers: list[BaseProcess], conns: list[Connection], state: str, timeout_s: float) -> None:
    """Waits until every follower has reported `state`; Unavailable naming the first that failed."""
    deadline = time.monotonic() + timeout_s
    for rank, (process, conn) in enumerate(zip(followers, conns, strict=True), start=1):
        while not conn.poll(0.2):
            if not process.is_alive():
                code = process.exitcode
                raise Unavailable(f"decode TP rank {rank} exited while starting (exit code {code})")
            if time.monotonic() > deadline:
                raise Unavailable(f"decode TP rank {rank} did not report {state!r} in {timeout_s:.0f} s")
        try:
            message = conn.recv()
        except EOFError:
            message = f"TP rank {rank} exited while starting"
        if message != state:
            raise Unavailable(f"decode {message}")


def _stop_processes(processes: list[BaseProcess], grace_s: float) -> None:
    """Waits up to grace_s for each process to exit, then kills the rest."""
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(5)


def _destroy_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a group broken by a dead rank may refuse; the process goes on
            log.warning("could not destroy the decode TP process group: %s", exc)
