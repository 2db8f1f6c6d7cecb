"""The KvStoreService servicer: protobuf in, core calls, protobuf out; plus the lease reaper and metrics.

The core (store.py) decides; the segments (shm.py) hold the bytes; stream.py checks chunks the same way the
client does. This module checks the shape of each stream (header first, then chunks or the shared-memory
hand-off, one commit) and makes sure every way a stream can end (commit, bad data, a writer or reader that
vanished) leaves the core consistent. Refusals are raised as the store's error kinds; the common
interceptor (installed by start_server) sends each as its gRPC status, after the cleanup in `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from opentelemetry.metrics import CallbackOptions, Observation

from pcpstack.common.errors import ServiceError
from pcpstack.common.server import RunningServer, ServerOptions, start_server
from pcpstack.common.telemetry import meter
from pcpstack.kvstore.errors import CapacityExceeded, InvalidArgument
from pcpstack.kvstore.ranges import ByteRange, check_ranges, crc_of_selection, gather_with_crc
from pcpstack.kvstore.shm import (
    Segment,
    SegmentStore,
    anonymous_buffer,
    copy_with_crc,
    lower_thread_priority,
    to_thread_to_the_end,
)
from pcpstack.kvstore.store import (
    DEFAULT_MAX_LEASE_MS,
    KvStore,
    PendingPut,
    StoreConfig,
    StoredObject,
    StoreStats,
)
from pcpstack.kvstore.stream import DEFAULT_CHUNK_BYTES, ChunkReceiver, ChunkSender, verify_object
from pcpstack.kvstore.wire import SERVICE_NAME, body_of, chunk_of, parse_with, serialize
from pcpstack.v1 import kvstore_pb2 as pb
from pcpstack.v1 import kvstore_pb2_grpc

log = logging.getLogger(__name__)

MESSAGE_OVERHEAD = 1024  # room for the non-data fields of a chunk message
# Objects from this size on get a standby segment for their writer's next put (_standby): below it, a
# fresh mapping costs little (~0.5 ms per MiB here) and the pool would fill with small standbys.
STANDBY_MIN_BYTES = 8 << 20
# Standbys evict released objects for their room only up to this share of the capacity in all (one per
# writer: a store that many PCP ranks push to would otherwise give up much of its prefix reuse for them).
STANDBY_EVICTION_SHARE = 0.25


@dataclass(frozen=True)
class KvStoreServerConfig:
    """Everything a KV store process needs, validated when built."""

    capacity_bytes: int
    default_lease_ms: int = 60_000
    shm_dir: str = "/dev/shm"
    reap_interval_s: float = 0.5
    default_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_lease_ms: int = DEFAULT_MAX_LEASE_MS
    # Shared-memory puts of at least this many bytes get a standby segment for their writer's next put
    # (KvStoreServicer._standby); 0: none.
    standby_min_bytes: int = STANDBY_MIN_BYTES

    def __post_init__(self) -> None:
        self.store_config()  # validates the core's part
        if self.standby_min_bytes < 0:
            raise ValueError(f"standby_min_bytes must be >= 0 (0: no standby), got {self.standby_min_bytes}")
        if self.reap_interval_s <= 0:
            raise ValueError(f"reap_interval_s must be > 0, got {self.reap_interval_s}")
        if self.default_chunk_bytes <= 0:
            raise ValueError(f"default_chunk_bytes must be > 0, got {self.default_chunk_bytes}")

    def store_config(self) -> StoreConfig:
        """The core's part of this config."""
        return StoreConfig(self.capacity_bytes, self.default_lease_ms, self.max_lease_ms)


class _StreamEnded(InvalidArgument):
    """The writer's stream ended before the commit: on a broken connection grpc ends the request stream
    just as a half-close does, so this counts as an abandoned put, not a refused one."""


def _encode_chunks(data: memoryview, chunk_size: int) -> Iterator[tuple[int, bytes]]:
    """(length, encoded chunk message) of every chunk of a buffer the store owns outright."""
    sender = ChunkSender(len(data), chunk_size)
    for offset, length in sender.spans():
        yield length, sender.encode(offset, data[offset : offset + length])


def _unix_ms(monotonic_deadline: float) -> int:
    return int((time.time() + monotonic_deadline - time.monotonic()) * 1000)


