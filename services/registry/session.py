"""A worker node's link to the registry (prefill, decode, KV store): Register, the Session with its
heartbeats, status reports and the commands the registry sends.

    session = NodeSession("registry:7000", "node-3", "prefill", "10.0.0.3:8001", engine_config,
                          kv_fingerprint=fp, device_count=2, load=lambda: scheduler.queued)
    await session.start()
    async for command in session.commands():        # AssignCommand | StopCommand | AssemblyTimeout
        ...                                          # start or stop ranks, then:
        await session.report_status(a.set_id, a.generation, ready=True)

The session registers, keeps the Session open in the background with heartbeats at a third of the lease,
and survives a registry that is down or restarts: it retries with backoff, re-registers carrying the
assignment it runs (so a restarted registry rebuilds the same picture and nothing is re-launched), and
re-sends its last status. Every call carries this process's instance token, to which the registry binds the
node id while the session lives. Decode and KV store nodes are routable once registered; they call
report_status("", 0, ready=False) to leave routing and ready=True to come back. Where to send work is the
Resolver's business (`pcpstack.registry.resolver`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable

import grpc

from pcpstack.common.channel import open_channel
from pcpstack.common.config import EngineConfig
from pcpstack.common.errors import ServiceError
from pcpstack.common.rpc_errors import error_from_rpc
from pcpstack.registry.convert import (
    REFUSAL_METADATA,
    REFUSAL_NODE_ID_IN_USE,
    ROLE_VALUES,
)
from pcpstack.registry.resolver import CHANNEL_OPTIONS
from pcpstack.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

Command = registry_pb2.AssignCommand | registry_pb2.StopCommand | registry_pb2.AssemblyTimeout
# A Session is one long call; it is re-opened (cheaply, by re-registering) when this runs out.
SESSION_TIMEOUT_S = 3600.0
_PERMANENT = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


class _SessionLost(Exception):
    """The registry went silent or ended the stream."""


class NodeSession:
    """A node's registration, Session, status reports and commands."""

    def __init__(
        self,
        address: str,
        node_id: str,
        role: str,
        advertised_address: str,
        engine_config: EngineConfig | None = None,
        kv_fingerprint: str = "",
        device_count: int = 0,
        *,
        dist_host: str = "",
        host_id: str = "",
        load: Callable[[], int] | None = None,
        rpc_deadline_s: float = 5.0,
        retry_max_s: float = 2.0,
        in_use_patience_s: float | None = None,
    ) -> None:
        """address is the registry's host:port, or several replicas' separated by commas (the session moves
        to the next one when the one it uses is unreachable). role is "prefill", "decode"
        or "kvstore"; load() is read at every heartbeat (queued plus running requests) and steers
        least-loaded routing. A node id still bound to an earlier session (a node
        restarted within its old lease) is retried until that session ends, or for in_use_patience_s when
        given (then it counts as refused). host_id names the machine when the host of the advertised
        address does not (--host-id)."""
        if role not in ROLE_VALUES:
            raise ValueError(f"role={role!r} is not one of {', '.join(ROLE_VALUES)}")
        self._addresses = [a.strip() for a in address.split(",") if a.strip()]
        self.address = self._addresses[0]
        # registry replicas that failed since the last successful registration
        self._failed_in_row = 0
        self.node_id = node_id
        self._request = registry_pb2.RegisterRequest(
            node_id=node_id,
            role=ROLE_VALUES[role],
            address=advertised_address,
            device_count=device_count,
            engine_config=engine_config.to_proto() if engine_config is not None else None,
            kv_fingerprint=kv_fingerprint,
            dist_host=dist_host,
            host_id=host_id,
        )
        self._load = load
        self._in_use_patience_s = in_use_patience_s
        # this process's instance token: the registry binds the node id to it while the session lives
        self.instance_id = secrets.token_hex(16)
        self._request.instance_id = self.instance_id
        self._rpc_deadline_s = rpc_deadline_s
        self._retry_max_s = retry_max_s
        self._lease_s = 3.0
        self._assignment: registry_pb2.Assignment | None = None
        self._status: registry_pb2.RankStatus | None = None
        self._commands: asyncio.Queue[Command | None] = asyncio.Queue()
        self._registered = asyncio.Event()
        self._refused: ServiceError | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._write_lock = asyncio.Lock()
        self._channel: grpc.aio.Channel | None = None
        self._stub: registry_pb2_grpc.RegistryServiceStub | None = None
        self._task: asyncio.Task | None = None

    # --- life cycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts registering and keeping the Session in the background; returns at once (see
        wait_registered). A registry that is down is retried with backoff, never raised."""
        self._connect()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"registry-session-{self.node_id}")

    async def wait_registered(self, timeout: float | None = None) -> registry_pb2.Assignment | None:
        """Waits for the first successful registration and returns the assignment held then (None while
        pooled). Raises the registry's refusal (InvalidArgument, FailedPrecondition, PermissionDenied: the
        message says what to change) if it refused the node, TimeoutError on timeout."""
        await asyncio.wait_for(self._registered.wait(), timeout)
        if self._refused is not None:
            raise self._refused
        return self.assignment

    async def close(self, deregister: bool = False) -> None:
        """Stops the Session; with deregister, tells the registry the node is gone for good (its set is
        dissolved at once instead of after a lease)."""
        task, self._task = self._task, None
        if task is not None:
            # asyncio.wait_for (Python 3.11) can swallow a cancellation that races the completion of the
            # call it awaits, and the session then carries on: cancel until the task has ended
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.1)
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if deregister and self._stub is not None:
            try:
                await self._stub.Deregister(
                    registry_pb2.DeregisterRequest(node_id=self.node_id, instance_id=self.instance_id),
                    timeout=self._rpc_deadline_s,
                )
            except grpc.aio.AioRpcError as exc:
                log.warning("deregister failed", extra={"node_id": self.node_id, "error": exc.details()})
        self._commands.put_nowait(None)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # --- what the node reads -----------------------------------------------------------------------

    @property
    def assignment(self) -> registry_pb2.Assignment | None:
        """The assignment the node should be running (None while pooled)."""
        return self._assignment

    @property
    def registered(self) -> bool:
        """True once the registry answered a registration (accepted it, or refused it for good)."""
        return self._registered.is_set()

    @property
    def connected(self) -> bool:
        """True while a Session is open."""
        return self._call is not None

    async def next_command(self, timeout: float | None = None) -> Command | None:
        """The next command (AssignCommand, StopCommand or AssemblyTimeout); None once the client is
        closed or refused. Raises TimeoutError on timeout."""
        return await asyncio.wait_for(self._commands.get(), timeout)

    async def commands(self) -> AsyncIterator[Command]:
        """Commands as they come, until the client is closed or refused."""
        while (command := await self._commands.get()) is not None:
            yield command

    # --- what the node says ------------------------------------------------------------------------

    async def report_status(self, set_id: str, generation: int, ready: bool, error: str = "") -> None:
        """Reports the node's ranks as ready (or failed, with error) for one set generation; decode and KV
        store nodes pass set_id="" and generation=0. Remembered and re-sent after a reconnect."""
        self._status = registry_pb2.RankStatus(set_id=set_id, generation=generation, ready=ready, error=error)
        await self._send(registry_pb2.SessionRequest(status=self._status))

    # --- internals ---------------------------------------------------------------------------------

    def _connect(self) -> None:
        if self._channel is None:
            self._channel = open_channel(
                self.address, default_deadline=self._rpc_deadline_s, extra_options=CHANNEL_OPTIONS
            )
            self._stub = registry_pb2_grpc.RegistryServiceStub(self._channel)

    async def _next_registry(self) -> bool:
        """Moves to the next registry replica, when there are several; True while some replica has not
        been tried since the last success (the caller retries at once instead of backing off)."""
        if len(self._addresses) < 2:
            return False
        self._failed_in_row += 1
        self.address = self._addresses[(self._addresses.index(self.address) + 1) % len(self._addresses)]
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        self._connect()
        return self._failed_in_row % len(self._addresses) != 0

    async def _run(self) -> None:
        assert self._stub is not None
        delay = 0.1
        in_use_since: float | None = None
        while True:
            request = registry_pb2.RegisterRequest()
            request.CopyFrom(self._request)
            if self._assignment is not None:
                request.current_assignment.CopyFrom(self._assignment)
            try:
                response = await self._stub.Register(request, timeout=self._rpc_deadline_s)
            except grpc.aio.AioRpcError as exc:
                if _node_id_in_use(exc):
                    # the id is held by an earlier session (this node before a restart, or another node
                    # with the same id): it frees up when that session's lease runs out
                    now = time.monotonic()
                    in_use_since = now if in_use_since is None else in_use_since
                    patience = self._in_use_patience_s
                    if patience is None or now - in_use_since < patience:
                        log.warning(
                            "node id held by another session; retrying",
                            extra={"node_id": self.node_id, "error": exc.details(), "retry_in_s": delay},
                        )
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, self._retry_max_s)
                        continue
                if exc.code() in _PERMANENT:
                    log.error("registration refused", extra={"node_id": self.node_id, "error": exc.details()})
                    self._refused = error_from_rpc(exc)
                    self._registered.set()
                    self._commands.put_nowait(None)
                    return
                log.warning(
                    "registry unreachable; retrying",
                    extra={"node_id": self.node_id, "error": exc.code().name, "retry_in_s": delay},
                )
                if await self._next_registry():
                    continue
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_max_s)
                continue
            delay = 0.1
            in_use_since = None
            self._failed_in_row = 0
            self._lease_s = (response.lease_ms or 3000) / 1000
            if response.HasField("assignment"):
                self._apply_assignment(response.assignment)
            self._registered.set()
            try:
                await self._session()
            except (
                grpc.aio.AioRpcError,
                grpc.aio.UsageError,
                asyncio.InvalidStateError,
                _SessionLost,
            ) as exc:
                code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
                log.warning(
                    "registry session lost; reconnecting",
                    extra={"node_id": self.node_id, "error": code.name if code else str(exc)},
                )
                # NOT_FOUND (evicted, or a registry that restarted) and a session that simply ran its
                # course re-register at once; anything else waits a little first
                lost = code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED)
                if lost and not await self._next_registry():
                    await asyncio.sleep(delay)

    async def _session(self) -> None:
        assert self._stub is not None
        call = self._stub.Session(timeout=SESSION_TIMEOUT_S)
        self._call = call
        heartbeats = asyncio.create_task(self._heartbeat(call))
        try:
            await self._write(
                call,
                registry_pb2.SessionRequest(
                    open=registry_pb2.SessionOpen(node_id=self.node_id, instance_id=self.instance_id)
                ),
            )
            if self._status is not None and self._status_is_current():
                await self._write(call, registry_pb2.SessionRequest(status=self._status))
            # the registry acks every heartbeat (a third of the lease); two leases of silence mean it is
            # gone. One lease was too little: a registry held up for a lease (it excuses that time from
            # the nodes' leases) had every node drop its Session and register again at once
            patience = 2 * self._lease_s
            while True:
                try:
                    response = await asyncio.wait_for(call.read(), patience)
                except TimeoutError:
                    raise _SessionLost(f"no word from the registry for {patience:g} s") from None
                if response is grpc.aio.EOF:
                    raise _SessionLost("the registry ended the session")
                self._on_response(response)
        finally:
            self._call = None
            heartbeats.cancel()
            call.cancel()

    async def _heartbeat(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            await asyncio.sleep(self._lease_s / 3)
            beat = registry_pb2.Heartbeat(
                generation=self._assignment.generation if self._assignment is not None else 0,
                load=max(0, int(self._load())) if self._load is not None else 0,
            )
            try:
                await self._write(call, registry_pb2.SessionRequest(heartbeat=beat))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                return

    async def _write(self, call: grpc.aio.StreamStreamCall, message: registry_pb2.SessionRequest) -> None:
        async with self._write_lock:
            await call.write(message)

    async def _send(self, message: registry_pb2.SessionRequest) -> None:
        """Sends on the current Session if there is one; otherwise the reconnect re-sends the status."""
        call = self._call
        if call is None:
            return
        try:
            await self._write(call, message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            log.info("status not sent; will be re-sent after reconnecting", extra={"error": str(exc)})

    def _status_is_current(self) -> bool:
        status = self._status
        assert status is not None
        if self._assignment is None:
            return not status.set_id and not status.generation
        return (status.set_id, status.generation) == (self._assignment.set_id, self._assignment.generation)

    def _apply_assignment(self, assignment: registry_pb2.Assignment) -> None:
        # The same assignment again (a re-registration) must not re-launch anything.
        if self._assignment == assignment:
            return
        self._assignment = registry_pb2.Assignment()
        self._assignment.CopyFrom(assignment)
        self._commands.put_nowait(registry_pb2.AssignCommand(assignment=self._assignment))

    def _on_response(self, response: registry_pb2.SessionResponse) -> None:
        kind = response.WhichOneof("body")
        if kind == "assign":
            self._apply_assignment(response.assign.assignment)
        elif kind == "stop":
            stop = response.stop
            current = self._assignment
            if current is None or (stop.set_id, stop.generation) != (current.set_id, current.generation):
                log.info("stop for a set this node does not run; ignored", extra={"set_id": stop.set_id})
                return
            self._assignment = None
            self._status = None
            self._commands.put_nowait(stop)
        elif kind == "assembly_timeout":
            self._commands.put_nowait(response.assembly_timeout)
        elif kind == "refusal":
            log.warning(
                "registry refused a message",
                extra={"node_id": self.node_id, "reason": response.refusal.reason},
            )


def _node_id_in_use(exc: grpc.aio.AioRpcError) -> bool:
    """True when the registry refused because the node id is bound to another live session."""
    trailer = exc.trailing_metadata() or ()
    return any(key == REFUSAL_METADATA and value == REFUSAL_NODE_ID_IN_USE for key, value in trailer)
