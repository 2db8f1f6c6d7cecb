"""Run the gateway: `pcpstack serve gateway (--decode HOST:PORT ... | --registry HOST:PORT) [--port 8000]`.

An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) that
translates each request to Decode.Generate on a decode worker: a fixed list given with --decode, or the live
workers the registry names.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pcpstack.common.config import (
    DEFAULT_MODEL_NAME,
    ConfigError,
    check_address,
    check_port,
    check_positive,
)
from pcpstack.common.startup import Serving, add_process_arguments, config_from_args, run_service


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pcpstack serve gateway`."""
    # The gateway's metrics are its own HTTP /metrics, so it has no --metrics.
    add_process_arguments(parser, metrics=False)
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


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway process's configuration, validated when built; errors name the flag."""

    decode: tuple[str, ...] = ()
    registry: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = DEFAULT_MODEL_NAME
    request_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.decode and not self.registry:
            raise ConfigError(
                "--decode and --registry are both empty: give --decode HOST:PORT or --registry HOST:PORT",
                ("--decode", "--registry"),
                "an upstream is required",
            )
        for address in self.decode:
            check_address("--decode", address)
        check_address("--registry", self.registry)
        check_port("--port", self.port)
        if not self.model_name.strip():
            raise ConfigError.broken("--model-name", self.model_name, "must not be empty")
        check_positive("--request-timeout", self.request_timeout)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        """The config the flags describe."""
        return config_from_args(cls, args, decode=tuple(decode_addresses(args.decode)))


async def start(config: GatewayConfig) -> Serving:
    """Starts the HTTP server; draining lets running requests finish and closes the decode pool."""
    from aiohttp import web

    from pcpstack.gateway.server import GatewaySettings, create_app
    from pcpstack.gateway.upstream import DecodePool

    pool = DecodePool(list(config.decode), config.registry)
    app = create_app(pool, GatewaySettings(config.model_name, config.request_timeout))
    # handler_cancellation: a client that hangs up cancels its handler, and so its decode request.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    print(f"gateway listening on http://{config.host}:{port}/v1 (model {config.model_name})", flush=True)
    return Serving(runner.cleanup)


def run(args: argparse.Namespace) -> int:
    """Entry point of `pcpstack serve gateway`."""
    return run_service("gateway", args, GatewayConfig.from_args, start)
