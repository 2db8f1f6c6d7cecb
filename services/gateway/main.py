"""Run the gateway: `pcpstack serve gateway (--decode HOST:PORT ... | --registry HOST:PORT) [--port 8000]`.

An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize,
/version, /health, /metrics) that translates each request to Decode.Generate on a decode worker: a fixed
list given with --decode, or the live workers the registry names. --api-key (or --api-key-file) requires
`Authorization: Bearer <key>` on every route but /health, /metrics and /version. With TLS configured (the
shared --tls-ca/--tls-cert/--tls-key, or their environment variables) the gateway serves HTTPS with its
certificate, the one it also presents to decode; --allowed-origins lets browsers on those origins call it
(CORS).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from pcpstack.common import security
from pcpstack.common.config import (
    DEFAULT_MODEL_NAME,
    ConfigError,
    check_address,
    check_addresses,
    check_model_source,
    check_port,
    check_positive,
    unbindable,
)
from pcpstack.common.startup import Serving, add_process_arguments, config_from_args, run_service

TINY = "tiny"


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
    parser.add_argument(
        "--registry",
        default="",
        help=(
            "registry HOST:PORT to find decode workers through (several, comma-separated: "
            "registry replicas, tried in turn)"
        ),
    )
    parser.add_argument(
        "--model-name",
        default=DEFAULT_MODEL_NAME,
        help=f"the model name clients send; must be the one decode serves (default {DEFAULT_MODEL_NAME})",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds one request may take (default 600)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="MODEL",
        help="the model whose tokenizer /tokenize and /detokenize use: a .gguf, a Hugging Face folder or "
        "'tiny' (default: the embedded model when --model-name is its name, 'tiny' when it is 'tiny', else "
        "none and those endpoints answer 501)",
    )
    key = parser.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default="",
        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version "
        "(default: none; prefer --api-key-file, a flag is visible to other local users)",
    )
    key.add_argument(
        "--api-key-file", default="", metavar="PATH", help="read the API key from this file (default: none)"
    )
    parser.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin allowed to call the API (CORS; repeatable or comma-separated; '*' for any; "
        "default: none)",
    )


def decode_addresses(values: list[str]) -> list[str]:
    """--decode values, each possibly a comma-separated list, flattened."""
    return [address.strip() for value in values for address in value.split(",") if address.strip()]


# The longest --request-timeout: a gRPC deadline further out overflows its arithmetic (11.6 days).
MAX_REQUEST_TIMEOUT_S = 1_000_000


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway process's configuration, validated when built; errors name the flag."""

    decode: tuple[str, ...] = ()
    registry: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = DEFAULT_MODEL_NAME
    request_timeout: float = 600.0
    tokenizer: str | None = None
    api_key: str = field(default="", repr=False)
    api_key_file: str = ""
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.decode and not self.registry:
            raise ConfigError(
                "--decode and --registry are both empty: give --decode HOST:PORT or --registry HOST:PORT",
                ("--decode", "--registry"),
                "an upstream is required",
            )
        for address in self.decode:
            check_address("--decode", address)
        check_addresses("--registry", self.registry)
        check_port("--port", self.port)
        if not self.model_name.strip():
            raise ConfigError.broken("--model-name", self.model_name, "must not be empty")
        check_positive("--request-timeout", self.request_timeout)
        if self.request_timeout > MAX_REQUEST_TIMEOUT_S:
            # gRPC's deadline arithmetic overflows past this: every call would fail at once
            raise ConfigError.broken(
                "--request-timeout",
                self.request_timeout,
                f"must be at most {MAX_REQUEST_TIMEOUT_S:,} seconds",
            )
        if not self.host.strip():
            raise ConfigError.broken(
                "--host", self.host, "must not be empty (0.0.0.0 listens on every address)"
            )
        if self.api_key != self.api_key.strip() or (self.api_key and not self.api_key.isprintable()):
            # HTTP drops a header value's surrounding spaces: such a key could never be presented
            raise ConfigError(
                "--api-key: has spaces around it or control characters; no client could present it",
                ("--api-key",),
                "printable, no surrounding spaces",
            )
        if self.tokenizer is not None and self.tokenizer != TINY:
            check_model_source("--tokenizer", self.tokenizer)
            folder = Path(self.tokenizer)
            if folder.is_dir() and not (folder / "tokenizer.json").is_file():
                rule = "names a model folder without tokenizer.json: /tokenize would have no tokenizer"
                raise ConfigError.broken("--tokenizer", self.tokenizer, rule)
        if self.api_key and self.api_key_file:
            raise ConfigError(
                "--api-key and --api-key-file are both given: give one",
                ("--api-key", "--api-key-file"),
                "at most one",
            )
        if self.api_key_file:
            read_api_key(self.api_key_file)

    def key(self) -> str:
        """The API key ("" for none)."""
        return read_api_key(self.api_key_file) if self.api_key_file else self.api_key

    def tokenizer_source(self) -> str | None:
        """--tokenizer, or the model --model-name names when the gateway can find it by itself ("" is the
        embedded default model); None when there is none."""
        if self.tokenizer is not None:
            return self.tokenizer
        return {TINY: TINY, DEFAULT_MODEL_NAME: ""}.get(self.model_name)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        """The config the flags describe."""
        return config_from_args(
            cls,
            args,
            decode=tuple(decode_addresses(args.decode)),
            allowed_origins=tuple(decode_addresses(args.allowed_origins)),
        )


def read_api_key(path: str) -> str:
    """The key in an --api-key-file (surrounding whitespace dropped); ConfigError when it is unreadable or
    empty."""
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError.broken("--api-key-file", path, f"cannot be read ({exc})") from None
    if not key:
        raise ConfigError.broken("--api-key-file", path, "holds no key")
    return key


async def start(config: GatewayConfig) -> Serving:
    """Starts the HTTP server; draining lets running requests finish and closes the decode pool."""
    from aiohttp import web

    from pcpstack.gateway.http_security import HttpSecurity, server_ssl_context
    from pcpstack.gateway.server import GatewaySettings, create_app
    from pcpstack.gateway.upstream import DecodePool

    pool = DecodePool(list(config.decode), config.registry)
    http = HttpSecurity(api_key=config.key(), cors_origins=config.allowed_origins)
    settings = GatewaySettings(config.model_name, config.request_timeout, config.tokenizer_source(), http)
    app = create_app(pool, settings)
    # handler_cancellation: a client that hangs up cancels its handler, and so its decode request.
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    # The service's own certificate (--tls-cert/--tls-key, checked with the rest of its TLS material at
    # start-up) serves HTTPS too; HTTP clients are not asked for a certificate: the API key is their proof.
    process = security.current()
    tls = (
        server_ssl_context(process.settings.cert_file, process.settings.key_file)
        if process.tls is not None
        else None
    )
    site = web.TCPSite(runner, config.host, config.port, ssl_context=tls)
    try:
        await site.start()
    except OSError as exc:  # the port in use, or a --host that is not an address of this machine
        await runner.cleanup()
        raise unbindable("--host/--port", f"{config.host}:{config.port}", exc) from None
    port = runner.addresses[0][1]
    scheme = "https" if tls else "http"
    print(f"gateway listening on {scheme}://{config.host}:{port}/v1 (model {config.model_name})", flush=True)
    return Serving(runner.cleanup)


def run(args: argparse.Namespace) -> int:
    """Entry point of `pcpstack serve gateway`."""
    return run_service("gateway", args, GatewayConfig.from_args, start)
