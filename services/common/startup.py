"""The one start-up path of every pcpstack service process.

A service's `main.py` declares its flags, builds its typed config from them (a dataclass that validates
itself) and hands a `start` coroutine to `run_service`, which does the rest the same way for everyone:

1. glibc malloc tunables (the process re-executes itself once, before any work, when a service asks);
2. the shared process flags: log level, Prometheus metrics address, transport security (flags or env);
3. the service's config; a broken rule in any of them, or in `start`, ends the process with exit status 2
   and one line on stderr that names the key, the value and the rule (no traceback);
4. logging and telemetry;
5. `start(config)`, which returns a `Serving`; then it serves until SIGTERM/SIGINT (or until it stops on
   its own) and drains: the service's own stop steps, then its gRPC server goes NOT_SERVING in health,
   stops taking calls and lets running ones finish within the grace period.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

from pcpstack.common import security
from pcpstack.common.config import (
    COPY_CRC_CHOICES,
    COPY_CRC_ENV,
    CPU_KERNELS_CHOICES,
    CPU_KERNELS_ENV,
    DENSE_MATMUL_CHOICES,
    DENSE_MATMUL_ENV,
    DEVICE_KINDS,
    KERNEL_MIN_SPEEDUP_ENV,
    ROLE_SECTIONS,
    ConfigError,
    EngineConfig,
    check_addresses,
    check_dialable_host,
    check_host_id,
    check_model_source,
    check_node_id,
    check_port,
    env_choice,
    env_positive_float,
    parse_overrides,
    role_config,
)
from pcpstack.common.errors import Unavailable
from pcpstack.common.lifetime import exit_service_with_parent
from pcpstack.common.logs import chosen_log_format, setup_logging
from pcpstack.common.server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RunningServer,
    ServerOptions,
    check_max_message_bytes,
)
from pcpstack.common.telemetry import setup_telemetry, shutdown_telemetry
from pcpstack.common.tunables import ensure_glibc_tunables

log = logging.getLogger(__name__)

CONFIG_EXIT_STATUS = 2
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

C = TypeVar("C")
N = TypeVar("N", bound="NodeConfig")


@dataclass(frozen=True)
class ProcessConfig:
    """What every service process shares: its name, log level and metrics address; validated when built."""

    service: str
    log_level: str = "INFO"
    # HOST:PORT to serve Prometheus metrics on; empty: none.
    metrics: str = ""

    def __post_init__(self) -> None:
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError.broken("--log-level", self.log_level, f"must be one of {', '.join(LOG_LEVELS)}")
        chosen_log_format()  # PCPSTACK_LOG_FORMAT: refused here, not when logging starts
        if self.metrics:
            _, sep, port = self.metrics.rpartition(":")
            if not sep or not port.isdigit():
                raise ConfigError.broken("--metrics", self.metrics, "must be HOST:PORT")
            check_port("--metrics", int(port))

    @classmethod
    def from_args(cls, service: str, args: argparse.Namespace) -> ProcessConfig:
        """Reads the flags add_process_arguments declared."""
        return cls(service, args.log_level, getattr(args, "metrics", ""))


def add_process_arguments(parser: argparse.ArgumentParser, metrics: bool = True) -> None:
    """The flags every service has: security (--tls-*, --token*), --log-level and, unless metrics is
    False, --metrics."""
    security.add_security_arguments(parser)
    parser.add_argument("--log-level", default="INFO", help=f"one of {', '.join(LOG_LEVELS)} (default INFO)")
    if metrics:
        parser.add_argument(
            "--metrics", default="", metavar="HOST:PORT", help="serve Prometheus metrics here"
        )


def config_from_args(cls: type[C], args: argparse.Namespace, **given: Any) -> C:
    """Builds a service config whose field names are the dests of its flags; `given` supplies the fields
    that are computed from the flags rather than copied."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name not in given}
    return cls(**values, **given)


HOST_ID_HELP = (
    "the machine this node runs on, for routers that prefer a KV store on a decode worker's own machine "
    "(shared memory), when the advertised address's host does not say it, e.g. the Kubernetes node name "
    "(default: the advertised host)"
)


