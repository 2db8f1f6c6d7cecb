"""Run a decode worker: `pcpstack serve decode --registry HOST:PORT [--config FILE] [--model PATH]`.

The worker loads the model, registers with the registry (role decode, PCP size 1), and serves Generate:
requests are prefilled on ready PCP sets found through the registry and decoded here with continuous batching.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket

import torch

from pcpstack.common import security
from pcpstack.common.config import (
    ConfigError,
    EngineConfig,
    parse_overrides,
    role_config,
    served_model_name,
)
from pcpstack.common.logs import setup_logging
from pcpstack.common.server import ServerOptions, serve_until_signalled, start_server
from pcpstack.common.telemetry import setup_telemetry, shutdown_telemetry
from pcpstack.common.tunables import ensure_glibc_tunables
from pcpstack.decode.batcher import Batcher
from pcpstack.decode.router import SetRouter
from pcpstack.decode.server import SERVICE_NAME, DecodeServicer, DecodeSettings
from pcpstack.engine.engine import Engine
from pcpstack.engine.kv_cache import blocks_needed
from pcpstack.v1 import decode_pb2_grpc

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pcpstack serve decode`."""
    security.add_security_arguments(parser)
    parser.add_argument("--registry", required=True, help="registry address HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (default: any free port)")
    parser.add_argument("--advertise", default="", help="host clients reach this worker at (default: --host)")
    parser.add_argument("--node-id", default="", help="stable node identity (default: hostname-port)")
    parser.add_argument("--config", help="seed-style JSON with motor_engine_decode_config")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="engine_config override"
    )
    parser.add_argument(
        "--model", default=None, help="model: a .gguf file, a HF folder, 'tiny'; default SmolLM2"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--max-batch", type=int, default=16, help="most sequences in one decode step")
    parser.add_argument("--kv-cache-tokens", type=int, default=32768, help="tokens the paged KV cache holds")
    parser.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds a prefill may take")
    parser.add_argument("--kv-lease-ms", type=int, default=0, help="lease of replicas in the store")
    parser.add_argument("--max-message-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--metrics", default="", metavar="HOST:PORT", help="serve Prometheus metrics here")


def resolve_config(args: argparse.Namespace) -> EngineConfig:
    """The worker's engine config: its config file section (or defaults) with --set and --model applied."""
    return role_config("decode", args.config, parse_overrides(args.set), args.model)


async def serve(args: argparse.Namespace, config: EngineConfig, engine: Engine) -> None:
    """Runs the worker until SIGTERM/SIGINT."""
    from pcpstack.registry.client import NodeSession, Resolver

    batcher = Batcher(engine, max_batch=args.max_batch)
    kv_clients: dict = {}
    fingerprint = engine.layout.fingerprint()
    resolver = Resolver(args.registry)
    router = SetRouter(resolver.resolve, fingerprint)
    settings = DecodeSettings(
        model_name=served_model_name(config.model),
        kv_fingerprint=fingerprint,
        prefill_timeout_s=args.prefill_timeout,
        kv_lease_ms=args.kv_lease_ms,
    )
    servicer = DecodeServicer(engine, batcher, router, kv_clients, settings)
    running = await start_server(
        lambda server: decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        ServerOptions(host=args.host, port=args.port, max_message_bytes=args.max_message_bytes),
    )
    address = f"{args.advertise or args.host}:{running.port}"
    node_id = args.node_id or f"{socket.gethostname()}-decode-{running.port}"
    registry = NodeSession(
        args.registry,
        node_id=node_id,
        role="decode",
        advertised_address=address,
        engine_config=config,
        kv_fingerprint=fingerprint,
        device_count=1,
        load=lambda: batcher.queue_depth,
    )
    await registry.start()
    print(f"decode worker {node_id} listening on {address}", flush=True)

    async def on_stop() -> None:
        await registry.close()
        await resolver.close()
        batcher.close()
        for client in kv_clients.values():
            await client.close()

    await serve_until_signalled(running, on_stop)


def run(args: argparse.Namespace) -> int:
    """Entry point of `pcpstack serve decode`."""
    ensure_glibc_tunables()
    setup_logging("decode")
    security.configure(security.security_from_args(args))
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = resolve_config(args)
        engine = Engine.load(
            config.model or None,
            block_size=config.block_size,
            num_blocks=blocks_needed(args.kv_cache_tokens, config.block_size),
        )
        config = config.with_model_shape(engine.args.n_kv_heads)
    except ConfigError as exc:
        print(f"config error: {exc}", flush=True)
        return 2
    setup_telemetry("decode", metrics_address=args.metrics)
    try:
        asyncio.run(serve(args, config, engine))
    finally:
        shutdown_telemetry()
    return 0
