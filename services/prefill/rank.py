"""One PCP rank process: loads the model, joins its set's process group and runs prefill steps.

Global rank 0 takes jobs from its node (the supervisor process) over a pipe and hands each one to every
rank through the process group itself (a broadcast of a header, the tokens and a small JSON payload), so
ranks never talk over a side channel. The other ranks wait in that broadcast. While idle, rank 0 sends an
idle tick every `idle_tick_s`, which keeps the group's collective timeout from firing and proves to each
rank's node that the group is making progress (the heartbeat of a headless rank is that progress, never
a fake inference request).

After the forward every rank holds the whole prompt's K/V. The rank picked by `replica_owner` pushes its
replica to the KV store; every rank then frees its blocks, and one all-gather brings the first token and
the push result back to rank 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized

import torch
import torch.distributed as dist
from opentelemetry.propagate import extract

from pcpstack.common.telemetry import setup_telemetry, shutdown_telemetry, tracer
from pcpstack.engine.engine import Engine
from pcpstack.engine.sampling import SamplingParams, make_generator, sample
from pcpstack.kvstore.client import KvStoreClient, make_key
from pcpstack.prefill.context_parallel import (
    KvAllGather,
    configure_gloo_interface,
    init_pcp_group,
    prefill_share,
)
from pcpstack.prefill.replica import replica_owner
from pcpstack.prefill.split import DualChunkSplit

log = logging.getLogger(__name__)
_tracer = tracer(__name__)

OP_IDLE, OP_PREFILL, OP_STOP = 0, 1, 2
_HEADER = 4  # int64: op, num_tokens, payload bytes, reserved
_RESULT = struct.Struct("<qqqqq")  # first token (-1: not the owner), push failed, bytes, forward us, push us
_RESULT_BYTES = 512  # the result struct, then an error message (utf-8, zero padded)


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to start."""

    model: str | None
    pcp_rank: int
    pcp_size: int
    master_addr: str
    master_port: int
    block_size: int
    advertised_host: str
    threads: int = 1
    collective_timeout_s: float = 120.0
    idle_tick_s: float = 1.0


@dataclass(frozen=True)
class PrefillJob:
    """One prompt handed by the node to rank 0."""

    request_id: str
    token_ids: list[int]
    sampling: dict
    kvstore_address: str
    lease_ms: int
    # W3C trace context of the caller's span, so every rank's work joins the request's trace.
    trace_context: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefillOutcome:
    """What rank 0 reports back to its node for one job."""

    request_id: str
    first_token_id: int
    replica_rank: int
    total_bytes: int
    forward_seconds: float
    push_seconds: float
    error: str = ""


@dataclass(frozen=True)
class RankReady:
    """Sent once the rank has its model loaded and has joined the group."""

    pcp_rank: int
    fingerprint: str
    layout: dict
    vocab_size: int
    max_seq_len: int


class ReplicaPusher:
    """Pushes KV replicas to a KV store from this (synchronous) rank process."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._clients: dict[str, KvStoreClient] = {}

    def push(
        self, address: str, key: str, fingerprint: str, data: memoryview, lease_ms: int, metadata: bytes
    ) -> None:
        """Stores one replica; raises the store's error."""
        try:
            self._loop.run_until_complete(self._push(address, key, fingerprint, data, lease_ms, metadata))
        except Exception as exc:
            # A store that restarted leaves the cached channel broken: retry once on a fresh channel.
            log.warning("KV push to %s failed (%s); retrying on a new channel", address, exc)
            stale = self._clients.pop(address, None)
            if stale is not None:
                self._loop.run_until_complete(stale.close())
            self._loop.run_until_complete(self._push(address, key, fingerprint, data, lease_ms, metadata))

    async def _push(
        self, address: str, key: str, fingerprint: str, data: memoryview, lease_ms: int, metadata: bytes
    ) -> None:
        if address not in self._clients:  # created inside the loop its channel belongs to
            self._clients[address] = KvStoreClient(address)
        await self._clients[address].put(key, fingerprint, data, lease_ms=lease_ms, metadata=metadata)


