"""One rank process of a set (TP rank `tp_rank` of PCP rank `pcp_rank`): joins the set's process groups,
loads its TP shard of the model on its own device and runs prefill steps.

Global rank 0 takes jobs from its node (the supervisor process) over a pipe and hands each one to every
rank through the process group itself (a broadcast of a header, then the job's own encoding), so ranks
never talk over a side channel. The other ranks wait in that broadcast. While idle, rank 0 sends an idle
tick every `idle_tick_s`, which keeps the group's collective timeout from firing and proves to each rank's
node that the group is making progress (the heartbeat of a headless rank is that progress, never a fake
inference request). Control messages (the header, the job, the rank shares) travel as CPU tensors over the
gloo `control` group (engine.parallel.ParallelGroups), so NCCL/HCCL never see host tensors; the model's
collectives (the TP all-reduces, the PCP K/V all-gather) run on the device.

After the forward every PCP rank holds the whole prompt's K/V, spread over its TP group by K/V head. The
TP group of the PCP rank picked by `replica_owner` stores it: each TP rank named by the job's shards
pushes its heads as one store object. Every rank then frees its blocks, and one all-gather of `RankShare`s
brings the first token (sampled by TP rank 0 of the PCP rank holding the last position; the LM head is
replicated, so every TP rank there has the full logits) and the push results back to rank 0. A failure
that belongs to one request (its sampling, a push) travels in the shares: every rank still takes part in
the all-gather, so the group stays in step and the set serves the next job.

A rank's cache holds `kv_cache_tokens` (the servicer refuses a longer prompt before the job reaches the
set); a prompt above `prefill_chunk_tokens` runs in chunks (context_parallel.prefill_chunked).

Prefix reuse: when the job carries a cached prefix, every rank reads the prefix of its own K/V heads from
the store (ranged reads through the job's prefix lease, from the runs of the stored shard holding those
heads: with TP > 1 and GQA several TP ranks hold one head, stored once by the first of them) and adopts
it, and one all-reduce over the control group makes the ranks agree: all of them loaded it, or none uses
it and the whole prompt is computed (a cache is never worth a wrong or stuck set). Then only the tokens
after the prefix are split and computed, and the owner's TP ranks push only those, each shard offering
its full blocks under its own block keys.

Batched prefill: rank 0 may hand the set several jobs at once (the node takes the waiting jobs that fit,
prefill.batch.jobs_in_batch). They travel in one broadcast, every rank prefills them in one forward
(prefill.batch.prefill_batch: each split by DualChunkSwap, each attending only to itself), then samples,
pushes and reports per job, so each job gets its own outcome; one job alone runs exactly as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from opentelemetry import trace
from opentelemetry.propagate import extract

from pcpstack.common.errors import Internal, ServiceError, Unavailable
from pcpstack.common.lifetime import exit_with_spawning_process
from pcpstack.common.logs import setup_logging
from pcpstack.common.telemetry import setup_telemetry, shutdown_telemetry, tracer
from pcpstack.engine.device import device_for_rank
from pcpstack.engine.engine import DEFAULT_CACHE_TOKENS, Engine, SequenceState
from pcpstack.engine.host_group import HostGroup
from pcpstack.engine.kv_cache import KvLayout, blocks_needed
from pcpstack.engine.parallel import ParallelGroups, ParallelLayout, TensorParallelShard, init_parallel_groups
from pcpstack.engine.sampling import (
    TokenHistory,
    TokenLogprobs,
    make_generator,
    raw_logprobs,
    sample,
    stop_token_set,
    token_logprobs,
)
from pcpstack.engine.weights import load_model
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.errors import StoreStalled
from pcpstack.kvstore.prefix import PREFIX_BLOCK_TOKENS, segment_range
from pcpstack.kvstore.ranges import ByteRange
from pcpstack.kvstore.shm import reusable_for
from pcpstack.prefill.batch import BatchSplit, pack_jobs, prefill_batch, unpack_jobs
from pcpstack.prefill.context_parallel import (
    KvAllGather,
    chunk_bounds,
    configure_gloo_interface,
    pcp_exchange_group,
    prefill_chunked,
)
from pcpstack.prefill.job import (
    CachedPrefix,
    PrefillJob,
    PrefillOutcome,
    RankShare,
    ReplicaShard,
    shard_holding,
)
from pcpstack.prefill.replica import replica_owner
from pcpstack.prefill.split import DualChunkSplit

log = logging.getLogger(__name__)
_tracer = tracer(__name__)
T = TypeVar("T")

OP_IDLE, OP_PREFILL, OP_STOP = 0, 1, 2
# A store's refusal of one replica: a fresh channel would be refused the same way.
_REFUSALS = {
    "INVALID_ARGUMENT",
    "ALREADY_EXISTS",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "PERMISSION_DENIED",
}


def _header(op: int, payload_bytes: int = 0) -> torch.Tensor:
    """The first broadcast of every round: the op and the size of the job that follows."""
    return torch.tensor([op, payload_bytes], dtype=torch.long)


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to start."""

    model: str | None
    # This rank in the set's world of tp_size x pcp_size (engine.parallel.ParallelLayout numbering).
    global_rank: int
    pcp_size: int
    master_addr: str
    master_port: int
    block_size: int
    advertised_host: str
    tp_size: int = 1
    # cpu, cuda or npu ("" = what is present), and this process's index among its node's ranks (its device).
    device: str = ""
    local_index: int = 0
    threads: int = 1
    collective_timeout_s: float = 120.0
    idle_tick_s: float = 1.0
    # The node's --log-level: a spawned process starts without the parent's logging set-up.
    log_level: str = "INFO"
    # Tokens of K/V this rank's cache holds (--kv-cache-tokens): a whole prompt, since every rank keeps a
    # complete replica.
    kv_cache_tokens: int = DEFAULT_CACHE_TOKENS
    # Longest chunk one forward runs (--prefill-chunk-tokens); 0: the whole prompt in one forward.
    prefill_chunk_tokens: int = 0

    @property
    def layout(self) -> ParallelLayout:
        """The set's shape."""
        return ParallelLayout(self.tp_size, self.pcp_size)

    @property
    def pcp_rank(self) -> int:
        """Which DualChunkSwap share this rank runs."""
        return self.layout.coordinates(self.global_rank)[0]

    @property
    def tp_rank(self) -> int:
        """Which heads and intermediate slice this rank holds."""
        return self.layout.coordinates(self.global_rank)[1]


