"""Run a prefill node: `pcpstack serve prefill --registry HOST:PORT [--config FILE] [--set KEY=VALUE]`.

The node registers with the registry, receives its PCP set assignment, starts its local rank processes and,
on the set's master, serves Prefill. It keeps doing so across set failures: when told to stop it returns to
the pool and waits for the next assignment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket

from pcpstack.common import security
from pcpstack.common.config import ConfigError, EngineConfig, parse_overrides, role_config
from pcpstack.common.logs import setup_logging
from pcpstack.common.server import ServerOptions, serve_until_signalled, start_server
from pcpstack.common.telemetry import setup_telemetry, shutdown_telemetry
from pcpstack.common.tunables import ensure_glibc_tunables
from pcpstack.prefill.node import ModelInfo, NodeOptions, RankSupervisor, RunningSet, SetUnavailable
from pcpstack.prefill.server import SERVICE_NAME, PrefillServicer
from pcpstack.v1 import prefill_pb2_grpc, registry_pb2

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pcpstack serve prefill`."""
    security.add_security_arguments(parser)
    parser.add_argument("--registry", required=True, help="registry address HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (default: any free port)")
    parser.add_argument(
        "--advertise", default="", help="host other nodes reach this one at (default: --host)"
    )
    parser.add_argument("--node-id", default="", help="stable node identity (default: hostname-port)")
    parser.add_argument("--config", help="seed-style JSON with motor_engine_prefill_config")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="engine_config override"
    )
    parser.add_argument(
        "--model", default=None, help="model: a .gguf file, a HF folder, 'tiny'; default SmolLM2"
    )
    parser.add_argument(
        "--local-ranks", type=int, default=0, help="PCP ranks on this node (default pcp/nnodes)"
    )
    parser.add_argument("--threads-per-rank", type=int, default=1, help="torch threads of each rank process")
    parser.add_argument(
        "--kvstore", default="", help="KV store HOST:PORT (default: resolved via the registry)"
    )
    parser.add_argument(
        "--kv-lease-ms", type=int, default=0, help="lease of pushed replicas (default: store's)"
    )
    parser.add_argument(
        "--collective-timeout", type=float, default=120.0, help="seconds before a collective fails"
    )
    parser.add_argument("--max-message-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--metrics", default="", metavar="HOST:PORT", help="serve Prometheus metrics here")


def resolve_config(args: argparse.Namespace) -> EngineConfig:
    """The node's engine config: its config file section (or defaults) with --set and --model applied."""
    return role_config("prefill", args.config, parse_overrides(args.set), args.model)


class PrefillNode:
    """Glue between the registry session, the rank supervisor and the gRPC server."""

    def __init__(self, args: argparse.Namespace, config: EngineConfig, info: ModelInfo) -> None:
        from pcpstack.registry.client import NodeSession, Resolver

        self.args = args
        self.config = config
        self.info = info
        local_ranks = args.local_ranks or config.pcp_ranks_per_node
        if local_ranks != config.pcp_ranks_per_node:
            raise ConfigError(
                f"--local-ranks={local_ranks} but prefill_context_parallel_size={config.pcp_size} / "
                f"nnodes={config.nnodes} = {config.pcp_ranks_per_node} ranks per node",
                ("local_ranks", "prefill_context_parallel_size", "nnodes"),
                "local ranks == pcp / nnodes",
            )
        self.options = NodeOptions(
            model=config.model or None,
            block_size=config.block_size,
            advertised_host=args.advertise or args.host,
            local_ranks=local_ranks,
            threads_per_rank=args.threads_per_rank,
            collective_timeout_s=args.collective_timeout,
        )
        self.supervisor = RankSupervisor(self.options, info, self._on_set_failure)
        self.registry_cls = NodeSession
        self.resolver = Resolver(args.registry)
        self.registry = None
        self.running = None

    async def kv_stores(self) -> list[str]:
        """The stores ranks may push to: --kvstore, then those the registry lists (cached when it is down)."""
        resolved = await self.resolver.resolve()
        listed = [store.address for store in resolved.kvstore]
        return [self.args.kvstore, *listed] if self.args.kvstore else listed

    def _on_set_failure(self, running: RunningSet, reason: str) -> None:
        asyncio.get_running_loop().create_task(self._handle_failure(running, reason))

    async def _handle_failure(self, running: RunningSet, reason: str) -> None:
        assignment = running.assignment
        await self._set_health(False)
        await self.registry.report_status(assignment.set_id, assignment.generation, ready=False, error=reason)
        await self.supervisor.stop(reason)

    async def _set_health(self, serving: bool) -> None:
        if self.running is not None:
            await self.running.set_serving(SERVICE_NAME, serving)

    async def _follow_commands(self) -> None:
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

    async def serve(self) -> None:
        """Runs until SIGTERM/SIGINT."""
        servicer = PrefillServicer(self.supervisor, self.info, self.kv_stores, self.args.kv_lease_ms)
        self.running = await start_server(
            lambda server: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server),
            [SERVICE_NAME],
            ServerOptions(
                host=self.args.host, port=self.args.port, max_message_bytes=self.args.max_message_bytes
            ),
        )
        await self._set_health(False)
        address = f"{self.options.advertised_host}:{self.running.port}"
        node_id = self.args.node_id or f"{socket.gethostname()}-prefill-{self.running.port}"
        self.registry = self.registry_cls(
            self.args.registry,
            node_id=node_id,
            role="prefill",
            advertised_address=address,
            dist_host=self.options.advertised_host,
            engine_config=self.config,
            kv_fingerprint=self.info.fingerprint,
            device_count=self.options.local_ranks,
            load=lambda: self.supervisor.load,
        )
        await self.registry.start()
        log.info("prefill node %s serving on %s", node_id, address)
        print(f"prefill node {node_id} listening on {address}", flush=True)
        tasks = [asyncio.create_task(self._follow_commands()), asyncio.create_task(self._watch_progress())]

        async def on_stop() -> None:
            for task in tasks:
                task.cancel()
            await self.supervisor.stop("node shutting down")
            await self.registry.close()
            await self.resolver.close()

        await serve_until_signalled(self.running, on_stop)


def run(args: argparse.Namespace) -> int:
    """Entry point of `pcpstack serve prefill`."""
    ensure_glibc_tunables()
    setup_logging("prefill")
    security.configure(security.security_from_args(args))
    try:
        config = resolve_config(args)
        info = ModelInfo.probe(config.model or None, config.block_size)
        config = config.with_model_shape(info.num_kv_heads)
    except ConfigError as exc:
        print(f"config error: {exc}", flush=True)
        return 2
    setup_telemetry("prefill", metrics_address=args.metrics)
    try:
        asyncio.run(PrefillNode(args, config, info).serve())
    finally:
        shutdown_telemetry()
    return 0
