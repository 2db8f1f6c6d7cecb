"""Run a prefill node: `pcpstack serve prefill --registry HOST:PORT [--config FILE] [--set KEY=VALUE]`.

The node registers with the registry, receives its PCP set assignment, starts its local rank processes
(tensor_parallel_size of them per PCP rank, one device each) and, on the set's master, serves Prefill. It
keeps doing so across set failures: when told to stop it returns to the pool and waits for the next
assignment. The flags become a PrefillConfig, checked before torch and the model are loaded (they are
imported when the node starts), so a bad flag is refused at once; the device count and the TP split of the
model's heads are checked at start-up, before registering.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from pcpstack.common.config import (
    MAX_UINT32,
    ConfigError,
    EngineConfig,
    check_address,
    check_non_negative,
    check_positive,
)
from pcpstack.common.errors import ServiceError
from pcpstack.common.server import start_server
from pcpstack.common.startup import (
    NodeConfig,
    Serving,
    add_node_arguments,
    add_process_arguments,
    run_service,
)

if TYPE_CHECKING:
    from pcpstack.prefill.node import ModelInfo, RunningSet

log = logging.getLogger(__name__)
# How long start-up waits for --kvstore's answer on --kv-lease-ms (a store not up yet is asked later).
LEASE_CHECK_TIMEOUT_S = 5.0
# engine.engine.DEFAULT_CACHE_TOKENS (this module must not import torch): twice SmolLM2's 8,192-token
# context, 720 MiB a rank at SmolLM2-135M's 46,080 bytes a token in fp32 (23,040 in bf16).
DEFAULT_KV_CACHE_TOKENS = 16384
# Sixteen 32-token prompts fill one batched forward's token budget (prefill.batch.BATCH_TOKENS, 512), which is
# where batching gained most when measured (3x over one forward each on SmolLM2-135M).
DEFAULT_PREFILL_BATCH_MAX = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pcpstack serve prefill`."""
    add_process_arguments(parser)
    add_node_arguments(parser, "prefill")
    parser.add_argument(
        "--local-ranks", type=int, default=0, help="PCP ranks on this node (default pcp/nnodes)"
    )
    parser.add_argument("--threads-per-rank", type=int, default=1, help="torch threads of each rank process")
    parser.add_argument(
        "--kvstore", default="", help="KV store HOST:PORT (default: resolved via the registry)"
    )
    parser.add_argument(
        "--kv-lease-ms",
        type=int,
        default=0,
        help="lease of pushed replicas (default: store's; at most the store's --max-lease-ms)",
    )
    parser.add_argument(
        "--collective-timeout", type=float, default=120.0, help="seconds before a collective fails"
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=DEFAULT_KV_CACHE_TOKENS,
        help="K/V tokens each rank's cache holds: the longest prompt the set takes (each PCP rank keeps it "
        "whole); a longer one is refused with RESOURCE_EXHAUSTED. SmolLM2-135M takes 46,080 bytes a token "
        "in fp32, the CPU's dtype (the default 16,384 tokens: 720 MiB a rank), 23,040 in bf16",
    )
    parser.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=0,
        help="longest piece of a prompt one forward runs: a longer prompt is prefilled in chunks, each "
        "attending to those before it (bounds the activations of long prompts; exact); 0: one forward",
    )
    parser.add_argument(
        "--prefill-batch-max",
        type=int,
        default=DEFAULT_PREFILL_BATCH_MAX,
        help="most waiting prompts the set prefills in one forward (batched prefill, exact), as long as they "
        "hold at most 512 tokens together (and one chunk) and fit the ranks' KV cache; 1: one a forward",
    )
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="neither reuse prompt prefixes the KV store holds nor offer new blocks for reuse",
    )


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(NodeConfig):
    """A prefill node's configuration, validated when built (before any model is loaded)."""

    role: ClassVar[str] = "prefill"
    tensor_parallel: ClassVar[bool] = True

    # 0: pcp / nnodes.
    local_ranks: int = 0
    threads_per_rank: int = 1
    kvstore: str = ""
    kv_lease_ms: int = 0
    collective_timeout: float = 120.0
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS
    # 0: the whole prompt in one forward.
    prefill_chunk_tokens: int = 0
    prefill_batch_max: int = DEFAULT_PREFILL_BATCH_MAX
    no_prefix_cache: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_address("--kvstore", self.kvstore)
        check_non_negative("--local-ranks", self.local_ranks, "0: pcp / nnodes")
        if self.local_ranks and self.local_ranks != self.engine.pcp_ranks_per_node:
            engine = self.engine
            raise ConfigError(
                f"--local-ranks={self.local_ranks} but prefill_context_parallel_size={engine.pcp_size} / "
                f"nnodes={engine.nnodes} = {engine.pcp_ranks_per_node} ranks per node",
                ("local_ranks", "prefill_context_parallel_size", "nnodes"),
                "local ranks == pcp / nnodes",
            )
        check_positive("--threads-per-rank", self.threads_per_rank)
        check_non_negative("--kv-lease-ms", self.kv_lease_ms, "0: the store's default")
        if self.kv_lease_ms > MAX_UINT32:
            raise ConfigError.broken(
                "--kv-lease-ms", self.kv_lease_ms, f"must be at most {MAX_UINT32} (32 bits)"
            )
        check_positive("--collective-timeout", self.collective_timeout)
        check_positive("--kv-cache-tokens", self.kv_cache_tokens)
        check_non_negative("--prefill-chunk-tokens", self.prefill_chunk_tokens, "0: one forward")
        check_positive("--prefill-batch-max", self.prefill_batch_max)