@dataclass(frozen=True)
class RankReady:
    """Sent once the rank has its model loaded and has joined the group."""

    global_rank: int
    # The replica fingerprint: the WHOLE model's KV layout, whatever TP shard this rank holds.
    fingerprint: str
    vocab_size: int
    max_seq_len: int


def repeating_push(before: tuple[str, int] | None, last: tuple[str, int] | None) -> tuple[str, int] | None:
    """The standby (store address, bytes) to ready after two forwards whose pushes would have been `before`
    and `last` ((store, bytes), None: none): one that holds either size, when both go to one store and
    their sizes are within a standby's slack of each other (shm.reusable_for); else None."""
    if before is None or last is None or before[0] != last[0]:
        return None
    small, large = sorted((before[1], last[1]))
    return (last[0], large) if small > 0 and reusable_for(large, small) else None


class ReplicaPusher:
    """Pushes KV replicas to a KV store from this (synchronous) rank process, and reads cached prefixes.

    The pusher's event loop runs only while a push does, so whatever a push leaves behind in it (a gRPC
    task of a call the store ended early) is finished before the push returns: left pending in a loop that
    does not run, it would be destroyed pending. A store's refusal is raised at once; only a broken channel
    (a restarted store) is worth one retry on a fresh one.
    """

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._clients: dict[str, KvStoreClient] = {}

    def push(
        self,
        address: str,
        key: str,
        fingerprint: str,
        data: list[memoryview],
        lease_ms: int,
        block_keys: tuple[str, ...] = (),
        block_tokens: int = 0,
    ) -> str:
        """Stores one replica (offering the full blocks block_keys name) and returns its read capability;
        raises the store's error."""
        try:
            return self._run(self._push(address, key, fingerprint, data, lease_ms, block_keys, block_tokens))
        except Exception as exc:
            if getattr(exc, "code", "") in _REFUSALS or isinstance(exc, StoreStalled):
                raise  # refused, or frozen: a new channel would be refused or wait the same
            # A store that restarted leaves the cached channel broken: retry once on a fresh channel.
            log.warning("KV push to %s failed (%s); retrying on a new channel", address, exc)
            stale = self._clients.pop(address, None)
            if stale is not None:
                self._run(stale.close())
            return self._run(self._push(address, key, fingerprint, data, lease_ms, block_keys, block_tokens))

    def prepare(self, address: str, size: int) -> None:
        """Tells the store the size of this rank's next push before the forward that produces it, so that
        a standby segment of that size is readied and mapped meanwhile (KvStoreClient.prepare_put). A hint:
        whatever goes wrong is logged, and the push still works without it."""
        try:
            self._run(self._prepare(address, size))
        except Exception as exc:
            log.info("no standby prepared at %s for a push of %d bytes: %s", address, size, exc)

    async def _prepare(self, address: str, size: int) -> None:
        await self._client(address).prepare_put(size)

    def fetch(
        self, address: str, key: str, fingerprint: str, lease: CachedPrefix, ranges: list[ByteRange]
    ) -> memoryview:
        """The selected bytes of one object a prefix lease pins; raises the store's error."""
        return self._run(self._fetch(address, key, fingerprint, lease, ranges))

    async def _fetch(
        self, address: str, key: str, fingerprint: str, lease: CachedPrefix, ranges: list[ByteRange]
    ) -> memoryview:
        data, _ = await self._client(address).get(
            key, fingerprint, lease.capability, ranges=ranges, lease_id=lease.lease_id
        )
        return data

    def _client(self, address: str) -> KvStoreClient:
        if address not in self._clients:  # created inside the loop its channel belongs to
            self._clients[address] = KvStoreClient(address)
        return self._clients[address]

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        try:
            return self._loop.run_until_complete(coroutine)
        finally:
            self._settle()

    def _settle(self) -> None:
        leftovers = [task for task in asyncio.all_tasks(self._loop) if not task.done()]
        for task in leftovers:
            task.cancel()
        if leftovers:
            self._loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))

    async def _push(
        self,
        address: str,
        key: str,
        fingerprint: str,
        data: list[memoryview],
        lease_ms: int,
        block_keys: tuple[str, ...],
        block_tokens: int,
    ) -> str:
        committed = await self._client(address).put(
            key, fingerprint, data, lease_ms=lease_ms, block_keys=block_keys, block_tokens=block_tokens
        )
        return committed.capability


