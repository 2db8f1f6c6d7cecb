"""The one way a pcpstack service starts its gRPC server.

Every server gets the standard health service, server reflection, a bind address that defaults to
loopback, a configurable message size limit, and a graceful stop (health goes NOT_SERVING, no new calls,
running ones finish within a grace period, then the rest are cancelled); the process around it starts and
drains through pcpstack.common.startup. Its security (mutual TLS, the
bearer-token check) is the process's configured one (pcpstack.common.security) unless options give another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from pcpstack.common import security as security_mod
from pcpstack.common.config import ConfigError, check_non_negative, check_port, join_host_port, unbindable
from pcpstack.common.ports import check_bindable
from pcpstack.common.request_decoding import DecodingInterceptor
from pcpstack.common.rpc_errors import ErrorInterceptor
from pcpstack.common.telemetry import server_interceptors

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Every service's messages (a prompt's token ids, a registry's answer, a KV chunk and its framing) need
# room: a limit below this is a mistake, not a tuning (the KV store's own floor is higher).
MIN_MESSAGE_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC keeps its message limits in a C int


def check_max_message_bytes(key: str, value: object) -> None:
    """A gRPC message size limit: at least MIN_MESSAGE_BYTES, at most what gRPC takes (a C int)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < MIN_MESSAGE_BYTES:
        raise ConfigError.broken(
            key, value, f"must be at least {MIN_MESSAGE_BYTES} (64 KiB) for any service's messages to fit"
        )
    if value > MAX_MESSAGE_BYTES:
        raise ConfigError.broken(key, value, f"must be at most {MAX_MESSAGE_BYTES} (2 GiB - 1, gRPC's limit)")


@dataclass(frozen=True)
class ServerOptions:
    """Where and how a service listens; validated when built (ConfigError naming the field)."""

    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_seconds: float = 5.0
    # None: the process-wide security (security.current()), which is plaintext and no token by default.
    security: security_mod.Security | None = None

    def __post_init__(self) -> None:
        check_port("port", self.port)
        check_max_message_bytes("max_message_bytes", self.max_message_bytes)
        check_non_negative("grace_seconds", self.grace_seconds)

    def channel_options(self) -> list[tuple[str, int]]:
        """gRPC options that apply the message size limit in both directions."""
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]


class RunningServer:
    """A started server: its bound port, its health servicer, and a way to stop it."""

    def __init__(
        self, server: grpc.aio.Server, host: str, port: int, health: health_aio.HealthServicer, grace: float
    ):
        self.server = server
        self.host = host
        self.port = port
        self.health = health
        self._grace = grace
        self._stopped = asyncio.Event()

    @property
    def address(self) -> str:
        """host:port clients dial."""
        return join_host_port(self.host, self.port)

    async def set_serving(self, service: str, serving: bool) -> None:
        """Reports one service (or "" for the whole server) as SERVING or NOT_SERVING."""
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set(service, status)

    async def stop(self, grace: float | None = None) -> None:
        """Stops taking calls, waits up to grace seconds for running ones, then cancels them."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self._grace if grace is None else grace)

    async def wait_for_termination(self) -> None:
        """Returns when the server has stopped."""
        await self.server.wait_for_termination()


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    options: ServerOptions = ServerOptions(),
) -> RunningServer:
    """Builds, binds and starts a server; `register` adds the service's servicers to it.

    service_names are the full proto names (e.g. "pcpstack.v1.KvStoreService"); they are published in
    reflection and marked SERVING in health.
    """
    security = options.security if options.security is not None else security_mod.current()
    # Authentication runs first; the error interceptor makes a servicer's ServiceError the caller's gRPC
    # status; innermost, the decoding interceptor answers request bytes that do not decode INVALID_ARGUMENT.
    interceptors = [
        *server_interceptors(),
        *security.server_interceptors(),
        ErrorInterceptor(),
        DecodingInterceptor(),
    ]
    server = grpc.aio.server(options=options.channel_options(), interceptors=interceptors)
    register(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
    )
    credentials = security.server_credentials()
    bind = join_host_port(options.host, options.port)
    if options.port:
        try:
            check_bindable(options.host, options.port)
        except OSError as exc:
            raise unbindable("--host/--port", bind, exc) from None
    try:  # grpcio raises RuntimeError("Failed to bind ...") where older versions returned 0
        port = (
            server.add_insecure_port(bind)
            if credentials is None
            else server.add_secure_port(bind, credentials)
        )
    except RuntimeError as exc:  # its text ends in advice about GRPC_VERBOSITY; the core logged the cause
        raise unbindable("--host/--port", bind, RuntimeError(str(exc).split(";")[0])) from None
    if port == 0:
        raise unbindable("--host/--port", bind, OSError("no port was bound"))
    await server.start()
    running = RunningServer(server, options.host, port, health, options.grace_seconds)
    for name in ["", *names]:
        await running.set_serving(name, True)
    return running


async def serve_until_signalled(running: RunningServer, on_stop: Callable[[], object] | None = None) -> None:
    """Serves a bare server until SIGTERM or SIGINT, then shuts it down gracefully; on_stop (sync or async)
    runs first. Services go through pcpstack.common.startup.run_service, which drains the same way."""

    # Imported here: the start-up path builds on this module.
    from pcpstack.common.startup import Serving, serve_until_stopped

    async def before_stop() -> None:
        if on_stop is not None:
            result = on_stop()
            if asyncio.iscoroutine(result):
                await result

    await serve_until_stopped(Serving.grpc(running, before_stop))