class PrefillNode:
    """Glue between the registry session, the rank supervisor and the gRPC server."""

    def __init__(
        self, config: PrefillConfig, engine: EngineConfig, info: ModelInfo, device_count: int
    ) -> None:
        """device_count: the rank slots this node offers the registry (see `device_slots`)."""
        from pcpstack.prefill.node import NodeOptions, RankSupervisor

        self.config = config
        self.engine = engine
        self.info = info
        self.device_count = device_count
        self.options = NodeOptions(
            model=engine.model or None,
            block_size=engine.block_size,
            advertised_host=config.advertised_host,
            local_ranks=engine.tensor_parallel_size * (config.local_ranks or engine.pcp_ranks_per_node),
            device=config.device,
            threads_per_rank=config.threads_per_rank,
            collective_timeout_s=config.collective_timeout,
            kv_cache_tokens=config.kv_cache_tokens,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            prefill_batch_max=config.prefill_batch_max,
        )
        self.supervisor = RankSupervisor(self.options, info, self._on_set_failure)
        self.registry = None
        self.resolver = None
        self.running = None

    async def kv_stores(self, fresh: bool = False) -> list[str]:
        """The stores ranks may push to: --kvstore, then those the registry lists (cached when it is down;
        fresh: asked now rather than the answer cached for the resolver's ttl)."""
        resolved = await self.resolver.resolve(fresh=fresh)
        listed = [store.address for store in resolved.kvstore]
        return [self.config.kvstore, *listed] if self.config.kvstore else listed

    def _on_set_failure(self, running: RunningSet, reason: str) -> None:
        asyncio.get_running_loop().create_task(self._handle_failure(running, reason))

    async def _handle_failure(self, running: RunningSet, reason: str) -> None:
        assignment = running.assignment
        await self._set_health(False)
        await self.registry.report_status(assignment.set_id, assignment.generation, ready=False, error=reason)
        # Only that set: the registry may have re-formed it, and a newer one started, meanwhile.
        await self.supervisor.stop(reason, only=running)

    async def _set_health(self, serving: bool) -> None:
        from pcpstack.prefill.server import SERVICE_NAME

        if self.running is not None:
            await self.running.set_serving(SERVICE_NAME, serving)

    async def _follow_commands(self) -> None:
        from pcpstack.prefill.node import SetUnavailable
        from pcpstack.v1 import registry_pb2

        async for command in self.registry.commands():
            if isinstance(command, registry_pb2.AssignCommand):
                assignment = command.assignment
                current = self.supervisor.current
                if (
                    current is not None
                    and not current.failed
                    and current.assignment.set_id == assignment.set_id
                    and current.assignment.generation == assignment.generation
                ):
                    continue  # already running it (a re-sent assignment after a reconnect)
                log.info(
                    "assigned to set %s generation %d as node_rank %d (PCP ranks %s)",
                    assignment.set_id,
                    assignment.generation,
                    assignment.node_rank,
                    list(assignment.pcp_ranks),
                )
                try:
                    await self.supervisor.start(assignment)
                except SetUnavailable as exc:
                    await self.registry.report_status(
                        assignment.set_id, assignment.generation, ready=False, error=str(exc)
                    )
                    continue
                await self._set_health(True)
                await self.registry.report_status(assignment.set_id, assignment.generation, ready=True)
            elif isinstance(command, registry_pb2.StopCommand):
                current = self.supervisor.current
                if current is not None and current.assignment.set_id == command.set_id:
                    await self._set_health(False)
                    await self.supervisor.stop(command.reason)
            else:
                log.warning("assembly timed out: %s", command.reason)

    async def _watch_progress(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.supervisor.check_progress(stale_after_s=max(10.0, 5 * self.options.idle_tick_s))

    async def start(self) -> Serving:
        """Serves Prefill, registers, and follows the registry's commands; draining stops the ranks."""
        from pcpstack.prefill.server import SERVICE_NAME, PrefillServicer
        from pcpstack.registry.client import NodeSession, Resolver
        from pcpstack.v1 import prefill_pb2_grpc

        config = self.config
        if config.kvstore and config.kv_lease_ms:
            await check_kv_lease(config.kvstore, config.kv_lease_ms)
        self.resolver = Resolver(config.registry)
        servicer = PrefillServicer(
            self.supervisor,
            self.info,
            self.kv_stores,
            config.kv_lease_ms,
            self.engine.tensor_parallel_size,
            kv_cache_tokens=config.kv_cache_tokens,
            prefix_cache=not config.no_prefix_cache,
        )
        self.running = await start_server(
            lambda server: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server),
            [SERVICE_NAME],
            config.server_options(),
        )
        await self._set_health(False)
        address = f"{config.advertised_host}:{self.running.port}"
        node_id = config.node_id or f"{socket.gethostname()}-prefill-{self.running.port}"
        self.registry = NodeSession(
            config.registry,
            node_id=node_id,
            role="prefill",
            advertised_address=address,
            dist_host=config.advertised_host,
            engine_config=self.engine,
            kv_fingerprint=self.info.fingerprint,
            device_count=self.device_count,
            host_id=config.host_id,
            load=lambda: self.supervisor.load,
        )
        await self.registry.start()
        log.info("prefill node %s serving on %s", node_id, address)
        print(f"prefill node {node_id} listening on {address}", flush=True)
        tasks = [asyncio.create_task(self._follow_commands()), asyncio.create_task(self._watch_progress())]

        async def before_stop() -> None:
            for task in tasks:
                task.cancel()
            # First: the registry dissolves the set at once ("member ... deregistered") and routers stop
            # picking it, instead of sending it work until this node's lease runs out.
            await self.registry.close(deregister=True)
            await self.supervisor.stop("node shutting down")
            await self.resolver.close()
            await servicer.close()

        return Serving.grpc(self.running, before_stop)