class RankWorker:
    """The state of one rank between jobs: its engine, its place in the set's groups, and its KV pusher."""

    def __init__(
        self,
        spec: RankSpec,
        engine: Engine,
        groups: ParallelGroups,
        fingerprint: str,
        on_progress: Callable[[], None],
        exchange_group: dist.ProcessGroup | HostGroup,
    ) -> None:
        """fingerprint: the replica fingerprint (the whole model's KV layout, not this shard's);
        exchange_group: what the K/V all-gather runs over (context_parallel.pcp_exchange_group)."""
        self.spec = spec
        self.engine = engine
        self.groups = groups
        self.exchange_group = exchange_group
        self.on_progress = on_progress
        self.fingerprint = fingerprint
        # The K/V heads (of the whole model) this rank computes with: a cached prefix loads these.
        self.kv_heads = TensorParallelShard(spec.tp_rank, spec.tp_size).kv_head_range(engine.loaded.full_args)
        self.pusher = ReplicaPusher()
        # Per forward, the push this rank would make of its first job were it the job's owner: (store
        # address, bytes), None where its TP rank pushes no shard; the forward before and the last one.
        self._push_sizes: list[tuple[str, int] | None] = [None, None]

    def step(self, jobs: list[PrefillJob] | None) -> tuple[int, list[PrefillOutcome] | None]:
        """One round of the set: rank 0 passes its jobs, run in one forward (None: idle tick). Returns (op,
        rank 0's outcomes, one per job in order)."""
        control = self.groups.control
        payload = None
        header = _header(OP_IDLE)
        if self.spec.global_rank == 0 and jobs:
            payload = pack_jobs(jobs)
            header = _header(OP_PREFILL, payload.numel())
        dist.broadcast(header, src=0, group=control)
        op, payload_bytes = header.tolist()
        if op != OP_PREFILL:
            return op, None
        if payload is None:
            payload = torch.empty(payload_bytes, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=control)
        return op, self._prefill(jobs if jobs else unpack_jobs(payload))

    def _prefill(self, jobs: list[PrefillJob]) -> list[PrefillOutcome] | None:
        spec = self.spec
        owners = [replica_owner(job.request_id, spec.pcp_size) for job in jobs]
        # One span per job, in its own request's trace, around the forward the jobs share.
        spans = [_tracer.start_span("prefill.rank", context=extract(job.trace_context)) for job in jobs]
        try:
            for span, job, owner in zip(spans, jobs, owners, strict=True):
                span.set_attribute("pcpstack.pcp_rank", spec.pcp_rank)
                span.set_attribute("pcpstack.tp_rank", spec.tp_rank)
                span.set_attribute("pcpstack.replica_owner", owner == spec.pcp_rank)
                chunks = chunk_bounds(len(job.token_ids), spec.prefill_chunk_tokens)
                span.set_attribute("pcpstack.prefill_chunks", len(chunks))
                span.set_attribute("pcpstack.prefill_batch", len(jobs))
            cpu_started = time.process_time()
            shares = self._run(jobs, owners, spans)
            # This process's CPU time over the same work: below forward + push, the rank waited for a core.
            cpu_us = int((time.process_time() - cpu_started) * 1e6)
            for span, share in zip(spans, shares, strict=True):
                # The phases of the rank's span, so a trace splits TTFT into forward and KV push (bench e2e).
                span.set_attribute("pcpstack.forward_us", share.forward_us)
                span.set_attribute("pcpstack.push_us", share.push_us)
                span.set_attribute("pcpstack.cpu_us", cpu_us)
        finally:
            for span in spans:
                span.end()
        size = RankShare.SIZE
        gathered = [torch.empty(size * len(jobs), dtype=torch.uint8) for _ in range(spec.layout.world_size)]
        dist.all_gather(gathered, torch.cat([s.to_tensor() for s in shares]), group=self.groups.control)
        if spec.global_rank != 0:
            return None
        return [
            PrefillOutcome.combine(
                job,
                owner,
                [RankShare.from_tensor(g[i * size : (i + 1) * size]) for g in gathered],
                spec.tp_size,
            )
            for i, (job, owner) in enumerate(zip(jobs, owners, strict=True))
        ]

    def _run(self, jobs: list[PrefillJob], owners: list[int], spans: list[trace.Span]) -> list[RankShare]:
        """This rank's part of its jobs: their forward shares in one forward, then per job the first token
        and its shard's push (`_finish`). A failure inside the forward's collectives is the set's and
        propagates."""
        engine = self.engine
        try:
            started = time.perf_counter()
            cached = []
            for job, span in zip(jobs, spans, strict=True):
                with trace.use_span(span):
                    # The sequence is the job's kv_key: unique per attempt, whatever the request id.
                    loading = time.perf_counter()
                    cached.append(self._adopt_prefix(job, job.kv_key))
                    # part of forward_us: reading the cached prefix from the store and loading it
                    span.set_attribute("pcpstack.prefix_load_us", int((time.perf_counter() - loading) * 1e6))
            states = [engine.reserve(job.kv_key, len(job.token_ids)) for job in jobs]
            self._announce_push(jobs, owners, cached)
            logits = self._forward(jobs, states, cached)
            forward_us = int((time.perf_counter() - started) * 1e6)
            shares = []
            for job, owner, span, job_logits, held in zip(jobs, owners, spans, logits, cached, strict=True):
                with trace.use_span(span):
                    shares.append(self._finish(job, owner, job_logits, forward_us, held))
            return shares
        finally:
            # Only the selected replicas live on (in the store); every rank frees its copies at once.
            for job in jobs:
                engine.free(job.kv_key)

    def _forward(
        self, jobs: list[PrefillJob], states: list[SequenceState], cached: list[int]
    ) -> list[torch.Tensor | None]:
        """Each job's logits after its prompt on the rank computing its last token (None elsewhere): one job
        alone in chunks as configured, several in one batched forward."""
        spec, engine = self.spec, self.engine
        tokens = [
            torch.tensor(job.token_ids[held:], dtype=torch.long)
            for job, held in zip(jobs, cached, strict=True)
        ]
        if len(jobs) == 1:

            def exchange_for(split: DualChunkSplit) -> KvAllGather:
                return KvAllGather(split, group=self.exchange_group, on_progress=self.on_progress)

            return [
                prefill_chunked(
                    engine,
                    states[0],
                    tokens[0],
                    spec.pcp_rank,
                    spec.pcp_size,
                    spec.prefill_chunk_tokens,
                    exchange_for,
                    start=cached[0],
                )
            ]
        split = BatchSplit(tuple(len(t) for t in tokens), spec.pcp_size)
        exchange = KvAllGather(split, group=self.exchange_group, on_progress=self.on_progress)
        return prefill_batch(engine, states, tokens, split, spec.pcp_rank, exchange, cached)

    def _finish(
        self, job: PrefillJob, owner: int, logits: torch.Tensor | None, forward_us: int, cached: int
    ) -> RankShare:
        """One job after the forward: the first token (on TP rank 0 of the PCP rank holding the last
        position) and its shard's push (on the owner's TP ranks the job's shards name). A failure of
        sampling or of the push is returned, not raised, so this rank still joins the all-gather."""
        spec, engine = self.spec, self.engine
        first_token = -1
        first_logprobs = None
        if logits is not None and spec.tp_rank == 0:
            try:
                params = job.sampling
                # The first token sees the whole prompt (repetition penalty) and no output yet.
                stops = stop_token_set(params, engine.args.eos_token_ids)
                history = TokenHistory(job.token_ids, (), stops)
                first_token = sample(logits, params, make_generator(params.seed), history)
                if params.logprobs is not None:
                    first_logprobs = token_logprobs(raw_logprobs(logits), first_token, params.logprobs)
            except Exception as exc:  # a bug in one request's sampling must not break the group
                log.exception("rank %d could not sample request %s", spec.global_rank, job.request_id)
                error = f"sampling the first token failed: {type(exc).__name__}: {exc}"
                return RankShare(forward_us=forward_us, error_code=Internal.code, error=error)
        shard = self._shard_to_push(job, owner)
        if shard is None:
            return RankShare(
                first_token_id=first_token,
                forward_us=forward_us,
                first_token_logprobs=first_logprobs,
                cached_tokens=cached,
            )
        return self._push(job, shard, first_token, forward_us, first_logprobs, cached)

    def _shard_to_push(self, job: PrefillJob, owner: int) -> ReplicaShard | None:
        """The shard of the job's replica this rank pushes: on the owner's TP ranks the job's shards name."""
        return self._tp_shard(job) if self.spec.pcp_rank == owner else None

    def _tp_shard(self, job: PrefillJob) -> ReplicaShard | None:
        """The shard of the job's replica this rank's TP rank stores when its PCP rank owns the job."""
        mine = [s for s in job.stored_shards(self.fingerprint) if s.tp_rank == self.spec.tp_rank]
        return mine[0] if mine else None

    def _announce_push(self, jobs: list[PrefillJob], owners: list[int], cached: list[int]) -> None:
        """Before the forward: the size of this rank's first push of it, to its store (ReplicaPusher.prepare),
        which readies a segment of that size while the forward runs unless this rank holds one that fits
        already (keep_standby). Its shard holds the tokens after the cached prefix, every layer's K and V
        of this rank's K/V heads."""
        self._push_sizes = [self._push_sizes[-1], self._push_size(jobs[0], cached[0])]
        for job, owner, held in zip(jobs, owners, cached, strict=True):
            if self.spec.pcp_rank != owner:
                continue
            push = self._push_size(job, held)
            if push is not None:
                self.pusher.prepare(*push)
                return

    def _push_size(self, job: PrefillJob, held: int) -> tuple[str, int] | None:
        """(store address, bytes) of the shard of `job` this rank pushes when its PCP rank owns the job,
        `held` tokens of it cached; None when its TP rank pushes none (a K/V head another one stores)."""
        if self._tp_shard(job) is None:
            return None
        planes, row = self._kv_planes_and_row_bytes()
        return job.kvstore_address, planes * (len(job.token_ids) - held) * row

    def keep_standby(self) -> None:
        """After a forward, its outcomes sent: when its push size repeats the forward's before it (within a
        standby's slack, shm.reusable_for), tells the store that this rank's next push will be that size,
        whether or not it pushed this time, so the store readies a standby for it now, between requests.

        Which PCP rank pushes a request's replica follows from its id (replica_owner), so each rank of a
        set pushes some requests and skips others; a standby readied only after the rank's own push (the
        client's rule) leaves every rank its first push or two of a new size to prepare during that
        forward, which on a host whose cores the ranks fill comes out of the ranks' time. bench e2e's
        served test, PCP=2 on 2 cores, two runs each side interleaved: the store's CPU a request 0.34-0.43
        -> 0.07-0.09 s at 2,048 tokens and 0.80-0.83 -> 0.13-0.18 s at 4,096; the whole path over the raw
        ranks at 2,048 (paired) 7.3-10.7 -> 1.9-3.7 %. A size that does not repeat readies nothing here: a
        standby for it would likely not fit the next one."""
        standby = repeating_push(*self._push_sizes)
        if standby is not None:
            self.pusher.prepare(*standby)

    def _kv_planes_and_row_bytes(self) -> tuple[int, int]:
        """(K and V planes of all layers, bytes of one token's row of this rank's K/V heads in one plane):
        a replica shard of n tokens is planes * n * row bytes, plane after plane."""
        layout = self.engine.layout
        itemsize = torch.empty(0, dtype=layout.torch_dtype).element_size()
        return layout.num_layers * 2, layout.num_kv_heads * layout.head_dim * itemsize

    def _adopt_prefix(self, job: PrefillJob, seq_id: str) -> int:
        """Starts seq_id from the job's cached prefix when every rank could read it; returns the tokens
        adopted (0: none, the whole prompt is computed). Every rank takes part in the agreement."""
        prefix = job.prefix
        if prefix is None:
            return 0
        kv = None
        try:
            kv = self._read_prefix(job, prefix)
        except Exception as exc:  # the store lost it, or a run does not fit: compute instead
            log.warning(
                "rank %d could not load the cached prefix of %s: %s", self.spec.global_rank, job.kv_key, exc
            )
        loaded = torch.tensor([0 if kv is None else 1], dtype=torch.long)
        dist.all_reduce(loaded, op=dist.ReduceOp.MIN, group=self.groups.control)
        if not loaded.item():
            return 0
        self.engine.adopt_sequence(seq_id, kv, prefix.tokens)
        return prefix.tokens

    def _read_prefix(self, job: PrefillJob, prefix: CachedPrefix) -> list[torch.Tensor]:
        """The prefix's K/V of this rank's heads as one piece [layers, 2, run tokens, kv_heads, head_dim]
        per run of the shard storing them, in order (one ranged read each; the engine writes them into its
        cache one by one: joining them first cost a third of the prefix's load)."""
        layout = self.engine.layout
        shards = job.stored_shards(self.fingerprint)
        index = shard_holding(shards, self.kv_heads)
        fingerprint = shards[index].fingerprint or self.fingerprint
        planes, row = self._kv_planes_and_row_bytes()
        pieces = []
        for run in prefix.runs_of(index):
            ranges = [segment_range(run.object_bytes, planes, row, run.token_start, run.token_count)]
            data = self.pusher.fetch(job.kvstore_address, run.key, fingerprint, prefix, ranges)
            raw = torch.frombuffer(data, dtype=torch.uint8).view(layout.torch_dtype)
            shape = (layout.num_layers, 2, run.token_count, layout.num_kv_heads, layout.head_dim)
            pieces.append(raw.view(shape).to(self.engine.device))
        held = sum(piece.shape[2] for piece in pieces)
        if held != prefix.tokens:
            raise ValueError(f"the prefix's runs hold {held} tokens, not {prefix.tokens}")
        return pieces

    def _push(
        self,
        job: PrefillJob,
        shard: ReplicaShard,
        first_token: int,
        forward_us: int,
        first_logprobs: TokenLogprobs | None = None,
        cached: int = 0,
    ) -> RankShare:
        started = time.perf_counter()
        try:
            # [layers, 2, tokens, this rank's K/V heads, head_dim]: exactly the shard's heads (a rank holding
            # a replicated head pushes it only when the shard names this rank); only the tokens after a
            # cached prefix, which the store holds already.
            block_size = PREFIX_BLOCK_TOKENS
            held_heads = self.engine.layout.num_kv_heads
            if shard.kv_head_end and held_heads != shard.kv_head_end - shard.kv_head_start:
                raise Internal(
                    f"rank {self.spec.global_rank} holds {held_heads} K/V heads but its shard is heads "
                    f"{shard.kv_head_start}-{shard.kv_head_end}"
                )
            if self.engine.device.type == "cpu":
                # Straight from the cache's blocks, in the replica's byte order: no staging copy (a replica of
                # 4,096 SmolLM2 tokens is 189 MB; gathering it took ~150 ms before the store saw a byte).
                data = [
                    memoryview(piece.view(torch.uint8).numpy()).cast("B")
                    for piece in self.engine.export_pieces(job.kv_key, cached)
                ]
            else:
                # One staging copy off the device in the cache's dtype; uint8 bytes, as numpy has no bf16.
                local = self.engine.export_sequence(job.kv_key)[:, :, cached:]
                data = [memoryview(local.contiguous().cpu().reshape(-1).view(torch.uint8).numpy())]
            total_bytes = sum(piece.nbytes for piece in data)
            # The cached prefix is whole prefix blocks: the replica's blocks are the prompt's from cached on.
            offered = shard.block_keys[cached // block_size :] if cached % block_size == 0 else ()
            capability = self.pusher.push(
                job.kvstore_address,
                shard.key,
                shard.fingerprint or self.fingerprint,
                data,
                job.lease_ms,
                block_keys=offered,
                block_tokens=block_size if offered else 0,
            )
        except Exception as exc:  # the store's error travels to rank 0, which answers the caller with it
            code = exc.code if isinstance(exc, ServiceError) else Unavailable.code
            message = (
                f"rank {self.spec.global_rank} could not push its KV replica (K/V heads "
                f"{shard.kv_head_start}-{shard.kv_head_end}) to {job.kvstore_address}: {exc}"
            )
            log.warning(message)
            return RankShare(
                first_token, forward_us=forward_us, error_code=code, error=message, cached_tokens=cached
            )
        return RankShare(
            first_token_id=first_token,
            first_token_logprobs=first_logprobs,
            total_bytes=total_bytes,
            forward_us=forward_us,
            push_us=int((time.perf_counter() - started) * 1e6),
            capability=capability,
            cached_tokens=cached,
        )


def _use_device(device: torch.device) -> None:
    """Makes `device` this process's current accelerator, as NCCL/HCCL expect of a rank."""
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device)


