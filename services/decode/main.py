"""Run a decode worker: `pcpstack serve decode --registry HOST:PORT [--config FILE] [--model PATH]`.

The worker loads the model, registers with the registry (role decode, PCP size 1), and serves Generate:
requests are prefilled on ready PCP sets found through the registry and decoded here with continuous batching.
The flags become a DecodeConfig, checked before torch and the model are loaded (they are imported when the
worker starts), so a bad flag is refused at once.
"""

from __future__ import annotations

import argparse
import logging
import socket
from dataclasses import dataclass

from pcpstack.common.config import (
    ConfigError,
    EngineConfig,
    check_address,
    check_model_source,
    check_non_negative,
    check_port,
    check_positive,
    parse_overrides,
    role_config,
    served_model_name,
)
from pcpstack.common.server import DEFAULT_MAX_MESSAGE_BYTES, ServerOptions, start_server
from pcpstack.common.startup import Serving, add_process_arguments, run_service

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pcpstack serve decode`."""
    add_process_arguments(parser)
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
    parser.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES)


def resolve_config(args: argparse.Namespace) -> EngineConfig:
    """The worker's engine config: its config file section (or defaults) with --set and --model applied."""
    return role_config("decode", args.config, parse_overrides(args.set), args.model)


@dataclass(frozen=True)
class DecodeConfig:
    """A decode worker's configuration, validated when built (before any model is loaded)."""

    registry: str
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    advertise: str = ""
    node_id: str = ""
    # 0: torch's choice.
    threads: int = 0
    max_batch: int = 16
    kv_cache_tokens: int = 32768
    prefill_timeout: float = 300.0
    kv_lease_ms: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        check_address("--registry", self.registry, required=True)
        check_port("--port", self.port)
        check_model_source("model", self.engine.model)
        check_non_negative("--threads", self.threads, "0: torch's choice")
        check_positive("--max-batch", self.max_batch)
        check_positive("--kv-cache-tokens", self.kv_cache_tokens)
        check_positive("--prefill-timeout", self.prefill_timeout)
        check_non_negative("--kv-lease-ms", self.kv_lease_ms, "0: the store's default")
        check_positive("--max-message-bytes", self.max_message_bytes)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DecodeConfig:
        """The config the flags (and the config file they name) describe."""
        return cls(
            registry=args.registry,
            engine=resolve_config(args),
            host=args.host,
            port=args.port,
            advertise=args.advertise,
            node_id=args.node_id,
            threads=args.threads,
            max_batch=args.max_batch,
            kv_cache_tokens=args.kv_cache_tokens,
            prefill_timeout=args.prefill_timeout,
            kv_lease_ms=args.kv_lease_ms,
            max_message_bytes=args.max_message_bytes,
        )


async def start(config: DecodeConfig) -> Serving:
    """Loads the model, serves Generate and registers; draining deregisters, then stops the batch."""
    import torch

    from pcpstack.decode.batcher import Batcher
    from pcpstack.decode.pipeline import DecodeSettings, GeneratePipeline
    from pcpstack.decode.router import SetRouter
    from pcpstack.decode.server import SERVICE_NAME, DecodeServicer
    from pcpstack.engine.engine import Engine
    from pcpstack.engine.kv_cache import blocks_needed
    from pcpstack.registry.client import NodeSession, Resolver
    from pcpstack.v1 import decode_pb2_grpc

    if config.threads:
        torch.set_num_threads(config.threads)
    engine_config = config.engine
    try:
        engine = Engine.load(
            engine_config.model or None,
            block_size=engine_config.block_size,
            num_blocks=blocks_needed(config.kv_cache_tokens, engine_config.block_size),
        )
    except (OSError, ValueError) as exc:
        raise ConfigError.broken("model", engine_config.model, f"cannot be loaded ({exc})") from None
    engine_config = engine_config.with_model_shape(engine.args.n_kv_heads)

    batcher = Batcher(engine, max_batch=config.max_batch)
    fingerprint = engine.layout.fingerprint()
    resolver = Resolver(config.registry)
    router = SetRouter(resolver.resolve, fingerprint)
    settings = DecodeSettings(
        model_name=served_model_name(engine_config.model),
        kv_fingerprint=fingerprint,
        prefill_timeout_s=config.prefill_timeout,
        kv_lease_ms=config.kv_lease_ms,
    )
    pipeline = GeneratePipeline(engine, batcher, router, settings)
    servicer = DecodeServicer(pipeline)
    running = await start_server(
        lambda server: decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        ServerOptions(host=config.host, port=config.port, max_message_bytes=config.max_message_bytes),
    )
    address = f"{config.advertise or config.host}:{running.port}"
    node_id = config.node_id or f"{socket.gethostname()}-decode-{running.port}"
    registry = NodeSession(
        config.registry,
        node_id=node_id,
        role="decode",
        advertised_address=address,
        engine_config=engine_config,
        kv_fingerprint=fingerprint,
        device_count=1,
        load=lambda: batcher.queue_depth,
    )
    await registry.start()
    print(f"decode worker {node_id} listening on {address}", flush=True)

    async def before_stop() -> None:
        await registry.close()
        await resolver.close()
        batcher.close()
        await pipeline.close()

    return Serving.grpc(running, before_stop)


def run(args: argparse.Namespace) -> int:
    """Entry point of `pcpstack serve decode`."""
    return run_service("decode", args, DecodeConfig.from_args, start, glibc_tunables=True)
