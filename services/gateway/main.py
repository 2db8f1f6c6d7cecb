"""Run the gateway: `pcpstack serve gateway (--decode HOST:PORT ... | --registry HOST:PORT) [--port 8000]`.

An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) that
translates each request to Decode.Generate on a decode worker: a fixed list given with --decode, or the live
workers the registry names.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from aiohttp import web

from pcpstack.common import security
from pcpstack.common.config import DEFAULT_MODEL_NAME
from pcpstack.common.logs import setup_logging
from pcpstack.common.telemetry import setup_telemetry, shutdown_telemetry
from pcpstack.gateway.server import GatewaySettings, create_app
from pcpstack.gateway.upstream import DecodePool

# The name decode workers serve the default model under (services/decode/main.py, served_model_name).


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pcpstack serve gateway`."""
    security.add_security_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to bind (default 8000; 0: any free port)"
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a decode worker (repeatable, or a comma-separated list)",
    )
    parser.add_argument("--registry", default="", help="registry HOST:PORT to find decode workers through")
    parser.add_argument(
        "--model-name",
        default=DEFAULT_MODEL_NAME,
        help=f"the model name clients send; must be the one decode serves (default {DEFAULT_MODEL_NAME})",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds one request may take (default 600)"
    )


def decode_addresses(values: list[str]) -> list[str]:
    """--decode values, each possibly a comma-separated list, flattened."""
    return [address.strip() for value in values for address in value.split(",") if address.strip()]


async def serve(args: argparse.Namespace) -> None:
    """Serves until SIGTERM/SIGINT."""
    pool = DecodePool(decode_addresses(args.decode), args.registry)
    app = create_app(pool, GatewaySettings(args.model_name, args.request_timeout))
    # handler_cancellation: a client that hangs up cancels its handler, and so its decode request.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"gateway listening on http://{args.host}:{port}/v1 (model {args.model_name})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    """Entry point of `pcpstack serve gateway`."""
    setup_logging("gateway")
    security.configure(security.security_from_args(args))
    if not decode_addresses(args.decode) and not args.registry:
        print("config error: give --decode HOST:PORT or --registry HOST:PORT", flush=True)
        return 2
    setup_telemetry("gateway")
    try:
        asyncio.run(serve(args))
    finally:
        shutdown_telemetry()
    return 0
