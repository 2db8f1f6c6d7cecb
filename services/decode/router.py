"""Choosing a ready PCP set for a request.

The registry's Resolve answer is cached for a short time and kept when the registry cannot be reached, so
routing goes on from the last known endpoints while the registry restarts. Between refreshes the router
adds the requests it sent itself to each set's reported load, so a burst spreads over the sets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from pcpstack.v1 import registry_pb2

log = logging.getLogger(__name__)


class NoReadySet(RuntimeError):
    """No ready PCP set serves this model and KV layout."""


class SetRouter:
    """Least-loaded choice among the ready sets whose KV fingerprint matches this decode worker's."""

    def __init__(
        self,
        resolve: Callable[[], Awaitable[registry_pb2.ResolveResponse]],
        kv_fingerprint: str,
        ttl_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._resolve = resolve
        self._fingerprint = kv_fingerprint
        self._ttl = ttl_s
        self._clock = clock
        self._sets: list[registry_pb2.PrefillSetEndpoint] = []
        self._fetched_at = -float("inf")
        self._in_flight: dict[str, int] = {}

    async def _refresh(self) -> None:
        if self._clock() - self._fetched_at < self._ttl:
            return
        try:
            answer = await self._resolve()
        except Exception as exc:  # keep routing from the cache while the registry is away
            log.warning("resolve failed, routing from %d cached sets: %s", len(self._sets), exc)
            return
        self._sets = [s for s in answer.prefill_sets if s.kv_fingerprint == self._fingerprint]
        self._fetched_at = self._clock()

    async def choose(self, exclude: set[str] = frozenset()) -> registry_pb2.PrefillSetEndpoint:
        """The least loaded ready set not in `exclude` (set ids); raises NoReadySet when there is none."""
        await self._refresh()
        choices = [s for s in self._sets if s.set_id not in exclude]
        if not choices:
            raise NoReadySet(
                "no ready prefill set serves this model and KV layout"
                + (f" (tried {sorted(exclude)})" if exclude else "")
            )
        return min(choices, key=lambda s: (s.load + self._in_flight.get(s.set_id, 0), s.set_id))

    def started(self, set_id: str) -> None:
        """A request was sent to set_id."""
        self._in_flight[set_id] = self._in_flight.get(set_id, 0) + 1

    def finished(self, set_id: str) -> None:
        """A request sent to set_id has its answer."""
        self._in_flight[set_id] = max(self._in_flight.get(set_id, 0) - 1, 0)

    def forget(self, set_id: str) -> None:
        """Drops a set that failed until the next refresh says otherwise."""
        self._sets = [s for s in self._sets if s.set_id != set_id]
