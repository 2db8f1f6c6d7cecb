"""Typed client of the KV store, used by prefill (put) and decode (get, release).

The client picks the transport itself: when the store's shared-memory probe is visible from this process
(same host, same /dev/shm) bytes go through a store-owned segment and gRPC carries only its name;
otherwise, or with prefer_shm=False, they stream in checksummed chunks (stream.py, the same rules the
store applies). Either way every byte is checked against CRC32C and a mismatch raises ChecksumMismatch.
Errors from the store arrive as the kinds of pcpstack.common.errors, refined to the store's own classes
where its status has one meaning (FingerprintMismatch, CapacityExceeded, ChecksumMismatch,
CapabilityDenied); NotFound, AlreadyExists and InvalidArgument as they are.

Capabilities: `put` returns the object's capability (in `StoredReplica`); the writer hands it to the one
reader it means to, who passes it to `get`, `release` and `delete`. Anyone may `stat` the store's counters;
an object's details need its capability.

Prefix reuse: `put(..., block_keys=...)` offers an object's full blocks by content key; `lookup` answers how
many leading blocks of a prompt the store holds, in which objects, under a prefix lease whose id and
capability read them (`get(..., lease_id=...)`) and end it (`release(lease_id, capability, lease=True)`).

Ranged reads: `get(..., ranges=[ByteRange(...)])` returns only the selected bytes (kvstore.ranges); the
store checksums the selection from its copy and the client verifies what it received against that, chunk
by chunk on the streaming path, over the bytes it copied on the shared-memory path.

Tensors: pass `tensor.numpy()` (or any C-contiguous buffer) to put; `torch.frombuffer(data, dtype=...)`
reads what get returns without a copy. What get returns is the reader's for as long as it (or anything made
from it) is alive; the client then reuses that memory for a later get (receive_pool_bytes, 0 for a fresh
buffer every time), which spares the kernel's zeroing of fresh pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from pcpstack.common.channel import open_channel
from pcpstack.common.errors import ServiceError
from pcpstack.common.rpc_errors import error_from_rpc
from pcpstack.common.server import DEFAULT_MAX_MESSAGE_BYTES
from pcpstack.kvstore.errors import (
    CapabilityDenied,
    CapacityExceeded,
    ChecksumMismatch,
    FingerprintMismatch,
    ProtocolError,
    StoreStalled,
)
from pcpstack.kvstore.ranges import ByteRange, ByteRepeat, selection_bytes
from pcpstack.kvstore.shm import (
    ReceiveBuffers,
    SegmentMaps,
    copy_with_crc,
    lower_thread_priority,
    reusable_for,
    shares_memory_with,
    to_thread_to_the_end,
)
from pcpstack.kvstore.stream import DEFAULT_CHUNK_BYTES, ChunkReceiver, ChunkSender, verify_object
from pcpstack.kvstore.wire import SERVICE_NAME, body_of, chunk_of, parse_with, serialize
from pcpstack.v1 import kvstore_pb2 as pb
from pcpstack.v1 import kvstore_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["ByteRange", "ByteRepeat", "KvStoreClient", "StoredReplica", "make_key"]

FINGERPRINT_KEY_CHARS = 16
DEFAULT_RECEIVE_POOL_BYTES = 512 << 20  # buffers of finished gets a client keeps for the next ones
# The longest a put's announcement (prepare_put) may take: a local store answers in milliseconds, and a
# prefill rank waits for it before its forward (its set's other ranks wait in the forward's collectives).
ANNOUNCE_TIMEOUT_S = 2.0
# Seconds one step of a call may wait on the store (an answer, a chunk taken or sent, a one-shot call): a
# store answers each at once, so past this it is frozen, overloaded or cut off, and the call fails
# Unavailable, however long the whole transfer may take.
STALL_S = 15.0


def make_key(request_id: str, fingerprint: str) -> str:
    """The store key of a request's KV replica: the request id plus a prefix of the layout fingerprint."""
    return f"{request_id}/{fingerprint[:FINGERPRINT_KEY_CHARS]}"