async def check_kv_lease(store: str, lease_ms: int) -> None:
    """Refuses at start-up a --kv-lease-ms that --kvstore would refuse at every push (longer than its
    --max-lease-ms). A store that cannot answer yet is left to the servicer, which asks each store it
    meets."""
    from pcpstack.kvstore.client import KvStoreClient
    from pcpstack.prefill.server import lease_refusal

    try:
        async with KvStoreClient(store, deadline_s=LEASE_CHECK_TIMEOUT_S) as client:
            refusal = await lease_refusal(client, lease_ms)
    except ServiceError as exc:
        log.info("--kv-lease-ms not checked with %s at start-up (%s); the first request will", store, exc)
        return
    if refusal is not None:
        raise ConfigError(
            f"--kv-lease-ms={lease_ms} is refused by --kvstore {store}: {refusal}",
            ("--kv-lease-ms",),
            "lease <= the store's --max-lease-ms",
        )


def device_slots(config: PrefillConfig) -> int:
    """The rank slots this node offers: the accelerators it sees on cuda/npu (refusing, naming the numbers
    and the visible-devices variable, a config whose rank processes need more), or on the CPU the rank
    processes it runs."""
    from pcpstack.engine.device import accelerator_count, device_for_rank, pick_device

    engine = config.engine
    tp, pcp_ranks = engine.tensor_parallel_size, config.local_ranks or engine.pcp_ranks_per_node
    kind = config.device or pick_device().type
    if kind == "cpu":
        return tp * pcp_ranks
    try:
        device_for_rank(tp * pcp_ranks - 1, kind)  # the last local rank's device must exist
    except ValueError as exc:
        raise ConfigError(
            f"tensor_parallel_size={tp} x (prefill_context_parallel_size / nnodes)={pcp_ranks} needs "
            f"{tp * pcp_ranks} {kind} devices on this node, one per rank process: {exc}",
            ("tensor_parallel_size", "prefill_context_parallel_size", "nnodes", "--device"),
            "tp x pcp / nnodes <= devices present",
        ) from None
    return accelerator_count(kind)


async def start(config: PrefillConfig) -> Serving:
    """Checks the devices, reads the model's shape (the GQA and TP rules need it), then starts the node."""
    from pcpstack.engine.device import pick_device
    from pcpstack.engine.kv_cache import check_cache_fits
    from pcpstack.engine.parallel import TP_SPLIT_RULE, TensorParallelShard
    from pcpstack.kvstore import copy_crc
    from pcpstack.prefill.node import ModelInfo

    copy_crc.library()  # built once here for the ranks; PCPSTACK_COPY_CRC=1 where it cannot be, refused
    engine = config.engine
    device_count = device_slots(config)
    try:
        info = ModelInfo.probe(engine.model or None, engine.block_size, config.device)
    except (OSError, ValueError) as exc:
        raise ConfigError.broken("model", engine.model, f"cannot be loaded ({exc})") from None
    try:
        TensorParallelShard(0, engine.tensor_parallel_size).check(info.args)
    except ValueError as exc:
        rule = TP_SPLIT_RULE
        raise ConfigError(str(exc), ("tensor_parallel_size",), rule) from None
    # each of this node's PCP ranks keeps a whole replica (its TP ranks' shares add up to one)
    kind = config.device or pick_device().type
    check_cache_fits(
        "--kv-cache-tokens", config.kv_cache_tokens, info.layout, engine.pcp_ranks_per_node, kind
    )
    return await PrefillNode(config, engine.with_model_shape(info.num_kv_heads), info, device_count).start()


def run(args: argparse.Namespace) -> int:
    """Entry point of `pcpstack serve prefill`."""
    return run_service("prefill", args, PrefillConfig.from_args, start, glibc_tunables=True)
