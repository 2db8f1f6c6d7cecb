"""The decode workers the gateway sends work to: a fixed list, or the live ones the registry names.

Workers are taken in turn (a worker's load in the registry is only as fresh as its last heartbeat, too
stale to steer every request). A client (one gRPC channel) is kept per worker address.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pcpstack.common.channel import open_channel
from pcpstack.common.errors import ServiceError
from pcpstack.decode.client import DecodeClient
from pcpstack.gateway.errors import service_unavailable
from pcpstack.registry.client import Resolver

HEALTH_TIMEOUT_S = 2.0


class DecodePool:
    """Chooses a decode worker per request and reports whether any is serving."""

    def __init__(self, addresses: Sequence[str] = (), registry_address: str = "") -> None:
        """Give fixed addresses, a registry address, or both (the registry's workers are then added)."""
        if not addresses and not registry_address:
            raise ValueError("DecodePool needs decode addresses or a registry address")
        self._fixed = list(addresses)
        self._registry = Resolver(registry_address) if registry_address else None
        self._clients: dict[str, DecodeClient] = {}
        self._health_channels: dict[str, grpc.aio.Channel] = {}
        self._turn = itertools.count()

    async def addresses(self) -> list[str]:
        """Known decode workers; raises ApiError(503) when there is none."""
        found = list(self._fixed)
        if self._registry is not None:
            try:
                answer = await self._registry.resolve()
            except ServiceError as exc:
                if not found:
                    raise service_unavailable(f"{exc}; no decode worker is known") from None
            else:
                found += [w.address for w in answer.decode if w.address not in found]
        if not found:
            raise service_unavailable("no decode worker is registered")
        return found

    async def client(self) -> DecodeClient:
        """The client of the worker for the next request."""
        found = await self.addresses()
        address = found[next(self._turn) % len(found)]
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = DecodeClient(address)
        return client

    async def serving(self) -> list[str]:
        """The workers whose gRPC health check answers SERVING now."""
        try:
            found = await self.addresses()
        except Exception:
            return []
        answers = await asyncio.gather(*(self._is_serving(address) for address in found))
        return [address for address, ok in zip(found, answers, strict=True) if ok]

    async def _is_serving(self, address: str) -> bool:
        channel = self._health_channels.get(address)
        if channel is None:
            channel = self._health_channels[address] = open_channel(
                address, default_deadline=HEALTH_TIMEOUT_S
            )
        try:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="")
            )
        except grpc.aio.AioRpcError:
            return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        """Closes every channel."""
        for client in self._clients.values():
            await client.close()
        for channel in self._health_channels.values():
            await channel.close()
        if self._registry is not None:
            await self._registry.close()
