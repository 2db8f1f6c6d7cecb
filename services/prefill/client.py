"""Typed client of the Prefill service, used by decode workers."""

from __future__ import annotations

import grpc

from pcpstack.common.channel import open_channel
from pcpstack.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc


class PrefillClient:
    """Calls Prefill on one PCP set's master."""

    def __init__(self, address: str, default_deadline: float = 300.0) -> None:
        self.address = address
        self._channel = open_channel(address, default_deadline=default_deadline)
        self._stub = prefill_pb2_grpc.PrefillServiceStub(self._channel)

    async def prefill(
        self, request_id: str, token_ids: list[int], sampling: common_pb2.SamplingParams, **options: object
    ) -> prefill_pb2.PrefillResponse:
        """Prefills one prompt (options as start_prefill's); raises grpc.aio.AioRpcError with the service's
        status on failure."""
        return await self.start_prefill(request_id, token_ids, sampling, **options)

    def start_prefill(
        self,
        request_id: str,
        token_ids: list[int],
        sampling: common_pb2.SamplingParams,
        *,
        kvstore_address: str = "",
        kv_lease_ms: int = 0,
        expected_fingerprint: str = "",
        no_prefix_cache: bool = False,
        cache_salt: str = "",
        abandon_token: str = "",
        timeout: float | None = None,
    ) -> grpc.aio.UnaryUnaryCall:
        """The Prefill call, started: awaiting it gives the response. Its `cancel()` says whether it
        cancelled anything (False: the call had already ended; an answer names a replica to release).
        no_prefix_cache: the caller cannot load a cached prefix; cache_salt: the request's cache salt;
        abandon_token: a secret for `abandon`, should the answer never be taken in."""
        request = prefill_pb2.PrefillRequest(
            request_id=request_id,
            token_ids=token_ids,
            sampling=sampling,
            kvstore_address=kvstore_address,
            kv_lease_ms=kv_lease_ms,
            expected_fingerprint=expected_fingerprint,
            no_prefix_cache=no_prefix_cache,
            cache_salt=cache_salt,
            abandon_token=abandon_token,
        )
        return self._stub.Prefill(request, timeout=timeout)

    async def abandon(self, abandon_token: str, timeout: float = 10.0) -> bool:
        """Has the set delete the replica of the Prefill that carried `abandon_token`, whose answer was never
        taken in; whether there was one to delete."""
        request = prefill_pb2.AbandonRequest(abandon_token=abandon_token)
        return (await self._stub.Abandon(request, timeout=timeout)).deleted

    async def close(self) -> None:
        """Closes the channel."""
        await self._channel.close()