def add_node_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    """The flags of a model-serving node (prefill, decode): its registry, where it listens and is reached,
    its identity, its engine config (a seed-style file, --set overrides, --model), and its message limit."""
    parser.add_argument(
        "--registry",
        required=True,
        help="registry HOST:PORT (several, comma-separated: registry replicas, tried in turn)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (default: any free port)")
    parser.add_argument("--advertise", default="", help="host others reach this node at (default: --host)")
    parser.add_argument("--node-id", default="", help="stable node identity (default: hostname-port)")
    parser.add_argument("--host-id", default="", help=HOST_ID_HELP)
    parser.add_argument("--config", help=f"seed-style JSON with {ROLE_SECTIONS[role]}")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="engine_config override"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="model: a .gguf file, a HF folder, a HF repo id in the local cache, 'tiny'; default SmolLM2",
    )
    parser.add_argument(
        "--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, help="largest gRPC message"
    )
    parser.add_argument(
        "--device",
        default="",
        choices=("", *DEVICE_KINDS),
        metavar="{" + ",".join(DEVICE_KINDS) + "}",
        help="where the model runs: cpu, cuda or npu (default: an NPU, else a GPU, else the CPU)",
    )


@dataclass(frozen=True, kw_only=True)
class ListenConfig:
    """Where a gRPC service listens (--host, --port, --max-message-bytes), validated when built.

    The base of the services' configs; they are keyword-only so a subclass may add required fields.
    """

    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        check_port("--port", self.port)
        check_max_message_bytes("--max-message-bytes", self.max_message_bytes)

    def server_options(self) -> ServerOptions:
        """The options start_server listens with."""
        return ServerOptions(host=self.host, port=self.port, max_message_bytes=self.max_message_bytes)


@dataclass(frozen=True, kw_only=True)
class NodeConfig(ListenConfig):
    """What every model-serving node's config holds (add_node_arguments' flags), validated when built.

    A subclass sets `role` and adds its own fields and checks.
    """

    role: ClassVar[str]

    # Whether this role runs tensor_parallel_size > 1 (a role that cannot yet refuses it at start-up).
    tensor_parallel: ClassVar[bool] = False
    # Whether this role acts on decode_context_parallel_size > 1 (only decode does).
    decode_context_parallel: ClassVar[bool] = False

    registry: str
    engine: EngineConfig
    advertise: str = ""
    node_id: str = ""
    host_id: str = ""
    # cpu, cuda or npu; empty: what engine.device.pick_device finds.
    device: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_addresses("--registry", self.registry, required=True)
        # the address the node registers: the registry refuses a wildcard, and the node would retry forever
        check_dialable_host("--advertise" if self.advertise else "--host", self.advertised_host)
        check_node_id("--node-id", self.node_id)
        check_host_id("--host-id", self.host_id)
        check_model_source("model", self.engine.model)
        if self.device and self.device not in DEVICE_KINDS:
            raise ConfigError.broken("--device", self.device, f"must be one of {', '.join(DEVICE_KINDS)}")
        # Read by the engine and the KV copies, in rank processes too: refused here, before any starts.
        env_choice(CPU_KERNELS_ENV, CPU_KERNELS_CHOICES)
        env_choice(DENSE_MATMUL_ENV, DENSE_MATMUL_CHOICES)
        env_choice(COPY_CRC_ENV, COPY_CRC_CHOICES)
        env_positive_float(KERNEL_MIN_SPEEDUP_ENV, 1.0)
        # Settings the config rules accept (`pcpstack config check` validates the seeds' shapes) but no
        # service acts on yet: refused here rather than accepted and silently ignored.
        not_yet = [("kv_transfer_mode", self.engine.kv_transfer_mode, "whole", "a layerwise KV transfer")]
        if not self.decode_context_parallel:
            dcp = self.engine.decode_context_parallel_size
            not_yet.append(("decode_context_parallel_size", dcp, 1, "decode CP"))
        if not self.tensor_parallel:
            tp = self.engine.tensor_parallel_size
            not_yet.append(("tensor_parallel_size", tp, 1, "tensor parallelism"))
        for key, value, supported, what in not_yet:
            if value != supported:
                raise ConfigError(
                    f"{key}={value!r}: {what} is not wired into the {self.role} service yet; "
                    f"set {key}={supported!r}",
                    (key,),
                    f"{key} == {supported!r} until it is wired into the services",
                )

    @classmethod
    def from_args(cls: type[N], args: argparse.Namespace) -> N:
        """The config the flags (and the config file they name) describe."""
        engine = role_config(cls.role, args.config, parse_overrides(args.set), args.model)
        return config_from_args(cls, args, engine=engine)

    @property
    def advertised_host(self) -> str:
        """The host other nodes reach this one at."""
        return self.advertise or self.host

    @property
    def machine(self) -> str:
        """The machine routers take this node to run on: --host-id, else the advertised host."""
        return self.host_id or self.advertised_host


