"""Typed client of the KV store, used by prefill (put) and decode (get, release).

The client picks the transport itself: when the store's shared-memory probe is visible from this process
(same host, same /dev/shm) bytes go through a store-owned segment and gRPC carries only its name;
otherwise, or with prefer_shm=False, they stream in checksummed chunks. Either way every byte is checked
against CRC32C and a mismatch raises ChecksumMismatch. Errors from the store arrive as the classes of
pcpstack.kvstore.errors (NotFound, AlreadyExists, FingerprintMismatch, CapacityExceeded, ...).

Tensors: pass `tensor.numpy()` (or any C-contiguous buffer) to put; `torch.frombuffer(data, dtype=...)`
reads what get returns without a copy.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from pcpstack.common.channel import open_channel
from pcpstack.common.server import DEFAULT_MAX_MESSAGE_BYTES
from pcpstack.kvstore.checksum import crc32c, crc32c_combine
from pcpstack.kvstore.errors import ChecksumMismatch, KvStoreError, error_for_code
from pcpstack.kvstore.server import DEFAULT_CHUNK_BYTES, SERVICE_NAME
from pcpstack.kvstore.shm import anonymous_buffer, copy_segment, fill_segment, shares_memory_with
from pcpstack.kvstore.wire import encode_chunk, serialize
from pcpstack.v1 import kvstore_pb2 as pb
from pcpstack.v1 import kvstore_pb2_grpc

FINGERPRINT_KEY_CHARS = 16


def make_key(request_id: str, fingerprint: str) -> str:
    """The store key of a request's KV replica: the request id plus a prefix of the layout fingerprint."""
    return f"{request_id}/{fingerprint[:FINGERPRINT_KEY_CHARS]}"


