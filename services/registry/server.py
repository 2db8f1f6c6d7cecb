"""The registry's gRPC servicer: turns protobuf into Membership calls and results into protobuf.

Besides translation (in `convert`) it owns what the pure core cannot: the clock (a periodic tick that
expires leases and times out assemblies), the nodes' mailboxes that Session streams drain, and the optional
snapshot file. With etcd replicas, a follower holds the sessions it accepts through etcd (`etcd_sessions`),
and the leader feeds their records to its core from a watch and writes their commands to etcd mailboxes.
Refusals are `common.errors` kinds raised by the core; the common interceptor maps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from opentelemetry.metrics import Observation

from pcpstack.common import security
from pcpstack.common.channel import open_channel
from pcpstack.common.config import ConfigError
from pcpstack.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ServiceError,
    Unavailable,
)
from pcpstack.common.server import RunningServer, ServerOptions, start_server
from pcpstack.common.telemetry import meter
from pcpstack.registry import convert
from pcpstack.registry.mailboxes import Mailboxes, Queue
from pcpstack.registry.membership import (
    Ack,
    AssemblyTimedOut,
    Assign,
    Membership,
    NodeIdInUse,
    Outgoing,
    Registration,
    SetState,
    Settings,
    Stop,
    split_host_port,
    validate,
)
from pcpstack.registry.snapshot import SnapshotFile, read_snapshot
from pcpstack.v1 import registry_pb2, registry_pb2_grpc

if TYPE_CHECKING:
    from pcpstack.registry.election import Election
    from pcpstack.registry.etcd_auth import EtcdAuth
    from pcpstack.registry.etcd_sessions import EtcdSessions, SessionRecord
    from pcpstack.registry.etcd_store import EtcdStore, EtcdTls

log = logging.getLogger(__name__)

SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name
# A follower refreshes its copy of the leader's answers this often (sooner again after a try the leader did
# not answer), giving the leader SHADOW_ASK_S to answer each question, and serves a copy at most
# SHADOW_MAX_AGE_S old while no leader answers (a failover takes the leader key's TTL, 2 s, plus a poll; on
# a loaded machine, and with an etcd member lost at the same time, several times that).
SHADOW_EVERY_S = 0.5
SHADOW_RETRY_S = 0.1
SHADOW_ASK_S = 5.0
SHADOW_MAX_AGE_S = 30.0


def peer_identity(context: grpc.aio.ServicerContext) -> str:
    """The caller's verified certificate (subject and names) under mTLS; empty without it."""
    auth = context.auth_context()
    if not auth.get("x509_subject"):
        return ""
    subject = b"".join(auth["x509_subject"]).decode("utf-8", "replace")
    return ",".join([subject, *sorted(security.certificate_names(auth))])


@dataclass
class _Failure:
    refused: ServiceError | None = None


def _marked_stale(reply):
    """A copy of the leader's earlier answer, marked as one: a Resolve answer is `warming` (routers keep
    what they knew), a ListSets answer names no leader."""
    copy = type(reply)()
    copy.CopyFrom(reply)
    if isinstance(copy, registry_pb2.ResolveResponse):
        copy.warming = True
    elif isinstance(copy, registry_pb2.ListSetsResponse):
        copy.leader_address = ""
    return copy


