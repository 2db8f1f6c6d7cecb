"""Run a decode worker: `pcpstack serve decode --registry HOST:PORT [--config FILE] [--model PATH]`.

The worker loads the model, registers with the registry (role decode, PCP size 1), and serves Generate:
requests are prefilled on ready PCP sets found through the registry and decoded here with continuous batching.
The flags become a DecodeConfig, checked before torch and the model are loaded (they are imported when the
worker starts), so a bad flag is refused at once.

With tensor_parallel_size = T > 1 the worker is rank 0 of T tensor-parallel rank processes (engine.tp_engine):
it serves Generate and the T-1 followers it starts follow its steps, one device each. If its TP group fails,
requests fail UNAVAILABLE and the worker drains and exits 1. With decode_context_parallel_size = D > 1 each
group of D consecutive ranks splits every sequence's tokens by KV block (seed 001's rules, the GQA one
against the model's K/V heads, are checked before any rank starts); each rank loads only its own blocks.

On SIGTERM the worker drains: it deregisters (routers stop sending it work), refuses new requests with
UNAVAILABLE, lets running streams finish for up to --drain-seconds, then stops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from pcpstack.common.config import (
    MAX_UINT32,
    ConfigError,
    check_non_negative,
    check_positive,
    served_model_name,
)
from pcpstack.common.errors import ResourceExhausted
from pcpstack.common.server import start_server
from pcpstack.common.startup import (
    DrainGate,
    NodeConfig,
    Serving,
    add_node_arguments,
    add_process_arguments,
    run_service,
)
from pcpstack.common.telemetry import meter
from pcpstack.decode.client import BUSY, DEFAULT_MAX_REQUESTS

if TYPE_CHECKING:  # torch and the model load only when the worker starts
    from pcpstack.engine.engine import Engine
    from pcpstack.engine.tp_engine import TensorParallelEngine

log = logging.getLogger(__name__)
_busy_refusals = meter("pcpstack.decode").create_counter(
    "pcpstack.decode.requests_refused_busy", description="Generate requests refused: --max-requests were held"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pcpstack serve decode`."""
    add_process_arguments(parser)
    add_node_arguments(parser, "decode")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--max-batch", type=int, default=16, help="most sequences in one decode step")
    parser.add_argument(
        "--max-requests",
        type=int,
        default=DEFAULT_MAX_REQUESTS,
        help="most requests this worker holds at once, in prefill, waiting for cache room or decoding; more "
        f"are refused at once with RESOURCE_EXHAUSTED (the gateway tries another worker, then answers 429) "
        f"(default {DEFAULT_MAX_REQUESTS})",
    )
    parser.add_argument("--kv-cache-tokens", type=int, default=32768, help="tokens the paged KV cache holds")
    parser.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds a prefill may take")
    parser.add_argument(
        "--kv-lease-ms",
        type=int,
        default=0,
        help="lease of replicas in the store (default 0: the store's; at most the store's --max-lease-ms)",
    )
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=60.0,
        help="with tensor_parallel_size > 1: seconds before a collective of the TP ranks fails",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM, how long running streams may take to finish before they are cancelled",
    )


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(NodeConfig):
    """A decode worker's configuration, validated when built (before any model is loaded)."""

    role: ClassVar[str] = "decode"
    # tensor_parallel_size = T runs T rank processes: this one (it serves Generate) and T-1 followers.
    tensor_parallel: ClassVar[bool] = True
    # decode_context_parallel_size = D splits each sequence's tokens over D of those T ranks.
    decode_context_parallel: ClassVar[bool] = True

    # 0: torch's choice.
    threads: int = 0
    max_batch: int = 16
    max_requests: int = DEFAULT_MAX_REQUESTS
    kv_cache_tokens: int = 32768
    prefill_timeout: float = 300.0
    kv_lease_ms: int = 0
    collective_timeout: float = 60.0
    drain_seconds: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_non_negative("--threads", self.threads, "0: torch's choice")
        check_positive("--max-batch", self.max_batch)
        check_positive("--max-requests", self.max_requests)
        check_positive("--kv-cache-tokens", self.kv_cache_tokens)
        check_positive("--prefill-timeout", self.prefill_timeout)
        check_non_negative("--kv-lease-ms", self.kv_lease_ms, "0: the store's default")
        if self.kv_lease_ms > MAX_UINT32:
            raise ConfigError.broken(
                "--kv-lease-ms", self.kv_lease_ms, f"must be at most {MAX_UINT32} (32 bits)"
            )
        check_positive("--collective-timeout", self.collective_timeout)
        check_non_negative("--drain-seconds", self.drain_seconds)


