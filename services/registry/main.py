"""`pcpstack serve registry`: run the registry in the foreground until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from pcpstack.common import security
from pcpstack.common.logs import setup_logging
from pcpstack.common.server import DEFAULT_MAX_MESSAGE_BYTES, ServerOptions, serve_until_signalled
from pcpstack.common.telemetry import setup_telemetry, shutdown_telemetry
from pcpstack.registry.membership import Settings
from pcpstack.registry.server import start_registry

log = logging.getLogger(__name__)
DEFAULT_PORT = 7000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The registry's command-line options."""
    security.add_security_arguments(parser)
    parser.add_argument(
        "--verify-peer-address",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="refuse a node that advertises a host other than the one it connects from, unless its TLS "
        "certificate names it (loopback peers may advertise any loopback address; default on)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument(
        "--lease", type=float, default=3.0, help="seconds of silence after which a node is dead (default 3)"
    )
    parser.add_argument(
        "--assembly-timeout",
        type=float,
        default=60.0,
        help="seconds pooled nodes wait for a set to fill before they are told so (default 60)",
    )
    parser.add_argument(
        "--restore-grace",
        type=float,
        default=None,
        help="seconds after start during which nodes re-register with their assignments before new sets "
        "are formed (default: 2 x lease; 0 with --snapshot when no snapshot exists yet)",
    )
    parser.add_argument(
        "--snapshot", type=Path, default=None, help="file to keep a snapshot in, so a restart is faster"
    )
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--metrics", default="", metavar="HOST:PORT", help="serve Prometheus metrics here")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from parsed options; refuses non-positive durations with a message naming the option."""
    for name in ("lease", "assembly_timeout"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)} must be > 0")
    grace = 2 * args.lease if args.restore_grace is None else args.restore_grace
    if grace < 0:
        raise SystemExit(f"--restore-grace={grace} must be >= 0")
    return Settings(lease_s=args.lease, assembly_timeout_s=args.assembly_timeout, restore_grace_s=grace)


async def _serve(args: argparse.Namespace) -> None:
    settings = settings_from_args(args)
    options = ServerOptions(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes)
    registry = await start_registry(settings, options, args.snapshot, args.verify_peer_address)
    log.info("registry serving", extra={"address": registry.address, "lease_s": settings.lease_s})
    await serve_until_signalled(registry.running, registry.stop)


def run(args: argparse.Namespace) -> int:
    """Serves until signalled; returns the exit status."""
    setup_logging("registry", args.log_level)
    security.configure(security.security_from_args(args))
    setup_telemetry("registry", metrics_address=args.metrics)
    try:
        asyncio.run(_serve(args))
    finally:
        shutdown_telemetry()
    return 0