@dataclass
class Serving:
    """A started service as the start-up path drives it.

    `drain` runs once when the process is told to stop (or when `stopped` completes): it stops what the
    service started, in its order. `stopped`, when given, completes if the service ends on its own (its
    gRPC server was stopped), so the process exits then too.
    """

    drain: Callable[[], Awaitable[None]]
    stopped: Awaitable[object] | None = None

    @classmethod
    def grpc(
        cls, running: RunningServer, before_stop: Callable[[], Awaitable[None]] | None = None
    ) -> Serving:
        """A gRPC service: `before_stop` (deregister, stop workers) first, then the server's graceful stop."""

        async def drain() -> None:
            if before_stop is not None:
                await before_stop()
            await running.stop()

        return cls(drain, running.wait_for_termination())


class DrainGate:
    """The requests a service is running, and the gate new ones pass: once closed (the service drains), a
    new request is refused Unavailable, so its client retries elsewhere, while running ones may finish."""

    def __init__(self) -> None:
        self._running = 0
        self._closed = False
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def running(self) -> int:
        """Requests admitted and not finished."""
        return self._running

    @property
    def closed(self) -> bool:
        """Whether new requests are refused (the service drains)."""
        return self._closed

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Holds one request while it runs; raises Unavailable once the gate is closed."""
        if self._closed:
            raise Unavailable("this worker is draining (shutting down): send the request to another one")
        self._running += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    def close(self) -> None:
        """Refuses every request from now on."""
        self._closed = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no request runs, at most timeout_s seconds; whether none runs."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


async def serve_until_stopped(serving: Serving) -> bool:
    """Waits for SIGTERM/SIGINT or for the service to stop by itself, then drains it.

    Returns True when a signal ended it.
    """
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled.set)
    waiters = [asyncio.ensure_future(signalled.wait())]
    if serving.stopped is not None:
        waiters.append(asyncio.ensure_future(serving.stopped))
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if signalled.is_set():
            log.info("signal received; draining")
        await serving.drain()
    finally:
        for waiter in waiters:
            waiter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiter
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return signalled.is_set()


def config_error_line(service: str, error: Exception) -> str:
    """The one stderr line a refused start-up prints: service, then the error's own key=value: rule."""
    text = " ".join(str(error).split())
    return f"pcpstack serve {service}: config error: {text}"


def run_service(
    service: str,
    args: argparse.Namespace,
    build: Callable[[argparse.Namespace], C],
    start: Callable[[C], Awaitable[Serving]],
    *,
    glibc_tunables: bool = False,
) -> int:
    """Starts one service process the shared way (see the module docstring); returns its exit status.

    `build` turns the parsed flags into the service's typed config and must be cheap (no model loading):
    it runs before logging and telemetry, so a bad flag costs nothing. `start` does the heavy work (a
    model load may still find a config that breaks a rule: a ConfigError from it exits 2 as well).
    """
    if glibc_tunables:
        ensure_glibc_tunables()
    exit_service_with_parent(service)
    try:
        process = ProcessConfig.from_args(service, args)
        process_security = security.security_from_args(args)
        config = build(args)
    except (ConfigError, security.SecurityConfigError) as exc:
        print(config_error_line(service, exc), file=sys.stderr, flush=True)
        return CONFIG_EXIT_STATUS
    setup_logging(service, process.log_level.upper())
    security.configure(process_security)
    try:
        setup_telemetry(service, metrics_address=process.metrics)
    except ConfigError as exc:  # --metrics cannot be bound
        print(config_error_line(service, exc), file=sys.stderr, flush=True)
        return CONFIG_EXIT_STATUS

    async def main() -> None:
        serving = await start(config)
        await serve_until_stopped(serving)

    try:
        asyncio.run(main())
    except ConfigError as exc:
        print(config_error_line(service, exc), file=sys.stderr, flush=True)
        return CONFIG_EXIT_STATUS
    finally:
        shutdown_telemetry()
    return 0