class RegistryServicer(registry_pb2_grpc.RegistryServiceServicer):
    """RegistryService over a Membership; every state change's commands go to the nodes' mailboxes."""

    def __init__(
        self,
        membership: Membership,
        clock: Callable[[], float] = time.monotonic,
        snapshot_path: Path | None = None,
        verify_peer_address: bool = True,
        etcd: EtcdStore | None = None,
    ) -> None:
        self._membership = membership
        self._etcd = etcd
        # commands whose state etcd has not confirmed yet, in order (delivered after the next good save)
        self._held: Outgoing = []
        # the core's revision that etcd holds (None: not known to be saved)
        self._saved_revision: int | None = None
        self._commit_lock = asyncio.Lock()
        # set once etcd refused a write because another registry wrote: this registry's view is stale
        self._superseded: ServiceError | None = None
        # with replicas: this replica's campaign (None: a registry that leads alone), and a channel to the
        # leader that reads are forwarded to while following
        self.election: Election | None = None
        # with replicas: the node sessions this replica holds through etcd (accepted while following)
        self.etcd_sessions: EtcdSessions | None = None
        # while leading: the nodes whose sessions a replica holds through etcd, as their records were
        # last read (their commands go to their etcd mailboxes), and the task watching the records
        self._remote: dict[str, SessionRecord] = {}
        self._unposted: list[tuple[str, bytes]] = []
        # nodes this leader may have written mail to (their etcd mailboxes are cleared when they register
        # here: the response carries the truth)
        self._mailed: set[str] = set()
        self._records_watch: asyncio.Task | None = None
        self._leader_channel: tuple[str, grpc.aio.Channel] | None = None
        # the leader's last answers to reads, by (method, request bytes): (when, reply)
        self._shadow: dict[tuple[str, bytes], tuple[float, object]] = {}
        self._verify_peer_address = verify_peer_address
        self._clock = clock
        self._mailboxes = Mailboxes()
        self._snapshot = SnapshotFile(snapshot_path) if snapshot_path is not None else None
        # the core changed since the snapshot file last took it (a failed write stays stale and is retried)
        self._snapshot_stale = False
        self._dirty = False
        # PCP sets by state, counted on the event loop that owns the core (not thread-safe) at every tick
        # and read by the metrics exporter's thread.
        self._sets_by_state: dict[str, int] = {state.value: 0 for state in SetState}
        meter("pcpstack.registry").create_observable_gauge(
            "pcpstack.pcp_sets",
            callbacks=[self._observe_sets],
            description="PCP sets by state (starting, ready, broken)",
        )

    def _observe_sets(self, _: object) -> list[Observation]:
        return [Observation(count, {"state": state}) for state, count in self._sets_by_state.items()]

    def _count_sets(self) -> None:
        counts = {state.value: 0 for state in SetState}
        for view in self._membership.sets():
            counts[view.state.value] += 1
        self._sets_by_state = counts  # one assignment: the exporter never sees a half-counted dict

    def deliver(self, out: Outgoing) -> list[tuple[str, bytes]]:
        """Posts commands to mailboxes and logs what a reader of the logs wants to know. Returns the
        commands for nodes whose sessions are held through etcd, to be written to their etcd mailboxes."""
        remote = []
        for node_id, command in out:
            if node_id in self._remote:
                remote.append((node_id, convert.command_to_proto(command).SerializeToString()))
            else:
                self._mailboxes.post(node_id, convert.command_to_proto(command))
            if isinstance(command, Assign) and command.assignment.node_rank == 0:
                a = command.assignment
                log.info(
                    "set formed",
                    extra={
                        "set_id": a.set_id,
                        "generation": a.generation,
                        "members": list(a.member_node_ids),
                    },
                )
            elif isinstance(command, Stop):
                log.warning(
                    "node told to stop",
                    extra={"node_id": node_id, "set_id": command.set_id, "reason": command.reason},
                )
            elif isinstance(command, AssemblyTimedOut):
                log.warning("assembly timed out", extra={"node_id": node_id, "reason": command.reason})
        if out:
            self._dirty = True
        return remote

    async def commit(self, out: Outgoing) -> None:
        """Delivers the commands of a state change. With etcd, the change is written first and the commands
        wait until it is (in order, with those of earlier changes whose write failed); raises Unavailable
        when etcd refuses or cannot be reached, so no node acts on a set etcd does not hold."""
        if self._etcd is None:
            self.deliver(out)
            return
        from pcpstack.registry.etcd_store import Superseded  # loaded already: self._etcd is one of its

        self._held += out
        async with self._commit_lock:
            # the snapshot taken now holds every change whose commands are held so far; later ones wait
            covered = len(self._held)
            revision = self._membership.revision
            try:
                # most changes (heartbeats, readiness reports, re-registrations) leave the sets as they
                # are: building and comparing a snapshot of every set for each was the leader's main cost
                if revision != self._saved_revision:
                    await self._etcd.save(self._membership.snapshot())
                    self._saved_revision = revision
            except Superseded as exc:
                log.error("registry superseded in etcd", extra={"error": str(exc)})
                if self.election is not None:
                    # step down: whoever leads next (this replica too) starts from what etcd holds
                    await self.election.resign()
                else:
                    self._superseded = exc
                raise
            held, self._held = self._held[:covered], self._held[covered:]
        # commands for nodes held through etcd go to their mailboxes, after any whose write failed before
        self._unposted += self.deliver(held)
        if self._unposted:
            await self._etcd.post(self._unposted)
            self._unposted = []

    def _check_current(self) -> None:
        """Refuses (UNAVAILABLE) every request once another registry wrote the state in etcd, so nodes and
        routers go to a registry whose view is current."""
        if self._superseded is not None:
            raise self._superseded

    @property
    def _following(self) -> bool:
        return self.election is not None and not self.election.leading

    def _require_leader(self) -> None:
        """Refuses (UNAVAILABLE) a change on a replica that does not lead, naming the one that does."""
        self._check_current()
        if self._following:
            assert self.election is not None
            leader = self.election.leader_address or "not elected yet"
            raise Unavailable(f"this registry replica does not lead; the leader is {leader}")

    async def _from_leader(self, method: str, request, context):
        """The leader's answer to a read, for a follower (reads are served by every replica). While no
        leader answers (it died and its lease has not run out, or an election is under way) the leader's
        last answer to the same question is served instead, marked as such (Resolve: `warming`; ListSets:
        no leader named), if it is at most SHADOW_MAX_AGE_S old."""
        key = (method, request.SerializeToString(deterministic=True))
        try:
            reply = await self._ask_leader(method, request, context.time_remaining() or 2.0)
        except Unavailable:
            kept = self._shadow.get(key)
            if kept is None or self._clock() - kept[0] > SHADOW_MAX_AGE_S:
                raise
            return _marked_stale(kept[1])
        self._shadow[key] = (self._clock(), reply)
        return reply

    async def _ask_leader(self, method: str, request, timeout: float):
        assert self.election is not None
        leader = self.election.leader_address
        if not leader:
            raise Unavailable("no registry replica leads yet (an election is under way); retry")
        if leader == self.election.address:
            raise Unavailable("this registry replica is taking over as leader; retry")
        if self._leader_channel is None or self._leader_channel[0] != leader:
            if self._leader_channel is not None:
                await self._leader_channel[1].close()
            self._leader_channel = (leader, open_channel(leader, default_deadline=2.0))
        stub = registry_pb2_grpc.RegistryServiceStub(self._leader_channel[1])
        try:
            return await getattr(stub, method)(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"the leader {leader} did not answer {method}: {exc.details()}") from None

    async def _shadow_leader(self) -> bool:
        """Keeps the leader's answers to the routers' usual questions (all sets; endpoints of every
        model), so that this follower can answer them while the leader is gone. Returns whether the
        leader answered both."""
        answered = 0
        for method, request in (
            ("ListSets", registry_pb2.ListSetsRequest()),
            ("Resolve", registry_pb2.ResolveRequest()),
        ):
            with contextlib.suppress(ServiceError):
                reply = await self._ask_leader(method, request, SHADOW_ASK_S)
                self._shadow[(method, request.SerializeToString(deterministic=True))] = (self._clock(), reply)
                answered += 1
        return answered == 2

    async def keep_shadow(self) -> None:
        """While this replica follows, keeps its copy of the leader's answers fresh (`_shadow_leader`);
        runs until cancelled. A task of its own, not a step of the clock: a leader slow to answer on a
        loaded machine must neither hold up this replica's ticks nor, asked with a tick's short deadline,
        leave it with no copy to serve when that leader dies."""
        while True:
            # while leading there is nothing to copy; a follower whose try went unanswered tries again soon
            answered = not self._following or await self._shadow_leader()
            await asyncio.sleep(SHADOW_EVERY_S if answered else SHADOW_RETRY_S)

    async def lead(self) -> None:
        """Takes over as leader: the state etcd holds becomes this replica's core, whose sets are awaited
        from their members exactly as after a restart."""
        assert self._etcd is not None
        snapshot = await self._etcd.load()
        settings = self._membership.settings
        if snapshot is None and not settings.restore_grace_given:
            settings = replace(settings, restore_grace_s=0.0)
        self._membership = Membership(settings, self._clock(), snapshot)
        self._saved_revision = None
        self._held = []
        self._dirty = True
        self._shadow.clear()  # a leader answers from its own core
        # the nodes whose sessions replicas hold through etcd, then every change of their records (in the
        # background: their sets are awaited from them as from nodes that register again)
        self._records_watch = asyncio.create_task(self._watch_records(), name="session-records")

    def deposed(self) -> None:
        """This replica stopped leading: commands not yet written are dropped (their nodes re-register with
        the next leader), and it follows until it is elected again."""
        self._held = []
        self._unposted = []
        if self._records_watch is not None:
            self._records_watch.cancel()
            self._records_watch = None
        self._remote.clear()

    async def _watch_records(self) -> None:
        """Feeds the session records to the core, and every change of them, while leading; a watch that
        breaks (an etcd member went down) is followed by reading them all again. Changes are applied in
        batches, with one write to etcd each: what arrived while the last batch was being written."""
        assert self._etcd is not None
        while True:
            # (node id, record or None when deleted); None itself: the watch broke
            changes: asyncio.Queue[tuple[str, bytes | None] | None] = asyncio.Queue()
            reader: asyncio.Task | None = None
            try:
                records, revision = await self._etcd.sessions()
                gone = [(node_id, None) for node_id in self._remote.keys() - records.keys()]
                await self._apply_records([*gone, *records.items()])
                reader = asyncio.create_task(self._read_records(revision + 1, changes))
                while True:
                    batch = [await changes.get()]
                    while not changes.empty():
                        batch.append(changes.get_nowait())
                    await self._apply_records([change for change in batch if change is not None])
                    if None in batch:
                        raise Unavailable("the watch of session records broke")
            except ServiceError as exc:
                log.warning("session records not read; reading again", extra={"error": str(exc)})
                await asyncio.sleep(0.2)
            finally:
                if reader is not None:
                    reader.cancel()

    async def _read_records(self, start_revision: int, changes: asyncio.Queue) -> None:
        """Queues every change of the session records from start_revision on; None once the watch ends."""
        assert self._etcd is not None
        try:
            async for change in self._etcd.watch_sessions(start_revision):
                changes.put_nowait(change)
        except ServiceError as exc:
            log.warning("watch of session records broke", extra={"error": str(exc)})
        changes.put_nowait(None)  # the applying loop reads everything again

    async def _apply_records(self, changes: list[tuple[str, bytes | None]]) -> None:
        """Applies changed session records to the core, then writes the change and posts its commands."""
        assert self._etcd is not None
        out: Outgoing = []
        refusals: list[tuple[str, bytes]] = []
        for node_id, value in changes:
            out += self._record_changed(node_id, value, refusals)
        try:
            await self.commit(out)
            if refusals:
                await self._etcd.post(refusals)
        except ServiceError as exc:
            log.warning("membership not written to etcd", extra={"error": str(exc)})

    def _record_changed(
        self, node_id: str, value: bytes | None, refusals: list[tuple[str, bytes]]
    ) -> Outgoing:
        """A node's session record changed (held by some replica through etcd): the core learns of its
        registration and status reports as if the node had called this replica; a deleted record leaves
        the node to miss its lease, one marked silent is the node's death. A refusal is added to refusals
        (the node's Register was answered already: it reads the refusal on its Session)."""
        from pcpstack.registry.etcd_sessions import SessionRecord  # loaded: a record exists

        if value is None:
            self._remote.pop(node_id, None)
            return []
        try:
            record = SessionRecord.decode(value)
        except ValueError as exc:
            # one node's unreadable record must not stop the watch that feeds every other node to the core
            where = {"node_id": node_id, "error": str(exc)}
            log.warning("session record unreadable; node skipped", extra=where)
            self._remote.pop(node_id, None)
            return []
        now = self._clock()
        if record.silent:
            self._remote.pop(node_id, None)
            return self._membership.lapse(node_id, now)
        if record.left:
            self._remote.pop(node_id, None)
            # (NodeIdInUse: the id moved to another session meanwhile, which this record does not speak for)
            with contextlib.suppress(NodeIdInUse):
                return self._membership.deregister(node_id, now, record.identity)[1]
            return []
        before = self._remote.get(node_id)
        self._remote[node_id] = record
        self._mailed.add(node_id)
        if before is None:
            self._mailboxes.reset(node_id)  # a session the node held with this replica itself is over
        out: Outgoing = []
        try:
            if before is None or (before.request, before.peer) != (record.request, record.peer):
                out += self._register_record(record, now)
            status = record.status
            if status is not None and (before is None or before.status != status):
                _, changes = self._membership.report_status(
                    node_id, status.set_id, status.generation, status.ready, status.error, now
                )
                out += changes
        except (ServiceError, ConfigError) as exc:
            log.warning("registration through etcd refused", extra={"node_id": node_id, "error": str(exc)})
            refusal = registry_pb2.SessionResponse(refusal=registry_pb2.Refusal(reason=str(exc)))
            refusals.append((node_id, refusal.SerializeToString()))
        return out

    def _register_record(self, record: SessionRecord, now: float) -> Outgoing:
        """Registers a node held through etcd with the core. Its Register was answered without an
        assignment, so the one it has now (unless it carries it already) goes to it as a command."""
        registration = convert.registration_from_proto(record.request, record.peer)
        assignment, out = self._membership.register(registration, now)
        if assignment is not None and assignment != registration.current_assignment:
            out.append((registration.node_id, Assign(assignment)))
        return out

    def _hear_remote(self, now: float) -> Outgoing:
        """A live record is the heartbeat of a node held through etcd (its holder drops the record when the
        node falls silent); a node the core declared dead meanwhile registers again from its record."""
        out: Outgoing = []
        for node_id, record in list(self._remote.items()):
            try:
                self._membership.heartbeat(node_id, 0, record.load, now)
            except NotFound:
                with contextlib.suppress(ServiceError, ConfigError):
                    out += self._register_record(record, now)
        return out

    async def Register(self, request, context):
        """Validates and records the node; the response carries its assignment when it has one. A replica
        that follows holds the node's session through etcd: its assignment comes as a command."""
        self._check_current()
        held_here = self._following and self.etcd_sessions is not None
        if not held_here:
            self._require_leader()
        try:
            registration = convert.registration_from_proto(request, peer_identity(context))
        except ConfigError as exc:
            raise FailedPrecondition(f"engine_config: {exc}") from None
        # What the core would refuse of this node alone is named first (also here, where a follower holds
        # the node: its peers are checked by the leader); then it must advertise its own host, which
        # costs a name lookup that a malformed address must not get.
        validate(registration)
        if self._verify_peer_address:
            await self._check_advertised(registration, context)
        try:
            if held_here:
                assert self.etcd_sessions is not None
                await self.etcd_sessions.register(request, peer_identity(context), self._clock())
                log.info("registered through etcd", extra={"node_id": request.node_id})
                return registry_pb2.RegisterResponse(
                    node_id=request.node_id, lease_ms=int(self._membership.settings.lease_s * 1000)
                )
            assignment, out = self._membership.register(registration, self._clock())
            # a node held through etcd until now moved here: its commands come here from now on
            self._remote.pop(request.node_id, None)
        except NodeIdInUse:
            # tells a restarted node that the refusal clears once its old session ends
            context.set_trailing_metadata(((convert.REFUSAL_METADATA, convert.REFUSAL_NODE_ID_IN_USE),))
            raise
        self._mailboxes.reset(request.node_id)
        if self._etcd is not None and request.node_id in self._mailed:
            # the response carries the truth: what waited in its etcd mailbox is superseded
            self._mailed.discard(request.node_id)
            if self.etcd_sessions is not None:
                await self.etcd_sessions.forget(request.node_id)
            await self._etcd.clear_mailbox(request.node_id)
        await self.commit(out)
        self._dirty = True
        log.info("registered", extra={"node_id": request.node_id, "role": registration.role})
        return registry_pb2.RegisterResponse(
            node_id=request.node_id,
            lease_ms=int(self._membership.settings.lease_s * 1000),
            assignment=convert.assignment_to_proto(assignment),
        )

    async def _check_advertised(self, registration: Registration, context) -> None:
        """Refuses a node that advertises (address, dist_host) a host other than its own, so it cannot
        point routers or its set's ranks elsewhere (--verify-peer-address)."""
        peer = security.peer_ip(context.peer())
        if peer is None:
            return  # not an IP transport (a unix socket): the peer is local
        try:
            address_host = split_host_port(registration.address)[0]
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        names = security.certificate_names(context.auth_context())
        for name, host in (("address", address_host), ("dist_host", registration.dist_host)):
            if not host:
                continue
            broken = await security.advertised_host_allowed(host, peer, names)
            if broken is not None:
                value = registration.address if name == "address" else host
                raise PermissionDenied(
                    f"{name}={value!r} refused: {broken}; rule: a node advertises its own address "
                    "(registry --verify-peer-address)"
                )

    async def Session(self, request_iterator, context):
        """Reads heartbeats and status reports; yields commands, acks and refusals. (A generator, not
        context.write: the OpenTelemetry server interceptor wraps streaming handlers as generators.)"""
        self._check_current()
        requests = aiter(request_iterator)
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            return
        if first.WhichOneof("body") != "open" or not first.open.node_id:
            raise InvalidArgument("the first Session message must be `open` with a node_id")
        node_id = first.open.node_id
        session = convert.session_identity(first.open.instance_id, peer_identity(context))
        if self.etcd_sessions is not None and self.etcd_sessions.holds(node_id, session):
            async for message in self.etcd_sessions.serve(node_id, requests, self._clock):
                yield message
            return
        self._require_leader()
        self._membership.open_session(node_id, self._clock(), session)
        queue = self._mailboxes.attach(node_id)
        failure = _Failure()
        reader = asyncio.create_task(self._read(requests, node_id, session, queue, failure))
        try:
            while (message := await queue.get()) is not None:
                yield message
        finally:
            reader.cancel()
            self._mailboxes.detach(node_id, queue)
        if failure.refused is not None:
            raise failure.refused

    async def _read(self, requests, node_id: str, session: str, queue: Queue, failure: _Failure) -> None:
        # A heartbeat's ack only tells the node that the registry hears it, so one every half lease is
        # enough (a node gives up after two leases of silence); acking every heartbeat (a third of the
        # lease) cost the registry half as much again per heartbeat. Refusals and replies to other
        # messages always go out.
        ack_every = self._membership.settings.lease_s / 2
        acked = -math.inf
        try:
            async for request in requests:
                reply = await self._on_session_message(node_id, session, request)
                now = self._clock()
                if request.WhichOneof("body") == "heartbeat" and reply.WhichOneof("body") == "ack":
                    if now - acked < ack_every:
                        continue
                    acked = now
                queue.put_nowait(reply)
        except ServiceError as exc:
            failure.refused = exc
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            pass
        queue.put_nowait(None)

    async def _on_session_message(self, node_id: str, session: str, request) -> registry_pb2.SessionResponse:
        # a replica that stopped leading ends its Sessions: the nodes move on to the leader
        self._require_leader()
        now = self._clock()
        kind = request.WhichOneof("body")
        if kind == "heartbeat":
            reply = self._membership.heartbeat(
                node_id, request.heartbeat.generation, request.heartbeat.load, now
            )
        elif kind == "status":
            status = request.status
            reply, out = self._membership.report_status(
                node_id, status.set_id, status.generation, status.ready, status.error, now
            )
            await self.commit(out)
            self._dirty = True
        else:
            self._membership.open_session(node_id, now, session)
            reply = Ack(0)
        if isinstance(reply, Ack):
            return registry_pb2.SessionResponse(ack=registry_pb2.HeartbeatAck(generation=reply.generation))
        return registry_pb2.SessionResponse(
            refusal=registry_pb2.Refusal(reason=reply.reason, current_generation=reply.current_generation)
        )

    async def Resolve(self, request, context):
        """Ready prefill sets, decode and KV store endpoints; while the registry is warming up (it may not
        have heard from every live node yet) the answer says so (`warming`)."""
        self._check_current()
        if self._following:
            return await self._from_leader("Resolve", request, context)
        warming = self._membership.warming(self._clock())
        return convert.resolution_to_proto(self._membership.resolve(request.model), warming)

    async def ListNodes(self, request, context):
        """Every node with its state."""
        self._check_current()
        if self._following:
            return await self._from_leader("ListNodes", request, context)
        views = self._membership.nodes(self._clock())
        return registry_pb2.ListNodesResponse(nodes=[convert.node_to_proto(v) for v in views])

    async def ListSets(self, request, context):
        """Every set, formed or forming (and broken ones until re-formed), and the leading replica."""
        self._check_current()
        if self._following:
            return await self._from_leader("ListSets", request, context)
        return registry_pb2.ListSetsResponse(
            sets=[convert.set_to_proto(v) for v in self._membership.sets()],
            leader_address=self.election.leader_address if self.election is not None else "",
        )

    async def Deregister(self, request, context):
        """Removes a node (only its own session may); its set breaks and its Session ends."""
        self._check_current()
        if not request.node_id:
            raise InvalidArgument("node_id is required")
        session = convert.session_identity(request.instance_id, peer_identity(context))
        if self.etcd_sessions is not None and await self.etcd_sessions.release(request.node_id, session):
            # its record was marked as left, then dropped: the leader removes the node at once
            return registry_pb2.DeregisterResponse(removed=True)
        self._require_leader()
        removed, out = self._membership.deregister(
            request.node_id,
            self._clock(),
            convert.session_identity(request.instance_id, peer_identity(context)),
        )
        self._mailboxes.reset(request.node_id)
        await self.commit(out)
        self._dirty = self._dirty or removed
        log.info("deregistered", extra={"node_id": request.node_id, "known": removed})
        return registry_pb2.DeregisterResponse(removed=removed)

    async def run_clock(self, interval: float) -> None:
        """Ticks the core every interval seconds and keeps the snapshot file fresh; runs until cancelled.
        A tick that comes late means the event loop was held up and heartbeats waited unread meanwhile:
        that time is excused from every node's lease (`Membership.excuse`), so an overloaded registry does
        not declare its nodes dead, break their sets and make itself busier still re-forming them."""
        while True:
            asleep = self._clock()
            await asyncio.sleep(interval)
            now = self._clock()
            # measured over the sleep alone: the tick's own awaits on etcd are no stall of the loop
            late = now - asleep - interval
            if late > interval:
                self._membership.excuse(late, now)
                if self.etcd_sessions is not None:
                    self.etcd_sessions.excuse(late, now)
                log.warning("event loop held up; leases extended", extra={"stalled_s": round(late, 2)})
            if self.etcd_sessions is not None:
                try:
                    await self.etcd_sessions.tick(now)
                except ServiceError as exc:
                    log.warning("node session leases not refreshed", extra={"error": str(exc)})
            if self._superseded is not None or self._following:
                continue
            try:
                await self.commit(self._hear_remote(now) + self._membership.tick(now))
                if self._etcd is not None:
                    await self._etcd.sync_nodes(self._membership.live_records(), now)
            except ServiceError as exc:
                # etcd unreachable or this registry superseded: held commands wait for the next good write
                log.warning("membership not written to etcd", extra={"error": str(exc)})
            if self._dirty:
                # counting walks every set: only after a change
                self._dirty = False
                self._count_sets()
                self._snapshot_stale = True
            if self._snapshot_stale and self._snapshot is not None:
                self._snapshot_stale = not self._snapshot.save(self._membership.snapshot())