def gate_generate(servicer, gate: DrainGate, max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
    """Makes the servicer's Generate pass `gate`: counted while it streams, refused once the gate closes,
    and refused ResourceExhausted (BUSY) while max_requests are running."""
    generate = servicer.Generate

    async def gated(request, context) -> AsyncIterator:
        if not gate.closed and gate.running >= max_requests:  # draining: admit refuses it UNAVAILABLE
            _busy_refusals.add(1)
            raise ResourceExhausted(
                f"{BUSY}: it holds {gate.running} requests, its --max-requests; send this one to another "
                "worker or again shortly"
            )
        with gate.admit():
            async with aclosing(generate(request, context)) as stream:
                async for message in stream:
                    yield message

    servicer.Generate = gated


def load_engine(config: DecodeConfig) -> Engine | TensorParallelEngine:
    """The worker's engine: the plain Engine, or with tensor_parallel_size = T > 1 a TP engine whose T-1
    follower processes this one leads. A model, device or TP size that cannot work is a ConfigError."""
    import torch

    from pcpstack.engine.device import default_dtype, device_for_rank, pick_device
    from pcpstack.engine.engine import Engine
    from pcpstack.engine.kv_cache import KvLayout, blocks_needed, check_cache_fits
    from pcpstack.engine.parallel import TP_SPLIT_RULE, TensorParallelShard
    from pcpstack.engine.tp_engine import TensorParallelEngine
    from pcpstack.engine.weights import describe_model

    engine_config = config.engine
    tp, dcp = engine_config.tensor_parallel_size, engine_config.decode_context_parallel_size
    kind = config.device or pick_device().type
    try:
        device_for_rank(tp - 1, kind)  # one device per rank: the last rank's must exist
    except ValueError as exc:
        raise ConfigError(
            f"tensor_parallel_size={tp} needs {tp} {kind} devices on this node, one per rank: {exc}",
            ("tensor_parallel_size", "--device"),
            "tensor_parallel_size <= devices present",
        ) from None
    num_blocks = blocks_needed(config.kv_cache_tokens, engine_config.block_size)
    try:  # from the model's header, before any rank process starts or any weight loads
        described = describe_model(engine_config.model or None)
    except (OSError, ValueError) as exc:
        raise ConfigError.broken("model", engine_config.model, f"cannot be loaded ({exc})") from None
    if tp > 1:
        try:
            TensorParallelShard(0, tp).check(described.args)
        except ValueError as exc:
            raise ConfigError(str(exc), ("tensor_parallel_size",), TP_SPLIT_RULE) from None
        # DCP's GQA rule needs the model's K/V heads: a ConfigError naming the keys and the rule.
        engine_config.with_model_shape(described.args.n_kv_heads)
    layout = KvLayout.for_model(
        described.model_id, described.args, default_dtype(torch.device(kind)), engine_config.block_size
    )
    # the TP ranks' shares of the K/V heads add up to one whole cache (about: a share may repeat a head)
    check_cache_fits("--kv-cache-tokens", num_blocks * engine_config.block_size, layout, 1, kind)
    try:
        if tp == 1:
            return Engine.load(
                engine_config.model or None,
                device=device_for_rank(0, kind),
                block_size=engine_config.block_size,
                num_blocks=num_blocks,
            )
        return TensorParallelEngine.start(
            engine_config.model or None,
            tp,
            device_kind=kind,
            block_size=engine_config.block_size,
            num_blocks=num_blocks,
            timeout_s=config.collective_timeout,
            threads=config.threads,
            dcp_size=dcp,
        )
    except (OSError, ValueError) as exc:
        if tp == 1:
            raise ConfigError.broken("model", engine_config.model, f"cannot be loaded ({exc})") from None
        # The model's shape may forbid the split: the message names its heads and the size.
        raise ConfigError(
            f"tensor_parallel_size={tp}: model {engine_config.model!r} cannot be split over {tp} ranks "
            f"({exc})",
            ("tensor_parallel_size", "model"),
            TP_SPLIT_RULE,
        ) from None


async def start(config: DecodeConfig) -> Serving:
    """Loads the model, serves Generate and registers; draining deregisters, then stops the batch."""
    import torch

    from pcpstack.decode.batcher import Batcher
    from pcpstack.decode.pipeline import DecodeSettings, GeneratePipeline
    from pcpstack.decode.router import SetRouter
    from pcpstack.decode.server import SERVICE_NAME, DecodeServicer
    from pcpstack.engine.tp_engine import TensorParallelEngine
    from pcpstack.kvstore import copy_crc
    from pcpstack.registry.client import NodeSession, Resolver
    from pcpstack.v1 import decode_pb2_grpc

    copy_crc.library()  # built before the first KV fetch; PCPSTACK_COPY_CRC=1 where it cannot be, refused
    if config.threads:
        torch.set_num_threads(config.threads)
    engine_config = config.engine
    engine = load_engine(config)
    engine_config = engine_config.with_model_shape(engine.args.n_kv_heads)

    batcher = Batcher(engine, max_batch=config.max_batch)
    fingerprint = engine.layout.fingerprint()
    resolver = Resolver(config.registry)
    router = SetRouter(resolver.resolve, fingerprint, host=config.machine)
    settings = DecodeSettings(
        model_name=served_model_name(engine_config.model),
        kv_fingerprint=fingerprint,
        prefill_timeout_s=config.prefill_timeout,
        kv_lease_ms=config.kv_lease_ms,
    )
    pipeline = GeneratePipeline(engine, batcher, router, settings)
    servicer = DecodeServicer(pipeline)
    gate = DrainGate()
    gate_generate(servicer, gate, config.max_requests)
    running = await start_server(
        lambda server: decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        config.server_options(),
    )
    address = f"{config.advertised_host}:{running.port}"
    node_id = config.node_id or f"{socket.gethostname()}-decode-{running.port}"
    registry = NodeSession(
        config.registry,
        node_id=node_id,
        role="decode",
        advertised_address=address,
        engine_config=engine_config,
        kv_fingerprint=fingerprint,
        device_count=engine_config.tensor_parallel_size,
        host_id=config.host_id,
        load=lambda: batcher.queue_depth,
    )
    await registry.start()
    print(f"decode worker {node_id} listening on {address}", flush=True)

    async def before_stop() -> None:
        await registry.close(deregister=True)  # first: routers stop picking this worker
        gate.close()
        if gate.running:
            log.info(
                "draining: waiting up to %.0f s for %d running stream(s)", config.drain_seconds, gate.running
            )
            if await gate.wait_idle(config.drain_seconds):
                log.info("drained: every running stream finished")
            else:
                log.warning("drain time over: cancelling %d running stream(s)", gate.running)
        await resolver.close()
        batcher.close()
        if isinstance(engine, TensorParallelEngine):
            engine.close()  # after the batch: its loop thread may be in a step until then
        await pipeline.close()

    serving = Serving.grpc(running, before_stop)
    if not isinstance(engine, TensorParallelEngine):
        return serving
    return stop_when_tp_fails(serving, engine)


def stop_when_tp_fails(serving: Serving, engine: TensorParallelEngine) -> Serving:
    """The serving of a TP worker, stopping by itself when its TP group fails: a worker whose rank died
    would fail every request, so it drains (deregisters: routers stop picking it) and exits with status 1,
    for its supervisor to restart it."""
    loop = asyncio.get_running_loop()
    failed: asyncio.Future[str] = loop.create_future()

    def on_failure(reason: str) -> None:
        if not failed.done():
            failed.set_result(reason)

    engine.on_failure = lambda reason: loop.call_soon_threadsafe(on_failure, reason)

    async def stopped() -> None:
        terminated = asyncio.ensure_future(serving.stopped)  # type: ignore[arg-type]  (grpc sets it)
        try:
            await asyncio.wait([terminated, failed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            terminated.cancel()

    async def drain() -> None:
        if failed.done():
            log.error("stopping: the tensor-parallel group failed (%s)", failed.result())
        await serving.drain()
        if failed.done():
            raise SystemExit(1)

    return Serving(drain, stopped())


def run(args: argparse.Namespace) -> int:
    """Entry point of `pcpstack serve decode`."""
    return run_service("decode", args, DecodeConfig.from_args, start, glibc_tunables=True)
