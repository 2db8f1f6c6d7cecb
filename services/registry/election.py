"""Which registry replica leads, decided in etcd: one key written under the winner's lease.

A replica campaigns by writing `<prefix>leader` = its advertised address under a lease of its own, in a
transaction that succeeds only if the key does not exist (create revision 0); it keeps the lease alive while
it leads.
A leader that dies stops refreshing, the lease expires (its TTL, 2 s) and the key goes with it; the
followers, polling the key, campaign again and one wins, and loads the state from etcd. A leader that loses
its lease (etcd says so, or no refresh reached etcd for nearly a TTL since the last one that did, so it may
have expired there) or resigns steps down and campaigns again; the generation fence in etcd_store refuses
its writes anyway once another replica has written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import aetcd
import grpc

from pcpstack.common.errors import ServiceError
from pcpstack.common.logs import ThrottledWarning
from pcpstack.registry.etcd_store import EtcdStore

log = logging.getLogger(__name__)

# seconds: etcd's smallest lease is about 1.5 election timeouts (1.5 s at its defaults); failover takes
# this long plus a poll
LEADER_TTL_S = 2
POLL_S = 0.2
# While etcd is unreachable the campaign retries every POLL_S; each distinct error is logged every this often.
UNREACHABLE_LOG_S = 30.0
# seconds before its lease could expire in etcd that a leader no refresh of which reached etcd steps down:
# gone before another replica can win the key (the lease runs from etcd's receipt of the last refresh, later
# than this replica sent it)
STEP_DOWN_MARGIN_S = LEADER_TTL_S / 4
# seconds a refresh sent at (or past) that moment may still take: one that etcd answers proves the lease alive
MIN_REFRESH_TIMEOUT_S = 0.2


class Election:
    """One replica's campaign. `run` returns only when cancelled; on_elected runs (awaited) when this
    replica becomes leader, on_deposed when it stops leading (lease lost or resigned)."""

    def __init__(
        self,
        store: EtcdStore,
        address: str,
        on_elected: Callable[[], Awaitable[None]],
        on_deposed: Callable[[], None],
    ) -> None:
        self._store = store
        self._address = address.encode()
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self.leader_address = ""
        # True while this replica holds the leader key (set after on_elected has run)
        self.leading = False
        self._lease_id: int | None = None
        self._unreachable = ThrottledWarning(log, interval_s=UNREACHABLE_LOG_S)

    @property
    def address(self) -> str:
        """This replica's address, as it campaigns with it."""
        return self._address.decode()

    async def run(self) -> None:
        """Campaigns, leads while the lease lasts, and campaigns again after losing it."""
        client = self._store.client
        key = self._store.key("leader")
        while True:
            try:
                granted_at = time.monotonic()
                lease = await client.lease(LEADER_TTL_S)
                ops = client.transactions
                won, _ = await client.transaction(
                    compare=[ops.create(key) == 0],
                    success=[ops.put(key, self._address, lease=lease.id)],
                    failure=[],
                )
                if not won:
                    await client.revoke_lease(lease.id)
                    await self._follow(client, key)
                    continue
                self.leader_address = self._address.decode()
                self._lease_id = lease.id
                log.info("registry replica elected leader", extra={"address": self.leader_address})
                try:
                    await self._on_elected()
                except BaseException:
                    # could not take over (etcd failed meanwhile): free the key for the next campaign
                    with contextlib.suppress(aetcd.exceptions.ClientError):
                        await client.revoke_lease(lease.id)
                    raise
                self.leading = True
                await self._lead(lease.id, granted_at)
                self.leading = False
                self.leader_address = ""
                log.error("registry replica stopped leading", extra={"address": self._address.decode()})
                self._on_deposed()
            except (
                aetcd.exceptions.ClientError,
                ServiceError,
                OSError,
                asyncio.CancelledError,
                grpc.aio.UsageError,
            ) as exc:
                if isinstance(exc, asyncio.CancelledError) and asyncio.current_task().cancelling():
                    raise  # the election itself is stopped
                # (otherwise a call on a channel closed, or being closed, under it: EtcdStore's retire)
                error = str(exc) or "its etcd channel was replaced"
                self._unreachable.warning(
                    error, "leader election: etcd unreachable; retrying", extra={"error": error}
                )
                self._store.unreachable(exc)
                await asyncio.sleep(POLL_S)

    async def _follow(self, client: aetcd.Client, key: bytes) -> None:
        """Returns once the leader key is gone (its lease expired or was revoked)."""
        while (current := await client.get(key)) is not None:
            # this replica's own address there is a key of its earlier life, left to expire: no leader
            self.leader_address = "" if current.value == self._address else current.value.decode()
            await asyncio.sleep(POLL_S)
        self.leader_address = ""

    async def _lead(self, lease_id: int, granted_at: float) -> None:
        """Refreshes the lease at a third of its TTL (the first at once: taking over used some of it); returns
        when etcd no longer knows it, when no refresh has reached etcd for the TTL less STEP_DOWN_MARGIN_S
        since the last one that did (sent at granted_at at first), or when this replica resigned."""
        refreshed = granted_at
        pause = 0.0
        while self.leading:
            await asyncio.sleep(pause)
            if not self.leading:
                return
            sent = time.monotonic()
            deadline = refreshed + LEADER_TTL_S - STEP_DOWN_MARGIN_S
            try:
                expired = await self._store.keep_alive(
                    [lease_id], timeout=max(deadline - sent, MIN_REFRESH_TIMEOUT_S)
                )
            except ServiceError as exc:
                if time.monotonic() >= deadline:
                    log.error(
                        "leader lease not refreshed for its TTL; stepping down",
                        extra={"since_s": round(time.monotonic() - refreshed, 2), "error": str(exc)},
                    )
                    return
                log.warning("leader lease refresh failed", extra={"error": str(exc)})
                pause = min(LEADER_TTL_S / 3, max(deadline - time.monotonic(), 0.0))
                continue
            if expired:
                return
            refreshed = sent
            pause = LEADER_TTL_S / 3

    async def resign(self) -> None:
        """Gives the leadership up at once (a clean stop, or a view found stale), so that another replica
        need not wait for the lease to run out; a running campaign starts again."""
        if self.leading and self._lease_id is not None:
            self.leading = False
            with contextlib.suppress(aetcd.exceptions.ClientError):
                await self._store.client.revoke_lease(self._lease_id)