class KvStoreServicer(kvstore_pb2_grpc.KvStoreServiceServicer):
    """Serves one KvStore whose bytes live in one SegmentStore."""

    def __init__(self, store: KvStore, segments: SegmentStore, config: KvStoreServerConfig, max_chunk: int):
        self.store = store
        self.segments = segments
        self._config = config
        self._max_chunk = max_chunk
        # Standby segments being prepared, by name (held until done: a task nobody references may be
        # collected), one at a time on a thread of background priority: a reader fetching the object just
        # put gets the cores first.
        self._preparing: dict[str, asyncio.Future] = {}
        self._background = ThreadPoolExecutor(1, "kv-standby", initializer=lower_thread_priority)

    async def Put(
        self, request_iterator: AsyncIterator[pb.PutRequest], context
    ) -> AsyncIterator[pb.PutResponse]:
        pending: PendingPut | None = None
        refused = False  # the store turned the put down, as opposed to the writer going away
        try:
            first = await anext(request_iterator, None)
            if first is None or body_of(first) != "header":
                raise InvalidArgument("the first message of a Put must be a header")
            header = first.header
            if not header.use_shm and header.total_bytes and not 0 < header.chunk_size <= self._max_chunk:
                raise InvalidArgument(f"chunk_size must be in 1..{self._max_chunk}, got {header.chunk_size}")
            pending = self.store.begin_put(
                header.key,
                header.fingerprint,
                header.total_bytes,
                header.lease_ms,
                header.metadata,
                block_keys=header.block_keys,
                block_tokens=header.block_tokens,
            )
            if header.use_shm and header.standby_shm_name in self._preparing:
                # Its writer came back before the standby's pages were all mapped here: the rest of that
                # takes less than making a new segment would.
                await asyncio.shield(self._preparing[header.standby_shm_name])
            segment = self._allocate(pending, header.standby_shm_name if header.use_shm else "")
            shm_name = segment.name if header.use_shm and segment is not None else ""
            yield pb.PutResponse(accepted=pb.PutAccepted(shm_name=shm_name))
            if header.use_shm:
                crc = await self._receive_shm(request_iterator, pending, segment)
            else:
                crc = await self._receive_chunks(request_iterator, pending, segment, header.chunk_size)
            obj = self.store.commit_put(pending, crc, time.monotonic())
            pending = None
            yield pb.PutResponse(
                committed=pb.PutCommitted(
                    key=obj.key,
                    total_bytes=obj.total_bytes,
                    lease_expires_unix_ms=_unix_ms(obj.lease_expires),
                    capability=obj.capability,  # the writer alone learns it, here
                    standby_shm_name=(
                        self._standby(obj.total_bytes, header.standby_shm_name)
                        if header.use_shm and not header.standby_on_request
                        else ""
                    ),
                )
            )
        except ServiceError as exc:
            refused = not isinstance(exc, _StreamEnded)
            raise
        finally:
            if pending is not None:
                # Reached on refusal, on a broken stream and on cancellation: nothing is left behind.
                self.store.abort_put(pending, refused=refused)
                self._trim_pool()

    def _allocate(self, pending: PendingPut, preferred: str) -> Segment | None:
        if pending.total_bytes == 0:
            return None
        try:
            pending.payload = self.segments.allocate(pending.total_bytes, preferred)
        except OSError as exc:  # the tmpfs is full: capacity, as the budget is
            raise CapacityExceeded(
                f"cannot allocate {pending.total_bytes} bytes of shared memory: {exc}"
            ) from exc
        self._trim_pool()
        return pending.payload

    def _trim_pool(self) -> None:
        self.segments.trim(self.store.free_bytes())

    def _standby(self, size: int, held: str) -> str:
        """The name of a free segment kept ready for the writer's next shared-memory put of about size
        bytes (shm.SegmentStore.standby: the one it `held` if still free and fitting; a new one is prepared
        on a worker thread, beside this reply), or "" for an object under standby_min_bytes or when no room
        for one can be made.

        Room is the free capacity; a store full of released objects (a server that has run a while:
        replicas stay for prefix reuse) evicts the least recently used of them for it, as the writer's
        next put of this size would anyway: the standby takes that room one put early, so that the put
        lands in pages mapped already. Pinned, read and prefix-leased objects are never evicted for it,
        and standbys in all take at most STANDBY_EVICTION_SHARE of the capacity that way."""
        if not self._config.standby_min_bytes or size < self._config.standby_min_bytes:
            return ""
        try:
            segment, new = self.segments.standby(size, self.store.free_bytes(), held)
            room = self.segments.promised_bytes + size
            share = room <= STANDBY_EVICTION_SHARE * self._config.capacity_bytes
            if segment is None and share and self.store.reclaim(room):
                # The evicted objects' segments are pooled now: one that fits becomes the standby as it is.
                segment, new = self.segments.standby(size, self.store.free_bytes(), held)
        except OSError:  # a file /dev/shm cannot hold: no standby, the put itself is done
            return ""
        if segment is None:
            return ""
        if new:
            task = asyncio.get_running_loop().run_in_executor(
                self._background, self.segments.prepare, segment
            )
            self._preparing[segment.name] = task
            task.add_done_callback(lambda _: self._preparing.pop(segment.name, None))
        return segment.name

    async def _receive_shm(
        self, requests: AsyncIterator[pb.PutRequest], pending: PendingPut, segment: Segment | None
    ) -> int:
        message = await anext(requests, None)
        if message is None:
            raise _StreamEnded(f"Put stream of key {pending.key!r} ended before its commit")
        if body_of(message) != "commit":
            raise InvalidArgument("on the shared-memory path the message after the header must be the commit")
        # A writer gone meanwhile aborts the put only once the checksum's thread has let go of the segment.
        actual = 0 if segment is None else await to_thread_to_the_end(segment.crc32c, pending.total_bytes)
        return verify_object(pending.key, actual, message.commit.crc32c, "its commit")

    async def _receive_chunks(
        self,
        requests: AsyncIterator[pb.PutRequest],
        pending: PendingPut,
        segment: Segment | None,
        chunk_size: int,
    ) -> int:
        def copy(offset: int, data: memoryview) -> int:
            with segment.view(offset, len(data)) as place:
                return copy_with_crc(place, [data])

        receiver = ChunkReceiver(
            pending.key, pending.total_bytes, chunk_size, copy, malformed=InvalidArgument
        )
        async for message in requests:
            kind = body_of(message)
            if kind == "commit":
                return receiver.finish(message.commit.crc32c, "its commit")
            if kind != "chunk":
                raise InvalidArgument(f"unexpected {kind} in a Put after the header")
            receiver.add(chunk_of(message))
        raise _StreamEnded(f"Put stream of key {pending.key!r} ended before its commit")

    async def Get(
        self, request_iterator: AsyncIterator[pb.GetRequest], context
    ) -> AsyncIterator[pb.GetResponse]:
        obj: StoredObject | None = None
        sent = 0
        try:
            request = await anext(request_iterator, None)
            if request is None:
                raise InvalidArgument("a Get stream must start with a GetRequest")
            obj = self.store.begin_get(request.key, request.fingerprint, request.capability, request.lease_id)
            segment: Segment | None = obj.payload
            ranges = [ByteRange.from_wire(r) for r in request.ranges]
            selected = check_ranges(ranges, obj.total_bytes) if ranges else 0
            use_shm = request.accept_shm and segment is not None
            selection, selected_crc = None, 0
            if ranges:
                # The selection's CRC32C comes from the store's copy, which matched the writer's at commit. A
                # reader over shared memory copies the selection out itself: only its checksum is needed.
                with segment.view(0, obj.total_bytes) as whole:
                    if use_shm:
                        selected_crc = await to_thread_to_the_end(crc_of_selection, whole, ranges)
                    else:
                        selection = anonymous_buffer(selected)
                        selected_crc = await to_thread_to_the_end(gather_with_crc, whole, ranges, selection)
            chunk_size = min(request.max_chunk_size or self._config.default_chunk_bytes, self._max_chunk)
            yield pb.GetResponse(
                header=pb.GetHeader(
                    total_bytes=obj.total_bytes,
                    crc32c=obj.crc32c,
                    metadata=obj.metadata,
                    shm_name=segment.name if use_shm else "",
                    chunk_size=0 if use_shm else chunk_size,
                    selected_bytes=selected,
                    selected_crc32c=selected_crc,
                )
            )
            if use_shm:
                # The reader copies out of the segment, then half-closes: only then may it be reused.
                async for _ in request_iterator:
                    pass
                sent = selected if ranges else obj.total_bytes
                return
            if selection is not None:
                # The chunks carry the selection (offsets within it), each with its own CRC32C as ever.
                for length, encoded in _encode_chunks(selection, chunk_size):
                    yield encoded
                    sent += length
                return
            sender = ChunkSender(obj.total_bytes, chunk_size)
            for offset, length in sender.spans():
                with segment.view(offset, length) as data:
                    encoded = sender.encode(offset, data)
                yield encoded
                sent += length
        finally:
            if obj is not None:
                self.store.end_get(obj, sent)
                self._trim_pool()

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        if request.lease:
            released = self.store.release_lease(request.key, request.capability)
            self._trim_pool()  # the lease may have held the last reference to a deleted object
        else:
            released = self.store.release(request.key, request.capability)
        return pb.ReleaseResponse(released=released)

    async def PrepareStandby(self, request: pb.PrepareStandbyRequest, context) -> pb.PrepareStandbyResponse:
        # The writer's next put will be this size: its standby is readied now, as after a put (_standby).
        size, capacity = request.size_bytes, self._config.capacity_bytes
        if not 0 < size <= capacity:
            raise InvalidArgument(f"size_bytes must be in 1..{capacity} (the store's capacity), got {size}")
        return pb.PrepareStandbyResponse(standby_shm_name=self._standby(size, request.held_standby_shm_name))

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        # A replica of one object asks with block_keys, one stored per K/V head range with chains.
        chains = [(chain.fingerprint, chain.block_keys) for chain in request.chains] or [
            (request.fingerprint, request.block_keys)
        ]
        found = self.store.lookup_chains(chains, request.lease_ms, time.monotonic())
        lease = found.lease
        return pb.LookupResponse(
            blocks=found.blocks,
            tokens=found.tokens,
            segments=[
                pb.PrefixSegment(
                    key=segment.obj.key,
                    token_start=segment.token_start,
                    token_count=segment.token_count,
                    object_bytes=segment.obj.total_bytes,
                    chain=segment.chain,
                )
                for segment in found.segments
            ],
            lease_id=lease.lease_id if lease else "",
            capability=lease.capability if lease else "",  # the lease holder alone learns it, here
            lease_expires_unix_ms=_unix_ms(lease.expires) if lease else 0,
        )

    async def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteResponse:
        deleted = self.store.delete(request.key, request.capability)
        self._trim_pool()
        return pb.DeleteResponse(deleted=deleted)

    async def Stat(self, request: pb.StatRequest, context) -> pb.StatResponse:
        stats = self.store.stats()
        response = pb.StatResponse(
            **vars(stats),
            pooled_bytes=self.segments.pooled_bytes,
            shm_dir=str(self.segments.directory),
            shm_probe=self.segments.probe_name,
            standby_min_bytes=self._config.standby_min_bytes,
            standby_puts=self.segments.standby_puts,
            max_lease_ms=self.store.config.max_lease_ms,
            default_lease_ms=self.store.config.default_lease_ms,
        )
        # Counters are for anyone; an object's details only for a holder of its capability.
        obj = self.store.describe(request.key, request.capability) if request.key else None
        if obj is not None:
            response.object.CopyFrom(
                pb.ObjectStat(
                    key=obj.key,
                    total_bytes=obj.total_bytes,
                    pinned=obj.pinned,
                    readers=obj.readers,
                    fingerprint=obj.fingerprint,
                    lease_expires_unix_ms=_unix_ms(obj.lease_expires) if obj.pinned else 0,
                )
            )
        return response

    def close(self) -> None:
        """Drops every object and frees every segment (a standby still being prepared is unlinked when its
        preparation ends)."""
        self._background.shutdown(wait=False)
        self.store.clear()
        self.segments.close()

    def reap(self) -> int:
        """Reclaims objects whose lease ended (and ends expired prefix leases); returns how many objects."""
        expired = self.store.expire(time.monotonic())
        self._trim_pool()  # an ended prefix lease may have freed a deleted object
        if expired:
            self._trim_pool()
            log.info("lease expired", extra={"objects": expired})
        return expired