class RankWorker:
    """The state of one rank between jobs: its engine, its place in the group, and its KV pusher."""

    def __init__(self, spec: RankSpec, engine: Engine, on_progress: Callable[[], None]) -> None:
        self.spec = spec
        self.engine = engine
        self.on_progress = on_progress
        self.fingerprint = engine.layout.fingerprint()
        self.pusher = ReplicaPusher()

    def step(self, job: PrefillJob | None) -> tuple[int, PrefillOutcome | None]:
        """One round of the group: rank 0 passes its job (None: idle tick). Returns (op, rank 0's outcome)."""
        header = torch.zeros(_HEADER, dtype=torch.long)
        payload = b""
        if self.spec.pcp_rank == 0:
            if job is None:
                header[0] = OP_IDLE
            else:
                payload = json.dumps(
                    {k: v for k, v in asdict(job).items() if k != "token_ids"}, separators=(",", ":")
                ).encode()
                header[:3] = torch.tensor([OP_PREFILL, len(job.token_ids), len(payload)])
        dist.broadcast(header, src=0)
        op, num_tokens, payload_len = (int(x) for x in header[:3])
        if op != OP_PREFILL:
            return op, None
        tokens = (
            torch.tensor(job.token_ids, dtype=torch.long)
            if job
            else torch.empty(num_tokens, dtype=torch.long)
        )
        blob = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if job
            else torch.empty(payload_len, dtype=torch.uint8)
        )
        dist.broadcast(tokens, src=0)
        dist.broadcast(blob, src=0)
        request = json.loads(bytes(blob.tolist()).decode()) if job is None else asdict(job)
        return op, self._prefill(tokens, request)

    def _prefill(self, tokens: torch.Tensor, request: dict) -> PrefillOutcome | None:
        spec = self.spec
        split = DualChunkSplit(len(tokens), spec.pcp_size)
        owner = replica_owner(request["request_id"], spec.pcp_size)
        with _tracer.start_as_current_span(
            "prefill.rank", context=extract(request.get("trace_context", {}))
        ) as span:
            span.set_attribute("pcpstack.pcp_rank", spec.pcp_rank)
            span.set_attribute("pcpstack.replica_owner", owner == spec.pcp_rank)
            return self._run(tokens, request, split, owner)

    def _run(
        self, tokens: torch.Tensor, request: dict, split: DualChunkSplit, owner: int
    ) -> PrefillOutcome | None:
        spec, engine = self.spec, self.engine
        seq_id = request["request_id"]
        first_token, push_failed, total_bytes, push_us, error = -1, 0, 0, 0, ""
        try:
            state = engine.reserve(seq_id, len(tokens))
            started = time.perf_counter()
            logits = prefill_share(
                engine, state, tokens, split, spec.pcp_rank, KvAllGather(split, on_progress=self.on_progress)
            )
            forward_us = int((time.perf_counter() - started) * 1e6)
            if logits is not None:
                params = SamplingParams(**request["sampling"])
                first_token = sample(logits, params, make_generator(params.seed))
            if spec.pcp_rank == owner:
                started = time.perf_counter()
                replica = engine.export_sequence(seq_id).contiguous()
                total_bytes = replica.numel() * replica.element_size()
                try:
                    self.pusher.push(
                        request["kvstore_address"],
                        make_key(seq_id, self.fingerprint),
                        self.fingerprint,
                        memoryview(replica.numpy()).cast("B"),
                        request["lease_ms"],
                        json.dumps({"num_tokens": len(tokens), **asdict(engine.layout)}).encode(),
                    )
                except Exception as exc:  # the store's error travels to rank 0, which answers the caller
                    push_failed, error = 1, f"rank {spec.pcp_rank} could not push its KV replica: {exc}"
                    log.warning(error)
                push_us = int((time.perf_counter() - started) * 1e6)
        finally:
            # Only the selected replica lives on (in the store); every rank frees its copy at once.
            engine.free(seq_id)
        mine = bytearray(_RESULT_BYTES)
        _RESULT.pack_into(mine, 0, first_token, push_failed, total_bytes, forward_us, push_us)
        message = error.encode()[: _RESULT_BYTES - _RESULT.size]
        mine[_RESULT.size : _RESULT.size + len(message)] = message
        shares = [torch.empty(_RESULT_BYTES, dtype=torch.uint8) for _ in range(spec.pcp_size)]
        dist.all_gather(shares, torch.frombuffer(mine, dtype=torch.uint8))
        if spec.pcp_rank != 0:
            return None
        results = [_RESULT.unpack_from(bytes(s.tolist())) for s in shares]
        errors = [bytes(s.tolist())[_RESULT.size :].rstrip(b"\0").decode(errors="replace") for s in shares]
        token = next(r[0] for r in results if r[0] >= 0)
        return PrefillOutcome(
            request_id=request["request_id"],
            first_token_id=token,
            replica_rank=owner,
            total_bytes=results[owner][2],
            forward_seconds=max(r[3] for r in results) / 1e6,
            push_seconds=results[owner][4] / 1e6,
            error=errors[owner] if results[owner][1] else "",
        )


def rank_main(spec: RankSpec, conn: Connection, progress: Synchronized) -> None:
    """Entry point of a rank process (a multiprocessing target); exits on stop or when the group fails."""
    torch.set_num_threads(spec.threads)
    setup_telemetry("prefill-rank")
    try:
        engine = Engine.load(spec.model, block_size=spec.block_size, num_blocks=None)
        configure_gloo_interface(spec.advertised_host)
        init_pcp_group(
            spec.master_addr,
            spec.master_port,
            spec.pcp_rank,
            spec.pcp_size,
            engine.device,
            spec.collective_timeout_s,
        )
        worker = RankWorker(spec, engine, on_progress=lambda: setattr(progress, "value", time.time()))
        conn.send(
            RankReady(
                spec.pcp_rank,
                worker.fingerprint,
                asdict(engine.layout),
                engine.args.vocab_size,
                engine.args.max_seq_len,
            )
        )
        progress.value = time.time()
        while True:
            job = None
            if spec.pcp_rank == 0 and conn.poll(spec.idle_tick_s):
                job = conn.recv()
                if job is None:  # the node asks the set to stop
                    header = torch.tensor([OP_STOP, 0, 0, 0])
                    dist.broadcast(header, src=0)
                    break
            op, outcome = worker.step(job)
            progress.value = time.time()
            if outcome is not None:
                conn.send(outcome)
            if op == OP_STOP:
                break
    except Exception as exc:
        log.exception("rank %d failed", spec.pcp_rank)
        try:
            conn.send(f"rank {spec.pcp_rank} failed: {type(exc).__name__}: {exc}")
        finally:
            shutdown_telemetry()
            # Not sys.exit: a broken process group can hang in its destructor.
            os._exit(1)
    shutdown_telemetry()
    os._exit(0)
