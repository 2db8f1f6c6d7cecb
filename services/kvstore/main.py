"""`pcpstack serve kvstore`: runs one KV store until SIGTERM.

Large protobuf bytes fields serialise far faster when glibc serves multi-MiB allocations from a heap it
does not hand back to the kernel after every chunk (each fresh page costs a fault and zeroing): with
both tunables below, building and serialising a 4 MiB chunk message runs ~5x faster here. glibc reads
its tunables only at process start, so `run` re-executes the process with them when they are missing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from services.common.logs import setup_logging
from services.common.server import DEFAULT_MAX_MESSAGE_BYTES, ServerOptions, serve_until_signalled
from services.common.telemetry import setup_telemetry, shutdown_telemetry

GLIBC_TUNABLES = ("glibc.malloc.mmap_threshold=33554432", "glibc.malloc.trim_threshold=1073741824")

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the store's options to `pcpstack serve kvstore`."""
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


def ensure_glibc_tunables() -> None:
    """Re-executes this process with the malloc tunables added to GLIBC_TUNABLES unless every one of them
    is already set (returns only then); tunables the launcher set are kept."""
    present = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t]
    names = {t.split("=", 1)[0] for t in present}
    missing = [t for t in GLIBC_TUNABLES if t.split("=", 1)[0] not in names]
    if missing:
        os.environ["GLIBC_TUNABLES"] = ":".join(present + missing)
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def run(args: argparse.Namespace) -> int:
    """Serves until SIGTERM or SIGINT; returns the exit status."""
    ensure_glibc_tunables()
    setup_logging("kvstore")
    setup_telemetry("kvstore")
    from services.kvstore.server import KvStoreServerConfig, serve

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
        try:
            await serve_until_signalled(server.running)
        finally:
            await server.stop()
            shutdown_telemetry()

    asyncio.run(main())
    return 0