def _register(servicer: KvStoreServicer, server: grpc.aio.Server) -> None:
    """What the generated add_KvStoreServiceServicer_to_server does, except that Get may send chunks
    already encoded by wire.encode_chunk (one copy instead of three) and Put reads chunks as views of the
    received messages (wire.parse_chunk)."""
    handlers = {
        "Put": grpc.stream_stream_rpc_method_handler(
            servicer.Put, parse_with(pb.PutRequest), pb.PutResponse.SerializeToString
        ),
        "Get": grpc.stream_stream_rpc_method_handler(servicer.Get, pb.GetRequest.FromString, serialize),
        "Release": grpc.unary_unary_rpc_method_handler(
            servicer.Release, pb.ReleaseRequest.FromString, pb.ReleaseResponse.SerializeToString
        ),
        "Stat": grpc.unary_unary_rpc_method_handler(
            servicer.Stat, pb.StatRequest.FromString, pb.StatResponse.SerializeToString
        ),
        "Delete": grpc.unary_unary_rpc_method_handler(
            servicer.Delete, pb.DeleteRequest.FromString, pb.DeleteResponse.SerializeToString
        ),
        "Lookup": grpc.unary_unary_rpc_method_handler(
            servicer.Lookup, pb.LookupRequest.FromString, pb.LookupResponse.SerializeToString
        ),
        "PrepareStandby": grpc.unary_unary_rpc_method_handler(
            servicer.PrepareStandby,
            pb.PrepareStandbyRequest.FromString,
            pb.PrepareStandbyResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _register_metrics(store: KvStore, segments: SegmentStore) -> None:
    m = meter("pcpstack.kvstore")

    def gauge(field: str):
        def observe(_: CallbackOptions):
            return [Observation(getattr(store.stats(), field))]

        return observe

    for field, unit, description in (
        ("objects", "{object}", "committed objects held"),
        ("bytes", "By", "bytes held by committed objects"),
        ("pinned_bytes", "By", "bytes held by pinned objects"),
        ("reserved_bytes", "By", "bytes reserved by puts in progress"),
        ("prefix_blocks", "{block}", "content-addressed KV blocks the store can serve for prefix reuse"),
        ("prefix_leases", "{lease}", "prefix leases held"),
    ):
        m.create_observable_gauge(f"pcpstack.kvstore.{field}", [gauge(field)], unit, description)
    m.create_observable_gauge(
        "pcpstack.kvstore.cached_bytes",
        # Released objects stay until evicted, so a get of a retried key can still hit them.
        [lambda _: [Observation(_cached_bytes(store.stats()))]],
        "By",
        "bytes held by committed objects nobody has pinned (released, kept until evicted)",
    )
    m.create_observable_gauge(
        "pcpstack.kvstore.pooled_bytes",
        [lambda _: [Observation(segments.pooled_bytes)]],
        "By",
        "freed shared memory kept warm for reuse",
    )
    m.create_observable_counter(
        "pcpstack.kvstore.standby_puts",
        [lambda _: [Observation(segments.standby_puts)]],
        "{put}",
        "shared-memory puts that landed in the standby segment their writer had mapped ahead",
    )
    for field, unit, description in (
        ("evictions", "{object}", "objects evicted under memory pressure"),
        ("lease_expiries", "{object}", "objects reclaimed because their lease expired"),
        ("refused_puts", "{put}", "puts refused (capacity, duplicate key, bad data)"),
        ("aborted_puts", "{put}", "puts abandoned midway by their writer"),
        ("bytes_in", "By", "bytes received by committed puts"),
        ("bytes_out", "By", "bytes sent by gets"),
        ("prefix_blocks_queried", "{block}", "block keys asked for by prefix lookups"),
        ("prefix_blocks_hit", "{block}", "leading blocks prefix lookups found"),
    ):
        m.create_observable_counter(f"pcpstack.kvstore.{field}", [gauge(field)], unit, description)


def _cached_bytes(stats: StoreStats) -> int:
    """Committed bytes that are not pinned."""
    return stats.bytes - stats.pinned_bytes


class KvStoreServer:
    """A running KV store: gRPC server, core, segments and the lease reaper."""

    def __init__(self, running: RunningServer, servicer: KvStoreServicer, reaper: asyncio.Task):
        self.running = running
        self.servicer = servicer
        self._reaper = reaper

    @property
    def address(self) -> str:
        """host:port clients dial."""
        return self.running.address

    async def stop(self, grace: float | None = None) -> None:
        """Stops serving, then frees every segment."""
        try:
            await self.running.stop(grace)
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        finally:
            self.servicer.close()


async def serve(config: KvStoreServerConfig, options: ServerOptions | None = None) -> KvStoreServer:
    """Starts a KV store server (with its reaper) and returns it."""
    options = options or ServerOptions()
    segments = SegmentStore(config.shm_dir)
    store = KvStore(config.store_config(), on_free=segments.recycle)
    servicer = KvStoreServicer(store, segments, config, options.max_message_bytes - MESSAGE_OVERHEAD)
    if segments.reclaimed_orphans:
        log.warning("reclaimed segments of a dead store", extra={"segments": segments.reclaimed_orphans})
    try:
        running = await start_server(
            lambda server: _register(servicer, server),
            [SERVICE_NAME],
            options,
        )
    except BaseException:
        segments.close()
        raise
    _register_metrics(store, segments)

    async def reap_forever() -> None:
        while True:
            await asyncio.sleep(config.reap_interval_s)
            servicer.reap()

    return KvStoreServer(running, servicer, asyncio.create_task(reap_forever()))