@dataclass(frozen=True)
class StoredReplica:
    """What a committed put tells its writer."""

    key: str
    total_bytes: int
    lease_expires_unix_ms: int
    # The object's read capability: a bearer secret, hence kept out of the repr (and so out of logs).
    capability: str = field(repr=False)


# The store raises exactly one error per these statuses, so the client can restore the precise class.
_STORE_ERRORS: dict[str, type[ServiceError]] = {
    kind.code: kind for kind in (FingerprintMismatch, CapacityExceeded, ChecksumMismatch, CapabilityDenied)
}


def _store_error(exc: grpc.aio.AioRpcError) -> ServiceError:
    """The store's error a failed call stands for (error_from_rpc's kind, refined where it is one class)."""
    error = error_from_rpc(exc)
    refined = _STORE_ERRORS.get(error.code)
    return refined(str(error)) if refined is not None else error


async def _end_stream(call) -> None:
    """Ends a reader/writer stream in any state without leaving a task behind.

    A call still running is cancelled. On a channel with interceptors grpc feeds `write`s to the call
    through a task that waits for the next write or the half-close; when the store ended the call first
    (a refusal), nothing else would wake that task, and it would be destroyed pending with its loop. The
    half-close wakes it (repeating one is harmless).
    """
    if not call.cancel():
        with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
            await call.done_writing()


