"""Node sessions a registry replica holds through etcd, so that every replica, not only the leader, accepts
a node's Register and Session (`--etcd` with several replicas).

What a session changes lives in etcd, where any replica may write it and the leader reads it:
- Register binds the node id to the node's session in etcd: its record (`sessions/<node_id>`: the
  registration as the node sent it, the assignment it runs and its last status report) is written with
  compare-and-swap on the session identity, so a node id stays bound to one live session whichever replica
  each of its calls reaches. The record lives under an etcd lease of its own that this replica refreshes
  while the node's heartbeats come in; a node that falls silent for its lease has the lease revoked, and a
  replica that dies stops refreshing: either way the record goes, which the leader sees as the node's death.
- The leader watches the records (server.RegistryServicer) and feeds them to its membership core: the
  assembly rules stay the core's. It writes the commands for such nodes into their mailboxes
  (`mailbox/<node_id>/<stamp>`), and the replica holding the node's Session streams them out from a watch.
  A message is deleted only once the node has acted on it (its heartbeats carry the generation it runs), so
  a command survives the death of the replica that held the Session: the node registers with another
  replica, which streams what is still pending.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import grpc
from google.protobuf.message import DecodeError

from pcpstack.common.errors import NotFound, ServiceError
from pcpstack.registry.convert import session_identity
from pcpstack.registry.etcd_store import MIN_LEASE_TTL_S, EtcdStore
from pcpstack.registry.membership import NodeIdInUse
from pcpstack.v1 import registry_pb2

log = logging.getLogger(__name__)
# a Session's outgoing messages: (mailbox key, message), the key None for a reply that is not mail; None ends
Queue = asyncio.Queue[tuple[bytes | None, registry_pb2.SessionResponse] | None]


@dataclass(frozen=True)
class SessionRecord:
    """What etcd holds of a node whose session a replica holds: its registration (with the assignment it
    runs as `current_assignment`), the certificate identity it called with, its last status report and the
    replica holding it."""

    request: registry_pb2.RegisterRequest
    peer: str
    status: registry_pb2.RankStatus | None
    replica: str
    # the load its heartbeats report (queued plus running requests), written at most once a lease
    load: int = 0
    # written last, just before the record is dropped: the node fell silent (the leader need not wait a
    # lease of its own to declare it dead)
    silent: bool = False
    # written last, just before the record is dropped: the node deregistered (the leader removes it)
    left: bool = False

    def but(self, **changes: object) -> SessionRecord:
        """A copy with changes (dataclasses.replace)."""
        return replace(self, **changes)

    @property
    def identity(self) -> str:
        """The session identity the node id is bound to (convert.session_identity)."""
        return session_identity(self.request.instance_id, self.peer)

    def encode(self) -> bytes:
        """The record as stored in etcd."""
        status = self.status.SerializeToString() if self.status is not None else b""
        return json.dumps(
            {
                "request": base64.b64encode(self.request.SerializeToString(deterministic=True)).decode(),
                "peer": self.peer,
                "identity": self.identity,
                "status": base64.b64encode(status).decode() if self.status is not None else None,
                "replica": self.replica,
                "load": self.load,
                "silent": self.silent,
                "left": self.left,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, value: bytes) -> SessionRecord:
        """A record as `encode` wrote it; ValueError for anything else."""
        try:
            raw = json.loads(value)
            request = registry_pb2.RegisterRequest.FromString(base64.b64decode(raw["request"]))
            status = None
            if raw.get("status") is not None:
                status = registry_pb2.RankStatus.FromString(base64.b64decode(raw["status"]))
            return cls(
                request,
                raw["peer"],
                status,
                raw["replica"],
                raw.get("load", 0),
                raw.get("silent", False),
                raw.get("left", False),
            )
        except (KeyError, TypeError, AttributeError, DecodeError) as exc:
            raise ValueError(f"not a session record: {exc!r}") from exc


def acted_on(streamed: list[registry_pb2.SessionResponse], generation: int) -> list[bool]:
    """Which of the messages written out to a node (oldest first) are done once its heartbeat carries
    `generation`: the newest command it has acted on (it runs the assignment it was given, or no longer runs
    the set it was told to stop) and every command before it (superseded); notices and refusals at once."""
    last = -1
    for i, message in enumerate(streamed):
        kind = message.WhichOneof("body")
        if (kind == "assign" and generation == message.assign.assignment.generation) or (
            kind == "stop" and generation != message.stop.generation
        ):
            last = i
    return [i <= last or m.WhichOneof("body") not in ("assign", "stop") for i, m in enumerate(streamed)]


@dataclass
class _Held:
    """A node bound through this replica: its record, lease and (while open) its Session's queue."""

    record: SessionRecord
    lease_id: int
    heard: float
    queue: Queue | None = None
    # messages written out on the Session and not yet acted on, oldest first
    streamed: list[tuple[bytes, registry_pb2.SessionResponse]] = field(default_factory=list)
    load_written: float = -math.inf
    # mailbox keys put on the current Session's queue
    seen: set[bytes] = field(default_factory=set)
    # True while its Session's reader waits on etcd (its next messages wait unread meanwhile)
    writing: bool = False