def _keep_running_stamp(running: Synchronized, every_s: float) -> None:
    """Writes the time into running every every_s, from a thread of its own: it stops only when the whole
    process does (stopped, frozen), never because the rank computes or waits in a collective."""
    while True:
        running.value = time.time()
        time.sleep(every_s)


def rank_main(spec: RankSpec, conn: Connection, progress: Synchronized, running: Synchronized) -> None:
    """Entry point of a rank process (a multiprocessing target); exits on stop or when the group fails.
    progress: the time of the group's last step, or of the forward's last layer; running: the time this
    process last ran at all (_keep_running_stamp). The node's watchdog reads both (node.check_progress)."""
    threading.Thread(
        target=_keep_running_stamp, args=(running, spec.idle_tick_s), name="running-stamp", daemon=True
    ).start()
    torch.set_num_threads(spec.threads)
    setup_logging(f"prefill-rank-{spec.global_rank}", spec.log_level)
    exit_with_spawning_process(f"prefill rank {spec.global_rank}")
    setup_telemetry("prefill-rank")
    try:
        device = device_for_rank(spec.local_index, spec.device or None)
        _use_device(device)
        configure_gloo_interface(spec.advertised_host)
        groups = init_parallel_groups(
            spec.layout,
            spec.global_rank,
            spec.master_addr,
            spec.master_port,
            device,
            spec.collective_timeout_s,
        )
        loaded = load_model(spec.model, device, shard=groups.shard(), prefill=True)
        num_blocks = blocks_needed(spec.kv_cache_tokens, spec.block_size)
        engine = Engine(loaded, block_size=spec.block_size, num_blocks=num_blocks)
        fingerprint = KvLayout.for_model(
            loaded.model_id, loaded.full_args, loaded.dtype, spec.block_size
        ).fingerprint()
        # The longest forward: a whole prompt the cache holds, or a chunk of one.
        longest = min(spec.kv_cache_tokens, spec.prefill_chunk_tokens or spec.kv_cache_tokens)
        kv_row_bytes = loaded.args.n_kv_heads * loaded.args.head_dim * loaded.dtype.itemsize
        exchange_group = pcp_exchange_group(
            groups, device, longest, kv_row_bytes, str(spec.master_port), spec.collective_timeout_s
        )
        worker = RankWorker(
            spec,
            engine,
            groups,
            fingerprint,
            on_progress=lambda: setattr(progress, "value", time.time()),
            exchange_group=exchange_group,
        )
        args = loaded.full_args
        conn.send(RankReady(spec.global_rank, fingerprint, args.vocab_size, args.max_seq_len))
        progress.value = time.time()
        while True:
            jobs = None
            if spec.global_rank == 0 and conn.poll(spec.idle_tick_s):
                jobs = conn.recv()  # the jobs of one forward
                if jobs is None:  # the node asks the set to stop
                    dist.broadcast(_header(OP_STOP), src=0, group=groups.control)
                    break
            op, outcomes = worker.step(jobs)
            progress.value = time.time()
            if outcomes is not None:
                conn.send(outcomes)
            if op == OP_PREFILL:
                worker.keep_standby()  # with the replies on their way
            if op == OP_STOP:
                break
    except Exception as exc:
        log.exception("rank %d failed", spec.global_rank)
        try:
            conn.send(f"rank {spec.global_rank} failed: {type(exc).__name__}: {exc}")
        finally:
            shutdown_telemetry()
            # Not sys.exit: a broken process group can hang in its destructor.
            os._exit(1)
    shutdown_telemetry()
    os._exit(0)