def _as_bytes_view(data) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("data must be C-contiguous (call .contiguous() / np.ascontiguousarray first)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class KvStoreClient:
    """Client of one KV store. Create inside a running event loop; `await close()` when done."""

    def __init__(
        self,
        address: str,
        *,
        prefer_shm: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        deadline_s: float = 60.0,
    ) -> None:
        self.address = address
        self._prefer_shm = prefer_shm
        self._chunk_bytes = chunk_bytes
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
        self._shm_dir: str | None = None  # the store's segment directory once known to be shared, else ""

    async def close(self) -> None:
        """Closes the channel."""
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
        return bool(self._shm_dir)

    async def put(
        self, key: str, fingerprint: str, data, lease_ms: int = 0, metadata: bytes = b""
    ) -> pb.PutCommitted:
        """Stores data (bytes or any C-contiguous buffer) under key, pinned for lease_ms (0: the default)."""
        view = _as_bytes_view(data)
        use_shm = await self.uses_shm()
        header = pb.PutHeader(
            key=key,
            fingerprint=fingerprint,
            total_bytes=view.nbytes,
            chunk_size=self._chunk_bytes,
            lease_ms=lease_ms,
            metadata=metadata,
            use_shm=use_shm,
        )
        call = self._put()
        try:
            await call.write(pb.PutRequest(header=header))
            accepted = await self._read(call, "accepted")
            if use_shm:
                crc = 0
                if accepted.accepted.shm_name:
                    crc = await asyncio.to_thread(
                        fill_segment, self._shm_dir, accepted.accepted.shm_name, view
                    )
            else:
                crc = await self._send_chunks(call, view)
            await call.write(pb.PutRequest(commit=pb.PutCommit(crc32c=crc)))
            await call.done_writing()
            committed = (await self._read(call, "committed")).committed
            # Read to the end of the stream so the call (and its trace span) completes rather than being cut.
            await call.read()
            return committed
        except grpc.aio.AioRpcError as exc:
            raise error_for_code(exc.code().name, exc.details() or "") from exc
        finally:
            call.cancel()  # no-op once finished; stops the stream if anything above failed

    async def _send_chunks(self, call, view: memoryview) -> int:
        crc = 0
        for offset in range(0, view.nbytes, self._chunk_bytes):
            data = view[offset : offset + self._chunk_bytes]
            chunk_crc = crc32c(data)
            await call.write(encode_chunk(offset, data, chunk_crc))
            crc = crc32c_combine(crc, chunk_crc, len(data))
        return crc

    @staticmethod
    async def _read(call, expected: str):
        message = await call.read()
        if message is grpc.aio.EOF:
            raise error_for_code((await call.code()).name, await call.details())
        if message.WhichOneof("body") != expected:
            raise KvStoreError(f"store sent {message.WhichOneof('body')} where {expected} was expected")
        return message

    async def get(self, key: str, fingerprint: str) -> tuple[memoryview, bytes]:
        """The object's bytes (a writable buffer torch.frombuffer can wrap) and its metadata.

        Raises ChecksumMismatch when the bytes do not match their CRC32C, FingerprintMismatch when the
        object was written with another fingerprint, NotFound when there is no such object.
        """
        use_shm = await self.uses_shm()
        request = pb.GetRequest(
            key=key, fingerprint=fingerprint, max_chunk_size=self._chunk_bytes, accept_shm=use_shm
        )
        requests = _Requests(request)
        call = self._stub.Get(requests)
        try:
            header = (await self._read(call, "header")).header
            if header.shm_name:
                try:
                    data, crc = await asyncio.to_thread(
                        copy_segment, self._shm_dir, header.shm_name, header.total_bytes
                    )
                finally:
                    requests.finish()
            else:
                requests.finish()
                data, crc = await self._receive_chunks(call, header.total_bytes)
            if crc != header.crc32c:
                raise ChecksumMismatch(
                    f"object {key!r} read back with CRC32C {crc:#010x}; "
                    f"the store recorded {header.crc32c:#010x}"
                )
            return data, header.metadata
        except grpc.aio.AioRpcError as exc:
            raise error_for_code(exc.code().name, exc.details() or "") from exc
        finally:
            call.cancel()

    async def _receive_chunks(self, call, total_bytes: int) -> tuple[memoryview, int]:
        data = anonymous_buffer(total_bytes)
        received = 0
        crc = 0
        async for message in call:
            chunk = message.chunk
            if message.WhichOneof("body") != "chunk" or chunk.offset != received:
                raise KvStoreError(f"store sent an out-of-order message at offset {received}")
            chunk_crc = crc32c(chunk.data)
            if chunk_crc != chunk.crc32c:
                raise ChecksumMismatch(
                    f"chunk at offset {chunk.offset} has CRC32C {chunk_crc:#010x}, "
                    f"message says {chunk.crc32c:#010x}"
                )
            data[received : received + len(chunk.data)] = chunk.data
            received += len(chunk.data)
            crc = crc32c_combine(crc, chunk_crc, len(chunk.data))
        if received != total_bytes:
            raise KvStoreError(f"store sent {received} bytes of {total_bytes}")
        return data, crc

    async def release(self, key: str) -> bool:
        """Unpins key: True if this call released it, False if it already was (harmless)."""
        return (await self._unary(self._stub.Release, pb.ReleaseRequest(key=key))).released

    async def delete(self, key: str) -> bool:
        """Removes key now; False if it did not exist."""
        return (await self._unary(self._stub.Delete, pb.DeleteRequest(key=key))).deleted

    async def stat(self, key: str = "") -> pb.StatResponse:
        """The store's gauges and counters, and key's state when given and present."""
        return await self._unary(self._stub.Stat, pb.StatRequest(key=key))

    @staticmethod
    async def _unary(method, request):
        try:
            return await method(request)
        except grpc.aio.AioRpcError as exc:
            raise error_for_code(exc.code().name, exc.details() or "") from exc


class _Requests:
    """The reader's side of a Get: one request, then held open until finish() (the half-close)."""

    def __init__(self, request: pb.GetRequest) -> None:
        self._request = request
        self._done = asyncio.Event()

    def finish(self) -> None:
        """Half-closes the stream: the reader no longer needs the store's segment."""
        self._done.set()

    async def __aiter__(self) -> AsyncIterator[pb.GetRequest]:
        yield self._request
        await self._done.wait()
