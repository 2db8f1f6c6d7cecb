"""The decode workers the gateway sends work to: a fixed list, or the live ones the registry names.

Each Generate call goes to the least-loaded healthy worker. Load is the gateway's own count of calls in
flight on the worker (fresh, but blind to other gateways) plus the load the registry last heard in the
worker's heartbeat (seen by every gateway, but only as fresh as that heartbeat); ties go to the worker used
least recently, so idle workers share the work in turn. A worker whose call failed UNAVAILABLE is taken as
unhealthy for UNHEALTHY_FOR_S and chosen only when nothing else is left. When a worker fails UNAVAILABLE
before it sent anything, or refuses the request because it holds its --max-requests already (BUSY), the
call is made again on another worker: the client has seen nothing yet, so no answer is duplicated; when
none served and any was busy the client gets a busy refusal, a 429. Once a token was sent a failure is the
client's to see.

A client (one gRPC channel) is kept per worker address.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pcpstack.common.channel import open_channel
from pcpstack.common.errors import ServiceError
from pcpstack.decode.client import BUSY, DecodeClient
from pcpstack.gateway.errors import ApiError, error_from_rpc, service_unavailable
from pcpstack.registry.client import Resolver
from pcpstack.v1 import decode_pb2

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 2.0
# How long a worker that failed UNAVAILABLE is passed over.
UNHEALTHY_FOR_S = 5.0


@dataclass(frozen=True)
class Candidate:
    """A decode worker as the choice sees it."""

    address: str
    in_flight: int
    registry_load: int
    unhealthy: bool
    last_used: int


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    """The healthy worker with the least load (in flight here, then the registry's), least recently used
    first among equals; an unhealthy one only when no healthy one is left."""
    if not candidates:
        raise ValueError("no candidate")
    return min(candidates, key=lambda c: (c.unhealthy, c.in_flight + c.registry_load, c.last_used))


def _busy(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the worker refused the request only because it holds its --max-requests already."""
    return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (exc.details() or "").startswith(BUSY)


class DecodePool:
    """Chooses a decode worker per call, retries refused starts elsewhere, reports whether any is serving."""

    def __init__(
        self,
        addresses: Sequence[str] = (),
        registry_address: str = "",
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Give fixed addresses, a registry address, or both (the registry's workers are then added)."""
        if not addresses and not registry_address:
            raise ValueError("DecodePool needs decode addresses or a registry address")
        self._fixed = list(addresses)
        self._registry = Resolver(registry_address) if registry_address else None
        self._clients: dict[str, DecodeClient] = {}
        self._health_channels: dict[str, grpc.aio.Channel] = {}
        self._in_flight: Counter[str] = Counter()
        self._failed_at: dict[str, float] = {}
        self._last_used: dict[str, int] = {}
        self._uses = itertools.count(1)
        self._clock = clock

    async def workers(self) -> dict[str, int]:
        """Known decode workers and their registry load (0 for --decode ones the registry does not name);
        raises ApiError(503) when there is none."""
        found = dict.fromkeys(self._fixed, 0)
        if self._registry is not None:
            try:
                answer = await self._registry.resolve()
            except ServiceError as exc:
                if not found:
                    raise service_unavailable(f"{exc}; no decode worker is known") from None
            else:
                found.update({w.address: w.load for w in answer.decode})
        if not found:
            raise service_unavailable("no decode worker is registered")
        return found

    async def addresses(self) -> list[str]:
        """Known decode workers; raises ApiError(503) when there is none."""
        return list(await self.workers())

    def _choose(self, workers: Mapping[str, int], tried: set[str]) -> str | None:
        now = self._clock()
        candidates = [
            Candidate(
                address,
                self._in_flight[address],
                load,
                now - self._failed_at.get(address, -UNHEALTHY_FOR_S) < UNHEALTHY_FOR_S,
                self._last_used.get(address, 0),
            )
            for address, load in workers.items()
            if address not in tried
        ]
        if not candidates:
            return None
        chosen = least_loaded(candidates).address
        self._last_used[chosen] = next(self._uses)
        return chosen

    def _client(self, address: str) -> DecodeClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = DecodeClient(address)
        return client

    async def generate(
        self, request: decode_pb2.GenerateRequest, timeout: float | None
    ) -> AsyncGenerator[decode_pb2.GenerateResponse, None]:
        """The Generate stream of the least-loaded worker, with gRPC failures as ApiError. A worker that
        fails UNAVAILABLE or busy before its first message is replaced by another one, each tried once.
        Closing the iterator cancels the call."""
        tried: set[str] = set()
        workers = await self.workers()
        refused_busy: ApiError | None = None  # overload, not a fault, is what the client hears if any said so
        while True:
            address = self._choose(workers, tried)
            if address is None:  # unreachable: the loop only continues while an untried worker is left
                raise service_unavailable("no decode worker is left to try")
            tried.add(address)
            call = self._client(address).stream(request, timeout=timeout)
            self._in_flight[address] += 1
            sent = False
            try:
                async for message in call:
                    sent = True
                    yield message
                self._failed_at.pop(address, None)
                return
            except grpc.aio.AioRpcError as exc:
                error = self._failure(address, exc)
                busy = _busy(exc)
                elsewhere = busy or exc.code() == grpc.StatusCode.UNAVAILABLE
                if busy:
                    refused_busy = error
                if not elsewhere or sent:
                    raise error from None
                if len(tried) == len(workers):
                    raise (refused_busy or error) from None
                if busy:  # an overloaded deployment says so for every request: not a warning each time
                    log.info("decode worker busy; trying another", extra={"worker": address})
                else:
                    log.warning(
                        "decode worker unavailable before its first token; trying another",
                        extra={"worker": address, "error": exc.details()},
                    )
            finally:
                self._in_flight[address] -= 1
                call.cancel()  # a no-op once finished; stops decode when the client went away

    def _failure(self, address: str, exc: grpc.aio.AioRpcError) -> ApiError:
        details = exc.details() or ""
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self._failed_at[address] = self._clock()
            details = f"decode worker at {address}: {details}"
        return error_from_rpc(exc.code(), details)

    def in_flight(self) -> dict[str, int]:
        """Generate calls this gateway has running, per worker that has any."""
        return {address: count for address, count in self._in_flight.items() if count}

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