def _as_bytes_view(data) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("data must be C-contiguous (call .contiguous() / np.ascontiguousarray first)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _prefetch_in_background(segments: SegmentMaps, name: str) -> None:
    """A standby's mapping, built at background priority: a reader of the object this writer just put
    (its decode worker, at once) gets the cores first."""
    lower_thread_priority()
    segments.prefetch(name)


class KvStoreClient:
    """Client of one KV store. Create inside a running event loop; `await close()` when done."""

    def __init__(
        self,
        address: str,
        *,
        prefer_shm: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        deadline_s: float = 60.0,
        receive_pool_bytes: int = DEFAULT_RECEIVE_POOL_BYTES,
        stall_s: float | None = None,
    ) -> None:
        if receive_pool_bytes < 0:
            raise ValueError(f"receive_pool_bytes must be >= 0 (0: no reuse), got {receive_pool_bytes}")
        self.address = address
        # Gets land in reused buffers once their readers drop them (shm.ReceiveBuffers): no page zeroing.
        self._buffers = ReceiveBuffers(receive_pool_bytes)
        self._prefer_shm = prefer_shm
        self._chunk_bytes = chunk_bytes
        self._stall_s = STALL_S if stall_s is None else stall_s
        self._channel = open_channel(
            address, default_deadline=deadline_s, max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES
        )
        self._stub = kvstore_pb2_grpc.KvStoreServiceStub(self._channel)
        # Put takes chunks already encoded by wire.encode_chunk straight from the caller's buffer.
        self._put = self._channel.stream_stream(
            f"/{SERVICE_NAME}/Put",
            request_serializer=serialize,
            response_deserializer=pb.PutResponse.FromString,
        )
        # Get reads chunks as views of the received messages (wire.parse_chunk), not copies.
        self._get = self._channel.stream_stream(
            f"/{SERVICE_NAME}/Get",
            request_serializer=pb.GetRequest.SerializeToString,
            response_deserializer=parse_with(pb.GetResponse),
        )
        self._shm_dir: str | None = None  # the store's segment directory once known to be shared, else ""
        self._segments: SegmentMaps | None = None  # kept mappings of the store's segments, when shared
        # The standby segment the store named after this client's last shared-memory put, mapped on a
        # thread of its own (SegmentMaps.prefetch) and named back in the next put's header.
        self.standby_shm_name = ""
        self._standby_on_request = False  # set by prepare_put: standbys come from it, not from puts
        self._standby_min_bytes = 0  # the store's (Stat): smaller puts get no standby
        self._last_put_bytes = 0
        self._prefetching: threading.Thread | None = None

    async def close(self) -> None:
        """Closes the channel and drops the mappings of the store's segments."""
        if self._segments is not None:
            self._segments.close()
        self._buffers.close()
        await self._channel.close()

    async def __aenter__(self) -> KvStoreClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def uses_shm(self) -> bool:
        """Whether this client moves bytes through shared memory (asks the store once)."""
        if self._shm_dir is None:
            if not self._prefer_shm:
                self._shm_dir = ""
            else:
                stat = await self.stat()
                self._shm_dir = stat.shm_dir if shares_memory_with(stat.shm_dir, stat.shm_probe) else ""
                self._standby_min_bytes = stat.standby_min_bytes
                if self._shm_dir:
                    self._segments = SegmentMaps(self._shm_dir)
        return bool(self._shm_dir)

    async def put(
        self,
        key: str,
        fingerprint: str,
        data,
        lease_ms: int = 0,
        metadata: bytes = b"",
        block_keys: Sequence[str] = (),
        block_tokens: int = 0,
    ) -> StoredReplica:
        """Stores data (bytes or any C-contiguous buffer, or a list of them: the object is their bytes one
        after another) under key, pinned for lease_ms (0: the store's default; more than its cap is refused
        with InvalidArgument). The result carries the capability its reader must present. block_keys: the
        content keys of the object's full blocks of block_tokens tokens each, offered for prefix reuse
        (kvstore.prefix)."""
        use_shm = await self.uses_shm()
        if isinstance(data, list):
            pieces = [_as_bytes_view(piece) for piece in data]
            # The shared-memory path writes the pieces where they are; the stream sends one buffer: a lone
            # piece as it is, several joined once.
            if use_shm:
                view = pieces
            elif len(pieces) == 1:
                view = pieces[0]
            else:
                view = memoryview(b"".join(pieces))
            total_bytes = sum(piece.nbytes for piece in pieces)
        else:
            view = _as_bytes_view(data)
            total_bytes = view.nbytes
        header = pb.PutHeader(
            key=key,
            fingerprint=fingerprint,
            total_bytes=total_bytes,
            chunk_size=self._chunk_bytes,
            lease_ms=lease_ms,
            metadata=metadata,
            use_shm=use_shm,
            block_keys=block_keys,
            block_tokens=block_tokens,
            standby_shm_name=self.standby_shm_name if use_shm else "",
            standby_on_request=use_shm and self._standby_on_request and not self._size_repeats(total_bytes),
        )
        self._last_put_bytes = total_bytes
        call = self._put()
        try:
            await self._step(call.write(pb.PutRequest(header=header)), "the put's header")
            accepted = await self._step(self._read(call, "accepted"), "the put's acceptance")
            if use_shm:
                crc = 0
                if accepted.accepted.shm_name:
                    # Cancelled, it ends its fill before _end_stream lets the store reuse the segment.
                    crc = await to_thread_to_the_end(self._segments.fill, accepted.accepted.shm_name, view)
            else:
                crc = await self._send_chunks(call, view)
            await self._step(call.write(pb.PutRequest(commit=pb.PutCommit(crc32c=crc))), "the put's commit")
            await self._step(call.done_writing(), "the put's end")
            committed = (await self._step(self._read(call, "committed"), "the put's commit")).committed
            if use_shm:
                self._prefetch(committed.standby_shm_name)
            # Read to the end of the stream so the call (and its trace span) completes rather than being cut.
            await self._step(call.read(), "the put's end")
            return StoredReplica(
                committed.key, committed.total_bytes, committed.lease_expires_unix_ms, committed.capability
            )
        except grpc.aio.AioRpcError as exc:
            raise _store_error(exc) from exc
        finally:
            await _end_stream(call)

    def _size_repeats(self, size: int) -> bool:
        """Whether a put of size bytes repeats the size of the one before it (each within the slack of a
        standby sized for the other, shm.reusable_for): then the next is likely that size again, and
        even a writer that announces its puts asks the store for a standby of it after this put (between
        the puts, rather than during the forward that announces the next one; the announcement then finds
        it held)."""
        small, large = sorted((size, self._last_put_bytes))
        return small >= self._standby_min_bytes > 0 and reusable_for(large, small)

    async def prepare_put(self, size: int, timeout_s: float = ANNOUNCE_TIMEOUT_S) -> str:
        """Tells the store the size of this writer's next put before it has the bytes (a prefill rank, as
        its forward starts): on the shared-memory path the store readies a standby segment of that size,
        which this client maps on a thread of its own meanwhile, so that the put lands in mapped pages
        even when its size is unlike the last put's. From the first call that asks the store (a size of
        at least its standby_min_bytes), it readies this writer's standbys only when asked, or after a
        put whose size repeats the one before it (_size_repeats). Returns the
        standby's name, "" for none. A hint: one that fails or takes over timeout_s (an older store, a
        frozen one, a broken channel) is logged and changes nothing, the put still works."""
        try:
            return await asyncio.wait_for(self._prepare_put(size), timeout_s)
        except (ServiceError, TimeoutError) as exc:
            log.info("the KV store readied no standby for a put of %d bytes: %r", size, exc)
            return ""

    async def _prepare_put(self, size: int) -> str:
        if not await self.uses_shm() or not self._standby_min_bytes or size < self._standby_min_bytes:
            return ""  # no standby would come: not worth a call (the store names none after puts either)
        self._standby_on_request = True
        request = pb.PrepareStandbyRequest(size_bytes=size, held_standby_shm_name=self.standby_shm_name)
        name = (await self._unary(self._stub.PrepareStandby, request)).standby_shm_name
        self._prefetch(name)
        return name

    def _prefetch(self, name: str) -> None:
        """Maps the standby segment the store named, on a thread of its own (not this loop's: a writer may
        run its loop only while it puts), unless it is the one mapped last time."""
        if name and name != self.standby_shm_name and self._segments is not None:
            prefetch = threading.Thread(
                target=_prefetch_in_background,
                args=(self._segments, name),
                name="kv-standby-map",
                daemon=True,
            )
            prefetch.start()
            self._prefetching = prefetch
        self.standby_shm_name = name

    def wait_for_standby(self, timeout: float | None = None) -> None:
        """Blocks until the standby segment's mapping is built (for tests and benchmarks that measure a
        put without it)."""
        if self._prefetching is not None:
            self._prefetching.join(timeout)

    async def _send_chunks(self, call, view: memoryview) -> int:
        sender = ChunkSender(view.nbytes, self._chunk_bytes)
        for offset, length in sender.spans():
            await self._step(call.write(sender.encode(offset, view[offset : offset + length])), "a chunk")
        return sender.crc32c

    @staticmethod
    async def _read(call, expected: str):
        message = await call.read()
        if message is grpc.aio.EOF:
            # The store ended the stream without a status error: a protocol break, not a refusal.
            raise ProtocolError(f"store ended the stream where {expected} was expected")
        if body_of(message) != expected:
            raise ProtocolError(f"store sent {body_of(message)} where {expected} was expected")
        return message

    async def get(
        self,
        key: str,
        fingerprint: str,
        capability: str,
        ranges: Sequence[ByteRange] = (),
        lease_id: str = "",
    ) -> tuple[memoryview, bytes]:
        """The object's bytes (a writable buffer torch.frombuffer can wrap) and its metadata; with ranges,
        only the bytes they select, range after range (each range's pieces in row-major order). With
        lease_id, the object is read through that prefix lease and capability is the lease's.

        Raises CapabilityDenied without the object's capability, ChecksumMismatch when the bytes do not
        match their CRC32C, FingerprintMismatch when the object was written with another fingerprint,
        NotFound when there is no such object, InvalidArgument naming the field for a bad range.
        """
        use_shm = await self.uses_shm()
        ranges = list(ranges)
        request = pb.GetRequest(
            key=key,
            fingerprint=fingerprint,
            max_chunk_size=self._chunk_bytes,
            accept_shm=use_shm,
            capability=capability,
            ranges=[r.to_wire() for r in ranges],
            lease_id=lease_id,
        )
        call = self._get()
        try:
            await self._step(call.write(request), "the get's request")
            header = (await self._step(self._read(call, "header"), "the get's header")).header
            if ranges and header.selected_bytes != selection_bytes(ranges):
                raise ProtocolError(
                    f"store announced {header.selected_bytes} selected bytes of {key!r}; the ranges asked "
                    f"select {selection_bytes(ranges)}"
                )
            # A ranged read is checked against the selection's CRC32C, a whole one against the object's.
            size, announced = (
                (header.selected_bytes, header.selected_crc32c)
                if ranges
                else (header.total_bytes, header.crc32c)
            )
            if header.shm_name:
                try:
                    data = self._buffers.take(size)
                    if ranges:
                        crc = await to_thread_to_the_end(
                            self._segments.copy_ranges, header.shm_name, header.total_bytes, ranges, data
                        )
                    else:
                        crc = await to_thread_to_the_end(self._segments.copy_out, header.shm_name, data)
                finally:
                    # The half-close: the store may reuse the segment now (the copy ended, even if cancelled).
                    await call.done_writing()
                verify_object(key, crc, announced, "the store")
            else:
                await call.done_writing()
                data = await self._receive_chunks(call, key, size, header.chunk_size, announced)
            return data, header.metadata
        except grpc.aio.AioRpcError as exc:
            raise _store_error(exc) from exc
        finally:
            await _end_stream(call)

    async def _receive_chunks(
        self, call, key: str, size: int, chunk_size: int, announced_crc: int
    ) -> memoryview:
        data = self._buffers.take(size)

        def copy(offset: int, chunk: memoryview) -> int:
            return copy_with_crc(data[offset : offset + len(chunk)], [chunk])

        receiver = ChunkReceiver(key, size, chunk_size, copy, malformed=ProtocolError)
        while (message := await self._step(call.read(), "a chunk")) is not grpc.aio.EOF:
            if body_of(message) != "chunk":
                raise ProtocolError(f"store sent {body_of(message)} among the chunks of {key!r}")
            receiver.add(chunk_of(message))
        receiver.finish(announced_crc, "the store")
        return data

    async def release(self, key: str, capability: str, lease: bool = False) -> bool:
        """Unpins key (with lease, ends the prefix lease named key): True if this call released it, False if
        it already was (harmless)."""
        request = pb.ReleaseRequest(key=key, capability=capability, lease=lease)
        return (await self._unary(self._stub.Release, request)).released

    async def lookup(
        self,
        block_keys: Sequence[str],
        fingerprint: str,
        lease_ms: int = 0,
        chains: Sequence[tuple[str, Sequence[str]]] = (),
    ) -> pb.LookupResponse:
        """How many leading blocks of block_keys the store holds and where; a hit comes with a prefix lease
        (lease_id, capability) pinning them for lease_ms (0: the store's default) until released. chains:
        (fingerprint, block keys) of each object of a replica stored per K/V head range, instead of
        block_keys and fingerprint: the hit is the run all of them hold."""
        request = pb.LookupRequest(
            block_keys=block_keys,
            fingerprint=fingerprint,
            lease_ms=lease_ms,
            chains=[pb.BlockChain(fingerprint=fp, block_keys=keys) for fp, keys in chains],
        )
        return await self._unary(self._stub.Lookup, request)

    async def delete(self, key: str, capability: str) -> bool:
        """Removes key now; False if it did not exist."""
        request = pb.DeleteRequest(key=key, capability=capability)
        return (await self._unary(self._stub.Delete, request)).deleted

    async def stat(self, key: str = "", capability: str = "") -> pb.StatResponse:
        """The store's gauges and counters, and key's state when given, present and capability is its own."""
        return await self._unary(self._stub.Stat, pb.StatRequest(key=key, capability=capability))

    async def _unary(self, method, request):
        try:
            return await method(request, timeout=self._stall_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise self._stalled(type(request).__name__.removesuffix("Request")) from exc
            raise _store_error(exc) from exc

    async def _step(self, awaitable, what: str):
        """awaitable (one step of a stream) if the store takes or answers it within stall_s; Unavailable
        naming the store and the step if not."""
        try:
            async with asyncio.timeout(self._stall_s):  # no task per step, unlike wait_for (27 us a chunk)
                return await awaitable
        except TimeoutError:
            raise self._stalled(what) from None

    def _stalled(self, what: str) -> StoreStalled:
        return StoreStalled(
            f"the KV store at {self.address} did not answer within {self._stall_s:g} s ({what}): it is "
            "frozen, overloaded or cut off"
        )