class RegistryServer:
    """A running registry: the gRPC server plus its clock (and, as a replica on etcd, its campaign and the
    follower's copy of the leader's answers)."""

    def __init__(
        self,
        running: RunningServer,
        servicer: RegistryServicer,
        clock_task: asyncio.Task,
        etcd: EtcdStore | None = None,
        replica_tasks: tuple[asyncio.Task, ...] = (),
    ) -> None:
        self.running = running
        self.servicer = servicer
        self._clock_task = clock_task
        self._etcd = etcd
        self._replica_tasks = replica_tasks

    @property
    def address(self) -> str:
        """host:port clients dial."""
        return self.running.address

    async def stop(self, grace: float | None = None) -> None:
        """Stops the clock and the server; a leading replica resigns so that another takes over at once
        (node leases in etcd are left to expire)."""
        for task in (self._clock_task, *self._replica_tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.servicer.election is not None:
            await self.servicer.election.resign()
        self.servicer.deposed()
        if self.servicer.etcd_sessions is not None:
            await self.servicer.etcd_sessions.close()
        await self.running.stop(grace)
        if self._etcd is not None:
            await self._etcd.close()


async def start_registry(
    settings: Settings | None = None,
    options: ServerOptions | None = None,
    snapshot_path: Path | None = None,
    verify_peer_address: bool = True,
    etcd_endpoints: str | None = None,
    etcd_prefix: str = "/pcpstack/registry/",
    elect: bool = True,
    advertised_host: str = "",
    etcd_tls: EtcdTls | None = None,
    etcd_auth: EtcdAuth | None = None,
) -> RegistryServer:
    """Starts a registry. With a snapshot_path, an existing snapshot is read (the restore grace then ends
    as soon as its sets' members are back) and a missing one means a cold start with no grace at all
    (unless settings.restore_grace_given).
    With etcd_endpoints ("http://HOST:PORT,...", or https:// with etcd_tls; as etcd_auth's user with
    etcd_auth), membership state is kept in
    that etcd cluster instead, under etcd_prefix, with the same restart rules (etcd_store), and the
    registry is one of possibly several replicas: it campaigns (election) and assembles only while it
    leads, forwarding reads to the leader and holding the sessions it accepts through etcd meanwhile
    (etcd_sessions); elect=False makes it act as the only one (the generation fence still holds). A replica
    campaigns with advertised_host:PORT (default: the bind host), the address the other replicas dial while
    it leads.
    verify_peer_address refuses registrations whose advertised host is not the caller's own."""
    settings = settings or Settings()
    options = options or ServerOptions()
    etcd = None
    if etcd_endpoints:
        # imported here: aetcd is needed only with --etcd
        from pcpstack.registry.etcd_store import EtcdStore

        etcd = await EtcdStore.connect(etcd_endpoints, etcd_prefix, settings.lease_s, etcd_tls, etcd_auth)
        # a replica that campaigns loads the state when it is elected
        snapshot = await etcd.load() if not elect else None
    else:
        snapshot = read_snapshot(snapshot_path) if snapshot_path is not None else None
    cold = (snapshot_path is not None or (etcd is not None and not elect)) and snapshot is None
    if cold and not settings.restore_grace_given:
        settings = replace(settings, restore_grace_s=0.0)
    membership = Membership(settings, time.monotonic(), snapshot)
    servicer = RegistryServicer(membership, time.monotonic, snapshot_path, verify_peer_address, etcd)
    running = await start_server(
        lambda server: registry_pb2_grpc.add_RegistryServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        options,
    )
    replica_tasks: tuple[asyncio.Task, ...] = ()
    if etcd is not None and elect:
        from pcpstack.registry.election import Election
        from pcpstack.registry.etcd_sessions import EtcdSessions

        address = f"{advertised_host}:{running.port}" if advertised_host else running.address
        servicer.etcd_sessions = EtcdSessions(etcd, address, settings.lease_s)
        servicer.election = Election(etcd, address, servicer.lead, servicer.deposed)
        replica_tasks = (
            asyncio.create_task(servicer.election.run(), name="registry-election"),
            asyncio.create_task(servicer.keep_shadow(), name="registry-shadow"),
        )
    clock = asyncio.create_task(servicer.run_clock(min(0.25, settings.lease_s / 4)))
    return RegistryServer(running, servicer, clock, etcd, replica_tasks)
