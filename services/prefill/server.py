"""The Prefill servicer: turns a PrefillRequest into a job for the node's set and the outcome into a reply.

Every check on the request happens here, before any rank works (the shared prompt check of
pcpstack.engine.prompt, the request-id rule, the set's KV capacity, the fingerprint, the KV store, the KV
lease against the store's cap), and each failure is raised as its kind of pcpstack.common.errors for the
common interceptor to answer. The KV key of the attempt is computed here, once, with the keys of its shards
when a TP group stores the replica as several objects; the ranks push under them and the reply's handle
names them. A caller who leaves before the set takes its job takes the job off the set's queue.

Prefix reuse (on unless --no-prefix-cache): the servicer derives the prompt's block keys once per stored
shard of the replica (kvstore.prefix, chained from the shard's own fingerprint and salted by the request's
cache salt; one shard holding every head without TP), asks the store in one lookup which leading blocks
ALL shards hold (leaving the last token to compute) and hands the job the cached prefix and the keys; the
reply's handle names the prefix's segments (each with its shard's K/V heads and fingerprint) and the one
lease pinning them, beside the new replica. The lease is the reader's to release, or this servicer's when
nobody will read it (the set did not use the prefix, the request failed, its caller left).

A caller that gives up as its answer is on the way (sent here, not yet taken in there) cancels a call this
side saw succeed, and nobody holds the replica's key and capability but this servicer. A request may carry
an abandon_token: the answer's replica is kept under it until the replica's lease ends, and Abandon with
that token deletes it (and releases the prefix lease the answer handed over) instead of leaving it pinned
until then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace

import grpc
from opentelemetry.metrics import Observation
from opentelemetry.propagate import inject

from pcpstack.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ServiceError,
    Unavailable,
)
from pcpstack.common.ids import check_request_id
from pcpstack.common.logs import ThrottledWarning, request_id_var
from pcpstack.common.telemetry import latency_histogram, meter, tracer
from pcpstack.engine.prompt import check_prompt
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.prefix import PREFIX_BLOCK_TOKENS, prefix_block_keys, reusable_blocks
from pcpstack.kvstore.store import DEFAULT_MAX_LEASE_MS
from pcpstack.prefill.errors import PromptOverCapacity, StoreGone, StoreNotListed
from pcpstack.prefill.job import (
    CachedPrefix,
    PrefillJob,
    PrefillOutcome,
    PrefixRun,
    ReplicaShard,
    replica_shards,
)
from pcpstack.prefill.node import ModelInfo, RankSupervisor
from pcpstack.prefill.replica import replica_key
from pcpstack.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)
# The longest abandon_token a request may carry (a random hex token is 32).
MAX_ABANDON_TOKEN = 128
# An answer kept for Abandon: when its replica's lease ends, its store, the (key, capability) of each of its
# objects, and the prefix lease it handed over (None: none).
KeptAnswer = tuple[float, str, tuple[tuple[str, str], ...], CachedPrefix | None]
SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
_tracer = tracer(__name__)
_meter = meter("pcpstack.prefill")
_requests = _meter.create_counter("pcpstack.prefill.requests", description="Prefill requests by outcome")
_forward = latency_histogram(
    _meter, "pcpstack.prefill_forward_time", "seconds of the set's forward pass (its slowest rank)"
)
_push = latency_histogram(_meter, "pcpstack.kv_push_time", "seconds to push the KV replica to the store")


async def lease_refusal(store: KvStoreClient, lease_ms: int) -> str | None:
    """Why the store would refuse pins of lease_ms (longer than its --max-lease-ms, which its Stat tells),
    or None if it takes them or does not tell its cap (a store older than the field: the push decides)."""
    cap = (await store.stat()).max_lease_ms
    if cap and lease_ms > cap:
        return f"lease_ms={lease_ms} exceeds this store's cap of {cap} ms (its --max-lease-ms)"
    return None


async def default_lease_ms(store: KvStoreClient) -> int:
    """How long the store pins what asks for no lease (lease_ms 0): its --default-lease-ms, as its Stat tells;
    from a store older than that field, its cap (which bounds the default) or DEFAULT_MAX_LEASE_MS."""
    stat = await store.stat()
    return stat.default_lease_ms or stat.max_lease_ms or DEFAULT_MAX_LEASE_MS


class LeaseBounds:
    """How long a replica pushed to a store can stay pinned there, for keeping what Abandon needs that long:
    the lease the push asked for, or for 0 the store's default lease, asked of each store again once
    REFRESH_S have passed (a restarted store may have another); DEFAULT_MAX_LEASE_MS while it cannot tell."""

    REFRESH_S = 60.0

    def __init__(
        self, client: Callable[[str], KvStoreClient], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._client = client
        self._clock = clock
        self._defaults: dict[str, tuple[float, int]] = {}  # store -> (when asked, its default lease)
        self._failures = ThrottledWarning(log)  # a store that is down fails every request's question

    async def bound_ms(self, store: str, lease_ms: int) -> int:
        """lease_ms, or for 0 the store's default lease."""
        if lease_ms:
            return lease_ms
        known = self._defaults.get(store)
        if known is not None and self._clock() - known[0] < self.REFRESH_S:
            return known[1]
        try:
            default = await default_lease_ms(self._client(store))
        except ServiceError as exc:
            self._failures.warning(store, "could not ask %s for its default lease: %s", store, exc)
            return max(DEFAULT_MAX_LEASE_MS, known[1] if known else 0)
        self._defaults[store] = (self._clock(), default)
        return default


