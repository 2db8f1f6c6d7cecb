"""Where to send work, asked of the registry: Resolve with one cache, answered as typed endpoints.

    resolver = Resolver("registry:7000")       # or several replicas: "registry-0:7000,registry-1:7000"
    found = await resolver.resolve()        # Resolution: prefill_sets, decode, kvstore
    ...
    await resolver.close()

Decode's set router, the gateway, prefill (its default KV store) and the CLI use it; nothing here registers.
Answers are reused for ttl_s. While the registry cannot be reached the last answer is served, and a registry
that is slow to answer (frozen, overloaded: its connection stays up, so every ask would wait out the whole
deadline) holds a caller for at most CACHED_WAIT_S: the ask goes on in the background, later callers share
it and, once it has run that long, get the last answer at once. Just after a
registry (re)start the registry may not have heard from every live node yet and says so (`warming`); an
endpoint list that is empty then is not believed: the last non-empty one is kept, so routing goes on from
the cached endpoints until the nodes are back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from pcpstack.common.channel import open_channel
from pcpstack.common.errors import ServiceError, Unavailable
from pcpstack.common.logs import ThrottledWarning
from pcpstack.common.rpc_errors import error_from_rpc
from pcpstack.registry.convert import resolution_from_proto
from pcpstack.registry.endpoints import Resolution
from pcpstack.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

# Reconnect quickly once a restarted registry listens again (gRPC's default backoff grows to minutes).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
_TRANSPORT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# Seconds a caller with a cached answer waits for the registry's fresh one (it answers in milliseconds).
CACHED_WAIT_S = 0.5


@dataclass(frozen=True)
class _Cached:
    fetched_at: float
    answer: Resolution


def _retrieved(task: asyncio.Task) -> None:
    """Marks an ask's failure as seen: the callers that gave up waiting for it were served the cache."""
    if not task.cancelled():
        task.exception()


def _kept_while_warming(fresh: Resolution, last: Resolution) -> Resolution:
    """A warming registry's answer, with each empty list replaced by the last known non-empty one."""
    return replace(
        fresh,
        prefill_sets=fresh.prefill_sets or last.prefill_sets,
        decode=fresh.decode or last.decode,
        kvstore=fresh.kvstore or last.kvstore,
    )


class Resolver:
    """The registry's Resolve, cached per model."""

    def __init__(
        self,
        address: str,
        *,
        ttl_s: float = 1.0,
        rpc_deadline_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._addresses = [a.strip() for a in address.split(",") if a.strip()]
        self.address = self._addresses[0]
        self._ttl_s = ttl_s
        self._rpc_deadline_s = rpc_deadline_s
        self._clock = clock
        self._cache: dict[str, _Cached] = {}
        # model -> (when the ask started, the ask): the one ask in flight for each model
        self._asking: dict[str, tuple[float, asyncio.Task[Resolution]]] = {}
        self._warnings = ThrottledWarning(log, interval_s=10.0)
        self._channel: grpc.aio.Channel | None = None
        self._stub: registry_pb2_grpc.RegistryServiceStub | None = None

    async def resolve(self, model: str = "", *, fresh: bool = False) -> Resolution:
        """Ready prefill sets (least loaded first), decode and KV store endpoints of `model` ("" = all).

        A cached answer younger than ttl_s is reused unless `fresh`. Otherwise the registry is asked (one ask
        at a time per model, shared); with an answer cached, a caller waits for it at most CACHED_WAIT_S from
        the ask's start and is served the cached one past that or when the registry cannot be reached. With
        none cached, raises Unavailable (or the kind the registry answered)."""
        now = self._clock()
        cached = self._cache.get(model)
        if cached is not None and not fresh and now - cached.fetched_at < self._ttl_s:
            return cached.answer
        asking, loop = self._asking.get(model), asyncio.get_running_loop()
        if asking is None or asking[1].done() or asking[1].get_loop() is not loop:
            task = loop.create_task(self._refresh(model), name="registry-resolve")
            task.add_done_callback(_retrieved)
            asking = self._asking[model] = (now, task)
        started, task = asking
        if cached is None:
            return await asyncio.shield(task)
        try:
            return await asyncio.wait_for(asyncio.shield(task), max(0.0, started + CACHED_WAIT_S - now))
        except (TimeoutError, ServiceError) as exc:
            error = "slow to answer" if isinstance(exc, TimeoutError) else exc.code
            self._warnings.warning(
                error,
                "registry unreachable; serving cached endpoints",
                extra={"age_s": round(now - cached.fetched_at, 1), "error": error},
            )
            return cached.answer

    async def _refresh(self, model: str) -> Resolution:
        """Asks the registry and caches its answer; raises Unavailable (nothing cached to fall back on) or the
        registry's error."""
        try:
            answer = await self._ask(model)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _TRANSPORT:
                raise Unavailable(
                    f"the registry at {self.address} is unreachable ({exc.code().name}) and no "
                    "endpoints are cached"
                ) from None
            raise error_from_rpc(exc) from None
        cached = self._cache.get(model)
        if answer.warming and cached is not None:
            answer = _kept_while_warming(answer, cached.answer)
        self._cache[model] = _Cached(self._clock(), answer)
        return answer

    async def _ask(self, model: str) -> Resolution:
        """Asks the registry in use; one that cannot answer (unreachable, or a replica while no other
        leads) passes the question to the next replica, each tried once."""
        request = registry_pb2.ResolveRequest(model=model)
        for _ in range(len(self._addresses) - 1):
            try:
                return await self._resolve_once(request)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _TRANSPORT:
                    raise
                await self._close_channel()
                next_index = (self._addresses.index(self.address) + 1) % len(self._addresses)
                self.address = self._addresses[next_index]
        return await self._resolve_once(request)

    async def _resolve_once(self, request: registry_pb2.ResolveRequest) -> Resolution:
        if self._stub is None:
            self._channel = open_channel(
                self.address, default_deadline=self._rpc_deadline_s, extra_options=CHANNEL_OPTIONS
            )
            self._stub = registry_pb2_grpc.RegistryServiceStub(self._channel)
        return resolution_from_proto(await self._stub.Resolve(request, timeout=self._rpc_deadline_s))

    async def close(self) -> None:
        """Closes the channel (a later resolve opens a new one); asks in flight end."""
        asks = [task for _, task in self._asking.values() if not task.done()]
        self._asking.clear()
        for task in asks:
            task.cancel()
        await asyncio.gather(*asks, return_exceptions=True)
        await self._close_channel()

    async def _close_channel(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = None
        self._stub = None