class EtcdSessions:
    """The node sessions one replica holds through etcd (see the module docstring)."""

    def __init__(self, store: EtcdStore, replica: str, lease_s: float) -> None:
        self._store = store
        self._replica = replica
        self._lease_s = lease_s
        # a record's lease outlives two node leases, so that a replica held up a while keeps its nodes
        self._ttl_s = max(MIN_LEASE_TTL_S, math.ceil(2 * lease_s))
        self._held: dict[str, _Held] = {}
        self._refreshed_at = -math.inf
        # one watch over every mailbox, started with the first Session and dispatching to the open ones
        self._mail_watch: asyncio.Task | None = None

    def holds(self, node_id: str, identity: str) -> bool:
        """True when this replica holds the node's session for that session identity."""
        held = self._held.get(node_id)
        return held is not None and held.record.identity == identity

    async def register(self, request: registry_pb2.RegisterRequest, peer: str, now: float) -> None:
        """Binds the node id to this node's session in etcd and holds it here; raises NodeIdInUse when
        another live session holds the id, Unavailable when etcd cannot be reached."""
        record = SessionRecord(request, peer, None, self._replica)
        held = self._held.get(request.node_id)
        if held is not None and held.record.identity == record.identity:
            # the same node again (it reconnects): its lease and the status it reported stay
            record = held.record.but(request=request, peer=peer)
            lease_id = held.lease_id
        else:
            lease_id = await self._store.grant(self._ttl_s)
        if not await self._store.bind_session(request.node_id, record.encode(), record.identity, lease_id):
            if held is None or held.lease_id != lease_id:
                await self._store.revoke(lease_id)
            raise NodeIdInUse(
                f"node_id={request.node_id!r} is bound to another live session; another session cannot "
                "register it until that session ends (its lease expires or it deregisters). Give each node "
                "its own --node-id"
            )
        if held is not None and held.lease_id != lease_id:
            self._end(held)
            with contextlib.suppress(ServiceError):
                await self._store.revoke(held.lease_id)
        if held is not None and held.lease_id == lease_id:
            self._end(held)
            held.record, held.heard = record, now
        else:
            self._held[request.node_id] = _Held(record, lease_id, now)

    async def release(self, node_id: str, identity: str) -> bool:
        """Ends a node's session held here for good (Deregister): its record is marked as left, so the leader
        removes the node at once (as a Deregister of its own would) rather than a lease later, then goes.
        Returns whether this replica held it."""
        held = self._held.get(node_id)
        if held is None or held.record.identity != identity:
            return False
        with contextlib.suppress(ServiceError):
            await self._store.put_session(node_id, held.record.but(left=True).encode(), held.lease_id)
        await self._drop(node_id, held)
        return True

    async def forget(self, node_id: str) -> None:
        """Stops holding a node that registered with the leader itself (it moved there)."""
        held = self._held.get(node_id)
        if held is not None:
            await self._drop(node_id, held)

    async def serve(
        self, node_id: str, requests: AsyncIterator[registry_pb2.SessionRequest], clock: Callable[[], float]
    ) -> AsyncIterator[registry_pb2.SessionResponse]:
        """A node's Session: reads its heartbeats and status reports, and yields what its mailbox holds
        (what was pending first) and acks. Raises NotFound when this replica does not hold the node (it
        registers again)."""
        held = self._held.get(node_id)
        if held is None:
            raise NotFound(f"node {node_id!r} is not registered with this replica; call Register first")
        self._end(held)
        queue: Queue = asyncio.Queue()
        held.queue, held.streamed, held.seen, held.heard = queue, [], set(), clock()
        if self._mail_watch is None:
            self._mail_watch = asyncio.create_task(self._watch_mail(), name="mailboxes")
        # after the queue is in place: what the watch brings from now on reaches it, the rest is read here
        mail = asyncio.create_task(self._deliver_pending(node_id, held, queue), name=f"mailbox-{node_id}")
        reader = asyncio.create_task(self._read(node_id, held, requests, clock), name=f"session-{node_id}")
        try:
            while (item := await queue.get()) is not None:
                key, message = item
                if key is not None:
                    held.streamed.append((key, message))
                yield message
        finally:
            mail.cancel()
            reader.cancel()
            if held.queue is queue:
                held.queue = None

    async def _deliver_pending(self, node_id: str, held: _Held, queue: Queue) -> None:
        """Puts what waits in the node's mailbox on its Session's queue (the shared watch brings what
        comes later; a message both bring is put once)."""
        try:
            pending, _ = await self._store.mailbox(node_id)
        except ServiceError as exc:
            log.warning("mailbox not read; the session ends", extra={"node_id": node_id, "error": str(exc)})
            queue.put_nowait(None)
            return
        for key, value in pending:
            self._offer(held, queue, key, value)

    @staticmethod
    def _offer(held: _Held, queue: Queue, key: bytes, value: bytes) -> None:
        if key not in held.seen:
            held.seen.add(key)
            try:
                message = registry_pb2.SessionResponse.FromString(value)
            except DecodeError:
                # one unreadable message must not stop the watch that serves every node held here
                where = {"key": key.decode(errors="replace")}
                log.warning("mailbox message unreadable; skipped", extra=where)
                return
            queue.put_nowait((key, message))

    async def _watch_mail(self) -> None:
        """Dispatches every message posted to a mailbox to the open Session of its node, if held here; a
        watch that breaks (an etcd member went down) is resumed after reading every open Session's mailbox
        again."""
        while True:
            try:
                _, revision = await self._store.mailbox("")
                for node_id, held in list(self._held.items()):
                    if held.queue is not None:
                        await self._deliver_pending(node_id, held, held.queue)
                async for node_id, key, value in self._store.watch_mailboxes(revision + 1):
                    held = self._held.get(node_id)
                    if held is not None and held.queue is not None:
                        self._offer(held, held.queue, key, value)
            except ServiceError as exc:
                log.warning("mailbox watch lost; reading again", extra={"error": str(exc)})
                await asyncio.sleep(0.2)

    async def _read(
        self,
        node_id: str,
        held: _Held,
        requests: AsyncIterator[registry_pb2.SessionRequest],
        clock: Callable[[], float],
    ) -> None:
        # acks only tell the node that the registry hears it: one every half lease is enough
        ack_every = self._lease_s / 2
        acked = -math.inf
        queue = held.queue
        assert queue is not None
        try:
            async for request in requests:
                now = clock()
                held.heard, held.writing = now, True
                try:
                    generation = await self._on_message(node_id, held, request, now)
                finally:
                    # a slow etcd kept the node's next messages unread: that silence is not the node's
                    held.heard, held.writing = clock(), False
                if request.WhichOneof("body") == "heartbeat":
                    if now - acked < ack_every:
                        continue
                    acked = now
                queue.put_nowait(
                    (None, registry_pb2.SessionResponse(ack=registry_pb2.HeartbeatAck(generation=generation)))
                )
        except (ServiceError, grpc.aio.AioRpcError) as exc:
            log.warning("session through etcd ended", extra={"node_id": node_id, "error": str(exc)})
        queue.put_nowait(None)

    async def _on_message(
        self, node_id: str, held: _Held, request: registry_pb2.SessionRequest, now: float
    ) -> int:
        """Writes what a Session message changes to etcd; returns the generation to ack."""
        kind = request.WhichOneof("body")
        if kind == "heartbeat":
            await self._acted_on(node_id, held, request.heartbeat.generation)
            load = request.heartbeat.load
            if load != held.record.load and now - held.load_written >= self._lease_s:
                # least-loaded routing needs it, a write per heartbeat would not pay: once a lease
                held.load_written = now
                held.record = held.record.but(load=load)
                await self._store.put_session(node_id, held.record.encode(), held.lease_id)
            return request.heartbeat.generation
        if kind == "status":
            await self._acted_on(node_id, held, request.status.generation)
            held.record = held.record.but(status=request.status)
            await self._store.put_session(node_id, held.record.encode(), held.lease_id)
            return request.status.generation
        return 0

    async def _acted_on(self, node_id: str, held: _Held, generation: int) -> None:
        """Deletes the streamed messages the node is done with (`acted_on`), and keeps the record's
        assignment the one the node runs, so that a new leader reading the record awaits the node in the
        right set."""
        done = acted_on([message for _, message in held.streamed], generation)
        if not any(done):
            return
        finished = [item for item, is_done in zip(held.streamed, done, strict=True) if is_done]
        held.streamed = [item for item, is_done in zip(held.streamed, done, strict=True) if not is_done]
        await self._store.delete([key for key, _ in finished])
        request = registry_pb2.RegisterRequest()
        request.CopyFrom(held.record.request)
        for _, message in finished:
            if message.WhichOneof("body") == "assign":
                request.current_assignment.CopyFrom(message.assign.assignment)
            elif message.WhichOneof("body") == "stop" and (
                request.current_assignment.generation == message.stop.generation
            ):
                request.ClearField("current_assignment")
        if request != held.record.request:
            held.record = held.record.but(request=request)
            await self._store.put_session(node_id, held.record.encode(), held.lease_id)

    async def tick(self, now: float) -> None:
        """Refreshes the leases of the nodes heard within their lease (one request for all, at a third of
        the TTL) and drops those that fell silent, so that the leader learns of their death."""
        lease = self._lease_s
        silent = [(n, h) for n, h in self._held.items() if not h.writing and now - h.heard > lease]
        for node_id, held in silent:
            log.warning("node missed its lease; session record dropped", extra={"node_id": node_id})
            with contextlib.suppress(ServiceError):
                await self._store.put_session(node_id, held.record.but(silent=True).encode(), held.lease_id)
            await self._drop(node_id, held)
        if self._held and now - self._refreshed_at >= self._ttl_s / 3:
            expired = set(await self._store.keep_alive([h.lease_id for h in self._held.values()]))
            # only a refresh that went through counts: a failed one is tried again at the next tick
            self._refreshed_at = now
            for node_id, held in [(n, h) for n, h in self._held.items() if h.lease_id in expired]:
                # etcd dropped the record (this replica was cut off for a whole TTL): the node registers again
                self._end(held)
                del self._held[node_id]

    def excuse(self, stalled_s: float, now: float) -> None:
        """This replica could not read heartbeats for stalled_s seconds: nobody is silent for that."""
        for held in self._held.values():
            held.heard = min(now, held.heard + stalled_s)

    async def _drop(self, node_id: str, held: _Held) -> None:
        self._end(held)
        if self._held.get(node_id) is held:
            del self._held[node_id]
        with contextlib.suppress(ServiceError):
            await self._store.revoke(held.lease_id)

    @staticmethod
    def _end(held: _Held) -> None:
        """Ends the node's open Session here, if any (the node registers again)."""
        if held.queue is not None:
            held.queue.put_nowait(None)
            held.queue = None

    async def close(self) -> None:
        """Ends every Session held here; the records are left to expire (the nodes move to another
        replica, which binds them again)."""
        if self._mail_watch is not None:
            self._mail_watch.cancel()
        for held in self._held.values():
            self._end(held)