def _stored_objects(outcome: PrefillOutcome) -> tuple[tuple[str, str], ...]:
    """(key, capability) of each of the replica's shards in the store."""
    return tuple((stored.shard.key, stored.capability) for stored in outcome.shards)


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """Serves Prefill on the master node of a PCP set."""

    def __init__(
        self,
        supervisor: RankSupervisor,
        info: ModelInfo,
        kv_stores: Callable[[bool], Awaitable[list[str]]],
        lease_ms: int = 0,
        tp_size: int = 1,
        kv_cache_tokens: int = 0,
        prefix_cache: bool = True,
    ) -> None:
        """kv_stores(fresh): the addresses ranks may push to (the configured store, then those the registry
        lists; fresh: asked of the registry now, not its cached answer); the first is the default.
        tp_size: the TP size of the sets this node runs.
        kv_cache_tokens: the K/V each rank's cache holds, the longest prompt a set takes (0: no limit
        beyond the model's context). prefix_cache: reuse prompt prefixes the store holds and offer new
        blocks (--no-prefix-cache turns it off)."""
        self.supervisor = supervisor
        self.prefix_cache = prefix_cache
        scaling = info.args.rope_scaling
        if prefix_cache and scaling is not None and scaling.rotates_by_length:
            self.prefix_cache = False
            log.info("prefix cache off: dynamic RoPE rotates each prompt's K by that prompt's length")
        self._kv_clients: dict[str, KvStoreClient] = {}
        self._kv_cache_tokens = kv_cache_tokens
        self.info = info
        self._tp_size = tp_size
        self._background: set[asyncio.Future] = set()
        # Answers sent with an abandon_token, oldest first.
        self._answered: OrderedDict[str, KeptAnswer] = OrderedDict()
        _meter.create_observable_gauge(
            "pcpstack.prefill.queue_depth",
            callbacks=[lambda _: [Observation(supervisor.load)]],
            description="prefill jobs queued or running on this set",
        )
        self._kv_stores = kv_stores
        self._stores_seen: set[str] = set()  # every store ever listed, to tell a gone store from a stranger
        self._lease_ms = lease_ms
        self._leases_taken: set[tuple[str, int]] = set()  # (store, lease_ms) a store said it takes
        self._lease_bounds = LeaseBounds(self._kv_client)

    async def _store_for(self, requested: str) -> str:
        """The store to push to: the requested one if it is listed, else the default. A requested store that
        was listed before is UNAVAILABLE (gone), one never listed PERMISSION_DENIED."""
        stores = await self._kv_stores(False)
        if requested and requested not in stores:
            stores = await self._kv_stores(True)  # the caller's answer may be newer: a store that just joined
        self._stores_seen.update(stores)
        if requested and requested not in stores:
            if requested in self._stores_seen:
                raise StoreGone(
                    f"kvstore_address={requested!r} is no longer listed by the registry (it died or left); "
                    "pick another store"
                )
            raise StoreNotListed(
                f"kvstore_address={requested!r} is not a KV store the registry lists ({', '.join(stores)}); "
                "ranks push only to listed stores"
            )
        if not stores:
            raise Unavailable("no KV store is known to push the replica to")
        return requested or stores[0]

    def _kv_client(self, address: str) -> KvStoreClient:
        client = self._kv_clients.get(address)
        if client is None:
            client = self._kv_clients[address] = KvStoreClient(address)
        return client

    async def _check_lease(self, store: str, requested_ms: int) -> None:
        """Refuses a lease the store would refuse at the push, after the whole forward: the request's
        kv_lease_ms (INVALID_ARGUMENT) or, when it asks none, this node's --kv-lease-ms (FAILED_PRECONDITION:
        not the caller's fault). Each store is asked once per lease; one that cannot answer leaves it to
        the push."""
        lease_ms = requested_ms or self._lease_ms
        if not lease_ms or (store, lease_ms) in self._leases_taken:
            return  # 0: the store's default, within its cap
        try:
            refusal = await lease_refusal(self._kv_client(store), lease_ms)
        except ServiceError as exc:
            log.warning("could not check a lease of %d ms with %s: %s", lease_ms, store, exc)
            return
        if refusal is None:
            self._leases_taken.add((store, lease_ms))
        elif requested_ms:
            raise InvalidArgument(f"kv_lease_ms={requested_ms} is refused by KV store {store}: {refusal}")
        else:
            raise FailedPrecondition(
                f"this prefill node's --kv-lease-ms={lease_ms} is refused by KV store {store}: {refusal}; "
                "the node must be restarted with a lease within the store's cap"
            )

    async def close(self) -> None:
        """Closes the store clients (after the background clean-ups)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for client in self._kv_clients.values():
            await client.close()

    async def _cached_prefix(
        self, address: str, shards: tuple[ReplicaShard, ...], num_tokens: int, lease_ms: int
    ) -> CachedPrefix | None:
        """The prompt's leading blocks every shard's chain holds in the store, under one prefix lease (None:
        a miss, or the store could not say: then the whole prompt is computed)."""
        reusable = reusable_blocks(num_tokens, PREFIX_BLOCK_TOKENS)
        chains = [(shard.fingerprint, shard.block_keys[:reusable]) for shard in shards]
        if not reusable or not chains:
            return None
        try:
            found = await self._kv_client(address).lookup((), "", lease_ms, chains=chains)
        except Exception as exc:  # a cache that cannot answer is a miss
            log.warning("prefix lookup on %s failed: %s", address, exc)
            return None
        if not found.blocks:
            return None
        runs = tuple(
            PrefixRun(s.key, s.token_start, s.token_count, s.object_bytes, s.chain) for s in found.segments
        )
        return CachedPrefix(found.tokens, runs, found.lease_id, found.capability)

    def _later(self, coroutine) -> None:
        """Runs a clean-up in the background, kept until done."""
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _looked_up(
        self, address: str, shards: tuple[ReplicaShard, ...], num_tokens: int, lease_ms: int
    ) -> CachedPrefix | None:
        """_cached_prefix, except that a caller who leaves during the lookup does not leave its lease pinning
        the blocks until it expires: the lookup finishes and its lease is released."""
        lookup = asyncio.ensure_future(self._cached_prefix(address, shards, num_tokens, lease_ms))
        try:
            return await asyncio.shield(lookup)
        except asyncio.CancelledError:
            lookup.add_done_callback(lambda done: self._release_looked_up(done, address))
            raise

    def _release_looked_up(self, done: asyncio.Future, address: str) -> None:
        if not done.cancelled() and done.exception() is None and done.result() is not None:
            self._later(self._release_prefix(address, done.result()))

    async def _release_prefix(self, address: str, prefix: CachedPrefix) -> None:
        try:
            await self._kv_client(address).release(prefix.lease_id, prefix.capability, lease=True)
        except Exception as exc:  # the lease expires anyway
            log.warning("could not release prefix lease %s: %s", prefix.lease_id, exc)

    def _abandon(self, address: str, job: PrefillJob, outcome: PrefillOutcome) -> None:
        """Deletes every stored shard of a replica nobody will read (its caller left, or its request
        failed), and releases its prefix lease."""
        if outcome.replica_stored:
            self._later(self._delete(address, _stored_objects(outcome)))
        if job.prefix is not None:
            self._later(self._release_prefix(address, job.prefix))

    async def _delete(self, address: str, objects: tuple[tuple[str, str], ...]) -> None:
        """Deletes a replica's store objects, (key, capability) each."""
        # Each shard on its own: one that cannot be deleted must not keep the others in the store.
        for key, capability in objects:
            try:
                async with KvStoreClient(address) as client:
                    await client.delete(key, capability)
            except Exception as exc:  # the store's lease reclaims it anyway
                log.warning("could not delete abandoned replica shard %s: %s", key, exc)

    def _discard_when_done(self, done: asyncio.Future, address: str, job: PrefillJob) -> None:
        if not done.cancelled() and done.exception() is None:
            _, outcome = done.result()
            self._abandon(address, job, outcome)
        elif job.prefix is not None:
            self._later(self._release_prefix(address, job.prefix))

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        request_id_var.set(request.request_id)
        info = self.info
        check_request_id(request.request_id)
        if len(request.abandon_token) > MAX_ABANDON_TOKEN:
            raise InvalidArgument(
                f"abandon_token has {len(request.abandon_token)} characters; at most {MAX_ABANDON_TOKEN}"
            )
        # Prefill samples one token; max_tokens matters to decode only.
        ids, sampling = check_prompt(
            request.token_ids, request.sampling, info.limits, default_max_tokens=1, generates=False
        )
        if self._kv_cache_tokens and len(ids) > self._kv_cache_tokens:
            raise PromptOverCapacity(
                f"prompt of {len(ids)} tokens exceeds this prefill set's KV capacity of "
                f"{self._kv_cache_tokens} tokens (--kv-cache-tokens; every PCP rank holds the whole prompt)"
            )
        if request.expected_fingerprint and request.expected_fingerprint != info.fingerprint:
            raise FailedPrecondition(
                f"expected_fingerprint={request.expected_fingerprint[:16]}… but this set produces KV with "
                f"fingerprint {info.fingerprint[:16]}… (another model or KV layout)"
            )
        self.supervisor.ready_set()  # fail fast, before resolving a store
        store = await self._store_for(request.kvstore_address)
        await self._check_lease(store, request.kv_lease_ms)
        lease_ms = request.kv_lease_ms or self._lease_ms
        kept_ms = await self._lease_bounds.bound_ms(store, lease_ms) if request.abandon_token else 0
        with _tracer.start_as_current_span("prefill.set") as span:
            carrier: dict[str, str] = {}
            inject(carrier)
            kv_key = replica_key(request.request_id, info.fingerprint)
            shards = replica_shards(kv_key, info.fingerprint, info.args, self._tp_size)
            prefix = None
            if self.prefix_cache:
                # Each shard's chain starts from its own fingerprint: a block key names the heads it holds.
                shards = tuple(
                    replace(
                        shard,
                        block_keys=tuple(
                            prefix_block_keys(ids, PREFIX_BLOCK_TOKENS, shard.fingerprint, request.cache_salt)
                        ),
                    )
                    for shard in shards
                )
                if not request.no_prefix_cache:
                    prefix = await self._looked_up(store, shards, len(ids), lease_ms)
            job = PrefillJob(
                request_id=request.request_id,
                kv_key=kv_key,
                shards=shards,
                token_ids=ids,
                sampling=sampling,
                kvstore_address=store,
                lease_ms=lease_ms,
                trace_context=carrier,
                prefix=prefix,
            )
            span.set_attribute("pcpstack.request_id", request.request_id)
            span.set_attribute("pcpstack.prompt_tokens", len(ids))
            task = asyncio.ensure_future(self.supervisor.run_job(job))
            try:
                running, outcome = await asyncio.wait_for(asyncio.shield(task), context.time_remaining())
            except (TimeoutError, asyncio.CancelledError) as exc:
                # The caller left: a job still queued leaves the queue and never runs; one the set has taken
                # runs to the end (its ranks are in the forward together), then its replica is deleted.
                self.supervisor.withdraw(job)
                task.add_done_callback(lambda done: self._discard_when_done(done, store, job))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise DeadlineExceeded("prefill did not finish within the deadline") from None
            except Exception:  # the set failed: nobody will read the prefix
                if job.prefix is not None:
                    self._later(self._release_prefix(store, job.prefix))
                raise
            span.set_attribute("pcpstack.replica_rank", outcome.replica_rank)
            span.set_attribute("pcpstack.cached_tokens", outcome.cached_tokens)
        error = outcome.error_kind()
        if error is not None:
            _requests.add(1, {"outcome": "error"})
            self._abandon(store, job, outcome)
            raise error
        if job.prefix is not None and not outcome.cached_tokens:
            self._later(self._release_prefix(store, job.prefix))  # the set computed the whole prompt
        _requests.add(1, {"outcome": "ok"})
        _forward.record(outcome.forward_seconds)
        _push.record(outcome.push_seconds)
        if request.abandon_token:
            self._keep_answer(request.abandon_token, store, kept_ms, job, outcome)
        return self._reply(job, running.assignment, outcome)

    def _keep_answer(
        self, token: str, store: str, kept_ms: int, job: PrefillJob, outcome: PrefillOutcome
    ) -> None:
        """Keeps what Abandon needs to delete this answer's replica, for kept_ms (its lease at most)."""
        self._forget_expired()
        prefix = job.prefix if outcome.cached_tokens else None
        self._answered.pop(token, None)  # a token sent again is the newer answer's, kept in arrival order
        self._answered[token] = (time.monotonic() + kept_ms / 1000, store, _stored_objects(outcome), prefix)

    def _forget_expired(self) -> None:
        """Drops the oldest kept answers while their replica's lease is over (the store has reclaimed it).
        Leases differ between requests, so a later one may expire first: Abandon checks each itself."""
        now = time.monotonic()
        while self._answered and next(iter(self._answered.values()))[0] <= now:
            self._answered.popitem(last=False)

    async def Abandon(
        self, request: prefill_pb2.AbandonRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.AbandonResponse:
        if not request.abandon_token:
            raise InvalidArgument("abandon_token must not be empty")
        self._forget_expired()
        kept = self._answered.pop(request.abandon_token, None)
        if kept is None or kept[0] <= time.monotonic():
            return prefill_pb2.AbandonResponse(deleted=False)
        _, store, objects, prefix = kept
        # In the background, as every clean-up here: a caller that leaves cannot stop it halfway, with the
        # entry already gone and the rest of the replica pinned until its lease ends.
        self._later(self._delete(store, objects))
        if prefix is not None:
            self._later(self._release_prefix(store, prefix))
        log.info("deleting the replica of an answer its caller never took in")
        return prefill_pb2.AbandonResponse(deleted=True)

    def _reply(self, job: PrefillJob, assignment, outcome: PrefillOutcome) -> prefill_pb2.PrefillResponse:
        layout = self.info.layout
        prefix = job.prefix if outcome.cached_tokens else None
        shards = [
            common_pb2.KvShard(
                key=stored.shard.key,
                capability=stored.capability,
                kv_head_start=stored.shard.kv_head_start,
                kv_head_end=stored.shard.kv_head_end or layout.num_kv_heads,
                total_bytes=stored.total_bytes,
                fingerprint=stored.shard.fingerprint or self.info.fingerprint,
            )
            for stored in outcome.shards
        ]
        return prefill_pb2.PrefillResponse(
            request_id=job.request_id,
            first_token_id=outcome.first_token_id,
            first_token_logprobs=outcome.first_token_logprobs_wire(),
            kv=common_pb2.KvHandle(
                # The first shard's (the replica itself with tp 1); the fingerprint is the whole replica's.
                key=shards[0].key if shards else outcome.kv_key,
                fingerprint=self.info.fingerprint,
                layout=common_pb2.KvLayout(
                    model_id=layout.model_id,
                    num_layers=layout.num_layers,
                    num_kv_heads=layout.num_kv_heads,
                    head_dim=layout.head_dim,
                    dtype=layout.dtype,
                    block_size=layout.block_size,
                ),
                num_tokens=len(job.token_ids),
                source_pcp_rank=outcome.replica_rank,
                store_address=job.kvstore_address,
                total_bytes=outcome.total_bytes,
                capability=outcome.capability,
                shards=shards,
                source_tp_size=self._tp_size,
                cached_tokens=outcome.cached_tokens,
                prefix_segments=[
                    common_pb2.KvPrefixSegment(
                        key=run.key,
                        token_start=run.token_start,
                        token_count=run.token_count,
                        object_bytes=run.object_bytes,
                        kv_head_start=job.shards[run.shard].kv_head_start,
                        kv_head_end=job.shards[run.shard].kv_head_end or layout.num_kv_heads,
                        fingerprint=job.shards[run.shard].fingerprint or self.info.fingerprint,
                    )
                    for run in (prefix.runs if prefix else ())
                ],
                prefix_lease_id=prefix.lease_id if prefix else "",
                prefix_lease_capability=prefix.capability if prefix else "",
            ),
            set_id=assignment.set_id,
            generation=assignment.generation,
            pcp_size=assignment.pcp_size,
            forward_seconds=outcome.forward_seconds,
            kv_push_seconds=outcome.push_seconds,
            computed_tokens=len(job.token_ids) - outcome.cached_tokens,
        )
