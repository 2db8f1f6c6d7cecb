"""`pcpstack serve kvstore`: runs one KV store until SIGTERM, registered with the registry when given.

The process re-executes itself with the glibc malloc tunables of pcpstack.common.tunables (large chunk
messages are ~5x faster with them).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys

from pcpstack.common import security
from pcpstack.common.logs import setup_logging
from pcpstack.common.server import DEFAULT_MAX_MESSAGE_BYTES, ServerOptions, serve_until_signalled
from pcpstack.common.telemetry import setup_telemetry, shutdown_telemetry
from pcpstack.common.tunables import ensure_glibc_tunables

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the store's options to `pcpstack serve kvstore`."""
    security.add_security_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=50053, help="port to bind (0: any free port)")
    parser.add_argument("--capacity-bytes", type=int, default=8 << 30, help="memory budget for objects")
    parser.add_argument(
        "--default-lease-ms", type=int, default=60_000, help="pin lease when a put gives none"
    )
    parser.add_argument("--shm-dir", default="/dev/shm", help="tmpfs directory for the store's segments")
    parser.add_argument(
        "--reap-interval-s", type=float, default=0.5, help="how often expired leases are reaped"
    )
    parser.add_argument(
        "--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, help="gRPC message size limit"
    )
    parser.add_argument("--registry", default="", help="registry HOST:PORT to register with (optional)")
    parser.add_argument(
        "--advertise", default="", help="host other nodes reach this store at (default: --host)"
    )
    parser.add_argument("--node-id", default="", help="stable node identity (default: hostname-port)")
    parser.add_argument("--metrics", default="", metavar="HOST:PORT", help="serve Prometheus metrics here")


def run(args: argparse.Namespace) -> int:
    """Serves until SIGTERM or SIGINT; returns the exit status."""
    ensure_glibc_tunables()
    setup_logging("kvstore")
    security.configure(security.security_from_args(args))
    setup_telemetry("kvstore", metrics_address=args.metrics)
    from pcpstack.kvstore.server import KvStoreServerConfig, serve

    try:
        config = KvStoreServerConfig(
            capacity_bytes=args.capacity_bytes,
            default_lease_ms=args.default_lease_ms,
            shm_dir=args.shm_dir,
            reap_interval_s=args.reap_interval_s,
        )
    except ValueError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        server = await serve(config, ServerOptions(args.host, args.port, args.max_message_bytes))
        log.info(
            "kvstore serving", extra={"address": server.address, "capacity_bytes": config.capacity_bytes}
        )
        # The address line on stdout lets a parent that asked for port 0 find the store.
        print(f"kvstore listening on {server.address}", flush=True)
        registry = None
        if args.registry:
            from pcpstack.registry.client import NodeSession

            port = server.address.rsplit(":", 1)[1]
            registry = NodeSession(
                args.registry,
                node_id=args.node_id or f"{socket.gethostname()}-kvstore-{port}",
                role="kvstore",
                advertised_address=f"{args.advertise or args.host}:{port}",
            )
            await registry.start()
        try:
            await serve_until_signalled(server.running)
        finally:
            if registry is not None:
                await registry.close(deregister=True)
            await server.stop()
            shutdown_telemetry()

    asyncio.run(main())
    return 0
