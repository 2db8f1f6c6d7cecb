"""Choosing a ready PCP set for a request: routing policy over the registry resolver's typed answer.

The resolver owns the cache (and keeps the last endpoints while the registry is away or restarting); the
router only filters by KV fingerprint, skips sets that just failed, and picks the least loaded. Between
the resolver's refreshes it adds the requests it sent itself to each set's reported load, so a burst spreads
over the sets.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from pcpstack.common.errors import ServiceError
from pcpstack.registry.endpoints import PrefillEndpoint, Resolution

log = logging.getLogger(__name__)


class NoReadySet(RuntimeError):
    """No ready PCP set serves this model and KV layout."""


class SetRouter:
    """Least-loaded choice among the ready sets whose KV fingerprint matches this decode worker's."""

    def __init__(self, resolve: Callable[[], Awaitable[Resolution]], kv_fingerprint: str) -> None:
        """resolve is the resolver's (cached) Resolve, e.g. `Resolver.resolve`."""
        self._resolve = resolve
        self._fingerprint = kv_fingerprint
        self._in_flight: dict[str, int] = {}
        # set id -> the answer it was forgotten under; a newer answer brings the set back
        self._forgotten: dict[str, Resolution] = {}
        self._answer: Resolution | None = None

    async def choose(self, exclude: set[str] = frozenset()) -> PrefillEndpoint:
        """The least loaded ready set not in `exclude` (set ids); raises NoReadySet when there is none."""
        try:
            self._answer = await self._resolve()
        except ServiceError as exc:
            raise NoReadySet(f"no ready prefill set is known: {exc}") from None
        self._forgotten = {s: a for s, a in self._forgotten.items() if a is self._answer}
        skipped = set(exclude) | set(self._forgotten)
        choices = [
            s
            for s in self._answer.prefill_sets
            if s.kv_fingerprint == self._fingerprint and s.set_id not in skipped
        ]
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
        """Skips a set that failed until the resolver's next fresh answer says otherwise."""
        if self._answer is not None:
            self._forgotten[set_id] = self._answer
