"""`pcpstack serve kvstore`: runs one KV store until SIGTERM, registered with the registry when given.

The process re-executes itself with the glibc malloc tunables of pcpstack.common.tunables (large chunk
messages are ~5x faster with them).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pcpstack.common.config import (
    COPY_CRC_CHOICES,
    COPY_CRC_ENV,
    ConfigError,
    check_addresses,
    check_host_id,
    check_node_id,
    check_positive,
    env_choice,
)
from pcpstack.common.server import DEFAULT_MAX_MESSAGE_BYTES
from pcpstack.common.startup import (
    HOST_ID_HELP,
    ListenConfig,
    Serving,
    add_process_arguments,
    config_from_args,
    run_service,
)
from pcpstack.kvstore.store import DEFAULT_MAX_LEASE_MS

if TYPE_CHECKING:
    from pcpstack.kvstore.server import KvStoreServerConfig

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the store's options to `pcpstack serve kvstore`."""
    add_process_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=50053, help="port to bind (0: any free port)")
    parser.add_argument("--capacity-bytes", type=int, default=8 << 30, help="memory budget for objects")
    parser.add_argument(
        "--default-lease-ms", type=int, default=60_000, help="pin lease when a put gives none"
    )
    parser.add_argument(
        "--max-lease-ms",
        type=int,
        default=None,
        help=f"longest pin lease a writer may ask for (default: {DEFAULT_MAX_LEASE_MS}, ten minutes)",
    )
    parser.add_argument("--shm-dir", default="/dev/shm", help="tmpfs directory for the store's segments")
    parser.add_argument(
        "--reap-interval-s", type=float, default=0.5, help="how often expired leases are reaped"
    )
    parser.add_argument(
        "--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, help="largest gRPC message"
    )
    parser.add_argument(
        "--registry",
        default="",
        help=(
            "registry HOST:PORT to register with (optional; several, comma-separated: "
            "registry replicas, tried in turn)"
        ),
    )
    parser.add_argument(
        "--advertise", default="", help="host other nodes reach this store at (default: --host)"
    )
    parser.add_argument("--node-id", default="", help="stable node identity (default: hostname-port)")
    parser.add_argument("--host-id", default="", help=HOST_ID_HELP)


@dataclass(frozen=True, kw_only=True)
class KvStoreConfig(ListenConfig):
    """The KV store process's configuration, validated when built; errors name the flag."""

    port: int = 50053
    capacity_bytes: int = 8 << 30
    default_lease_ms: int = 60_000
    # None: the store's own limit.
    max_lease_ms: int | None = None
    shm_dir: str = "/dev/shm"
    reap_interval_s: float = 0.5
    registry: str = ""
    advertise: str = ""
    node_id: str = ""
    host_id: str = ""

    def __post_init__(self) -> None:
        self._check_max_message_bytes()  # first: its floor is above the one every service has
        super().__post_init__()
        check_positive("--capacity-bytes", self.capacity_bytes)
        check_node_id("--node-id", self.node_id)
        check_host_id("--host-id", self.host_id)
        check_positive("--default-lease-ms", self.default_lease_ms)
        if self.max_lease_ms is not None:
            check_positive("--max-lease-ms", self.max_lease_ms)
        max_lease_ms = DEFAULT_MAX_LEASE_MS if self.max_lease_ms is None else self.max_lease_ms
        if self.default_lease_ms > max_lease_ms:
            given = "" if self.max_lease_ms is not None else " (its default)"
            raise ConfigError(
                f"--default-lease-ms={self.default_lease_ms} and --max-lease-ms={max_lease_ms}{given}: "
                "the default lease must not exceed the longest one",
                ("--default-lease-ms", "--max-lease-ms"),
                "default lease <= max lease",
            )
        check_positive("--reap-interval-s", self.reap_interval_s)
        check_addresses("--registry", self.registry)
        if not self.registry:
            # what the store tells a registry: without one, nobody would read it
            for flag, value in (
                ("--advertise", self.advertise),
                ("--node-id", self.node_id),
                ("--host-id", self.host_id),
            ):
                if value:
                    raise ConfigError.broken(flag, value, "is what the store registers: it needs --registry")
        env_choice(COPY_CRC_ENV, COPY_CRC_CHOICES)
        if not os.path.isdir(self.shm_dir) or not os.access(self.shm_dir, os.W_OK | os.X_OK):
            raise ConfigError.broken("--shm-dir", self.shm_dir, "must be a writable folder (a tmpfs)")
        self.server_config()

    def _check_max_message_bytes(self) -> None:
        # Streamed puts arrive in the clients' chunks (stream.DEFAULT_CHUNK_BYTES) plus framing: a store
        # whose messages cannot hold one refuses every streamed put.
        from pcpstack.kvstore.server import MESSAGE_OVERHEAD
        from pcpstack.kvstore.stream import DEFAULT_CHUNK_BYTES

        floor = DEFAULT_CHUNK_BYTES + MESSAGE_OVERHEAD
        if self.max_message_bytes < floor:
            raise ConfigError.broken(
                "--max-message-bytes",
                self.max_message_bytes,
                f"must be at least {floor} for a store: the clients' {DEFAULT_CHUNK_BYTES}-byte chunks and "
                f"{MESSAGE_OVERHEAD} bytes of framing must fit one message",
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> KvStoreConfig:
        """The config the flags describe."""
        return config_from_args(cls, args)

    def server_config(self) -> KvStoreServerConfig:
        """The store server's own config; a rule it adds that these flags break is a ConfigError too."""
        from pcpstack.kvstore.server import KvStoreServerConfig

        limits = {} if self.max_lease_ms is None else {"max_lease_ms": self.max_lease_ms}
        try:
            return KvStoreServerConfig(
                capacity_bytes=self.capacity_bytes,
                default_lease_ms=self.default_lease_ms,
                shm_dir=self.shm_dir,
                reap_interval_s=self.reap_interval_s,
                **limits,
            )
        except ValueError as exc:
            raise ConfigError(f"kvstore: {exc}", (), "store limits") from None


async def start(config: KvStoreConfig) -> Serving:
    """Starts the store (and its registration); draining deregisters first, then stops the server."""
    from pcpstack.kvstore import copy_crc
    from pcpstack.kvstore.server import serve

    # Built (or loaded from its cache) now, not in the first put; PCPSTACK_COPY_CRC=1 where it cannot be
    # had is refused here.
    copy_crc.library()
    server = await serve(config.server_config(), config.server_options())
    log.info("kvstore serving", extra={"address": server.address, "capacity_bytes": config.capacity_bytes})
    # The address line on stdout lets a parent that asked for port 0 find the store.
    print(f"kvstore listening on {server.address}", flush=True)
    registry = None
    if config.registry:
        from pcpstack.registry.client import NodeSession

        port = server.address.rsplit(":", 1)[1]
        registry = NodeSession(
            config.registry,
            node_id=config.node_id or f"{socket.gethostname()}-kvstore-{port}",
            role="kvstore",
            advertised_address=f"{config.advertise or config.host}:{port}",
            host_id=config.host_id,
            load=server.servicer.store.load_percent,
        )
        await registry.start()

    async def drain() -> None:
        if registry is not None:
            await registry.close(deregister=True)
        await server.stop()

    return Serving(drain, server.running.wait_for_termination())


def run(args: argparse.Namespace) -> int:
    """Serves until SIGTERM or SIGINT; returns the exit status."""
    return run_service("kvstore", args, KvStoreConfig.from_args, start, glibc_tunables=True)
