"""Choosing a ready PCP set and a KV store for a request: routing policy over the registry resolver's typed
answer.

The resolver owns the cache (and keeps the last endpoints while the registry is away or restarting); the
router only filters by KV fingerprint, skips sets that just failed, and picks the least loaded. Between
the resolver's refreshes it adds the requests it sent itself to each set's reported load, so a burst spreads
over the sets.

The store a request's replica goes to (`pick_store`): the live store on this decode worker's own host when
there is one, since a same-host store moves bytes through shared memory; else the least loaded live store.
A host is the host part of a node's advertised address (ServiceEndpoint.host), so nodes that advertise one
address share memory and, in the cross-host tests, each network namespace is a host. A store that failed a
request is skipped like a failed set, and one that died leaves the registry's answer when its lease runs out.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping

from pcpstack.common.errors import ServiceError
from pcpstack.registry.endpoints import PrefillEndpoint, Resolution, ServiceEndpoint

log = logging.getLogger(__name__)


class NoReadySet(RuntimeError):
    """No ready PCP set serves this model and KV layout."""


def pick_store(
    stores: Iterable[ServiceEndpoint], host: str, in_flight: Mapping[str, int], skipped: Collection[str] = ()
) -> ServiceEndpoint | None:
    """The store for a replica written for a decode worker on `host`: among stores not in `skipped`
    (addresses), those on `host` if any, else all; of them the least loaded counting `in_flight` (requests
    sent per store address), ties to the lowest node_id. None when no store is left."""
    live = [store for store in stores if store.address not in skipped]
    local = [store for store in live if host and store.host == host]
    return min(
        local or live,
        key=lambda store: (store.load + in_flight.get(store.address, 0), store.node_id),
        default=None,
    )


class SetRouter:
    """Least-loaded choice among the ready sets whose KV fingerprint matches this decode worker's, and the
    store for each request's replica (pick_store)."""

    def __init__(
        self, resolve: Callable[[], Awaitable[Resolution]], kv_fingerprint: str, host: str = ""
    ) -> None:
        """resolve is the resolver's (cached) Resolve, e.g. `Resolver.resolve`; host is the host part of this
        decode worker's advertised address ("": no store counts as local)."""
        self._resolve = resolve
        self._fingerprint = kv_fingerprint
        self._host = host
        # set id or store address -> requests sent there that have no answer yet
        self._in_flight: dict[str, int] = {}
        # set id or store address -> the answer it was forgotten under; a newer answer brings it back
        self._forgotten: dict[str, Resolution] = {}
        self._answer: Resolution | None = None

    async def choose(self, exclude: set[str] = frozenset()) -> PrefillEndpoint:
        """The least loaded ready set not in `exclude` (set ids); raises NoReadySet when there is none.

        A set that failed lately (`forget`) is taken only when no other is ready: a dead set leaves the
        registry's answer within its lease and a request to it fails fast meanwhile, whereas skipping the
        only set would refuse every request while it is merely suspected (a request fails UNAVAILABLE when
        its set or its store fails, and which one failed is not told apart)."""
        try:
            self._answer = await self._resolve()
        except ServiceError as exc:
            raise NoReadySet(f"no ready prefill set is known: {exc}") from None
        self._forget_stale()
        candidates = [
            s
            for s in self._answer.prefill_sets
            if s.kv_fingerprint == self._fingerprint and s.set_id not in exclude
        ]
        choices = [s for s in candidates if s.set_id not in self._forgotten] or candidates
        if not choices:
            raise NoReadySet(
                "no ready prefill set serves this model and KV layout"
                + (f" (tried {sorted(exclude)})" if exclude else "")
            )
        return min(choices, key=lambda s: (s.load + self._in_flight.get(s.set_id, 0), s.set_id))

    async def choose_store(self, exclude: Collection[str] = frozenset()) -> str:
        """The address of the store for a request's replica (pick_store) not in `exclude`; "" when the
        registry lists none (the set then pushes to its own default store)."""
        try:
            self._answer = await self._resolve()
        except ServiceError:
            return ""  # choose() just reported the registry; the set still knows its configured store
        self._forget_stale()
        # As with sets, a store that failed lately is taken only when no other is live.
        stores, flight = self._answer.kvstore, self._in_flight
        store = pick_store(stores, self._host, flight, {*exclude, *self._forgotten}) or pick_store(
            stores, self._host, flight, exclude
        )
        return store.address if store is not None else ""

    def _forget_stale(self) -> None:
        self._forgotten = {key: a for key, a in self._forgotten.items() if a is self._answer}

    def started(self, *targets: str) -> None:
        """A request was sent to these targets (a set id, a store address)."""
        for target in targets:
            self._in_flight[target] = self._in_flight.get(target, 0) + 1

    def finished(self, *targets: str) -> None:
        """A request sent to these targets has its answer."""
        for target in targets:
            self._in_flight[target] = max(self._in_flight.get(target, 0) - 1, 0)

    def forget(self, *targets: str) -> None:
        """Skips sets (ids) or stores (addresses) that failed until the resolver's next fresh answer."""
        if self._answer is not None:
            for target in targets:
                self._forgotten[target] = self._answer
