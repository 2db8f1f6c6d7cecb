"""Show the cluster: nodes (with their model) and PCP sets as the registry sees them, where routers are sent,
how full each KV store is, and whether the OpenAI gateway answers; as tables, or as JSON with --json, once or
every N seconds with --watch N.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import grpc
from google.protobuf.json_format import MessageToDict

from pcpstack.cli.commands import USAGE_EXIT_STATUS, UsageError, check_seconds
from pcpstack.cli.stack import https_context
from pcpstack.common import security
from pcpstack.common.channel import open_channel
from pcpstack.common.config import ConfigError, check_addresses
from pcpstack.common.errors import ServiceError
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.registry.client import Resolution, Resolver
from pcpstack.registry.main import DEFAULT_PORT as REGISTRY_PORT
from pcpstack.v1 import common_pb2, registry_pb2, registry_pb2_grpc

DEFAULT_GATEWAY = "http://127.0.0.1:8000"
# Moves the cursor home and clears a terminal, so each --watch refresh replaces the last.
_CLEAR_SCREEN = "\x1b[H\x1b[2J"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pcpstack status` options."""
    parser.add_argument(
        "--registry",
        default=f"127.0.0.1:{REGISTRY_PORT}",
        help="registry HOST:PORT, or its replicas' separated by commas (the first that answers is asked)",
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each service")
    parser.add_argument(
        "--gateway",
        default=DEFAULT_GATEWAY,
        help="the OpenAI gateway's base URL, as `pcpstack up` prints it without /v1; '' skips it",
    )
    parser.add_argument("--api-key", default="", help="the gateway's API key, when it asks for one")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument(
        "--watch",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="refresh every SECONDS until Ctrl-C; 0: print once",
    )


@dataclass
class KvStoreUsage:
    """One KV store's Stat answer, or why there is none."""

    address: str
    objects: int = 0
    bytes: int = 0
    pinned_bytes: int = 0
    capacity_bytes: int = 0
    evictions: int = 0
    error: str = ""
    # Prefix reuse: content-addressed blocks held, the bytes of the objects holding them, and block hits
    # over block keys asked for by lookups.
    prefix_blocks: int = 0
    prefix_bytes: int = 0
    prefix_blocks_hit: int = 0
    prefix_blocks_queried: int = 0

    @property
    def used_fraction(self) -> float:
        """Bytes held over the memory budget (0 when the budget is unknown)."""
        return self.bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Leading blocks found over block keys asked for (0 before any lookup)."""
        return self.prefix_blocks_hit / self.prefix_blocks_queried if self.prefix_blocks_queried else 0.0


@dataclass
class GatewayStatus:
    """What the gateway answered: /health, and the models of /v1/models."""

    url: str
    healthy: bool = False
    models: list[str] = field(default_factory=list)
    error: str = ""


@dataclass
class ClusterStatus:
    """Everything `pcpstack status` shows, fetched at one moment."""

    registry: str
    nodes: registry_pb2.ListNodesResponse
    sets: registry_pb2.ListSetsResponse
    routing: Resolution
    kvstores: list[KvStoreUsage]
    gateway: GatewayStatus | None

    def to_json(self) -> dict:
        """The status as JSON-ready data (proto messages in their canonical JSON mapping)."""
        return {
            "registry": self.registry,
            "nodes": MessageToDict(self.nodes).get("nodes", []),
            "sets": MessageToDict(self.sets).get("sets", []),
            "routing": {
                "warming": self.routing.warming,
                "prefill": [
                    {"set_id": e.set_id, "generation": e.generation, "address": e.address}
                    for e in self.routing.prefill_sets
                ],
                "decode": [e.address for e in self.routing.decode],
                "kvstore": [e.address for e in self.routing.kvstore],
            },
            "kvstores": [
                {
                    **asdict(k),
                    "used_fraction": round(k.used_fraction, 6),
                    "prefix_hit_rate": round(k.prefix_hit_rate, 6),
                }
                for k in self.kvstores
            ],
            "gateway": asdict(self.gateway) if self.gateway is not None else None,
        }


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def _name(enum_type, value: int, prefix: str) -> str:
    return enum_type.Name(value).removeprefix(prefix).lower()


def _routing(found: Resolution) -> list[str]:
    warming = " (the registry is warming up: nodes may still be coming back)" if found.warming else ""
    title = f"ROUTING{warming}"
    rows = [
        ["prefill", ", ".join(f"{e.set_id}@{e.generation} {e.address}" for e in found.prefill_sets) or "-"],
        ["decode", ", ".join(e.address for e in found.decode) or "-"],
        ["kvstore", ", ".join(e.address for e in found.kvstore) or "-"],
    ]
    return ["", title, _table(["ROLE", "ENDPOINTS"], rows)]


def _model(node: registry_pb2.NodeStatus) -> str:
    if node.role == common_pb2.NODE_ROLE_KVSTORE:
        return "-"
    # The registry leaves the model empty for the embedded default.
    return node.model or "(default)"


def render(
    nodes: registry_pb2.ListNodesResponse,
    sets: registry_pb2.ListSetsResponse,
    routing: Resolution | None = None,
) -> str:
    """The tables `pcpstack status` prints: nodes, sets and (given the Resolve answer) routing."""
    node_rows = []
    for n in nodes.nodes:
        a = n.assignment
        node_rows.append(
            [
                n.node_id,
                _name(common_pb2.NodeRole, n.role, "NODE_ROLE_"),
                n.address,
                _name(registry_pb2.NodeState, n.state, "NODE_STATE_"),
                f"{a.set_id}@{a.generation}" if a.set_id else "-",
                str(a.node_rank) if a.set_id else "-",
                _model(n),
                f"{n.last_seen_ms_ago / 1000:.1f}s",
                str(n.load),
                n.last_error or "",
            ]
        )
    set_rows = [
        [
            s.set_id,
            str(s.generation),
            str(s.dp_rank),
            _name(registry_pb2.SetState, s.state, "SET_STATE_"),
            str(s.pcp_size),
            s.master_address or "-",
            ",".join(s.member_node_ids),
            s.reason,
        ]
        for s in sets.sets
    ]
    return "\n".join(
        [
            f"NODES ({len(node_rows)})",
            _table(
                ["NODE", "ROLE", "ADDRESS", "STATE", "SET@GEN", "RANK", "MODEL", "SEEN", "LOAD", "ERROR"],
                node_rows,
            ),
            "",
            # registry replicas on etcd: which one leads (assembles sets)
            f"PCP SETS ({len(set_rows)}){f'  leader: {sets.leader_address}' if sets.leader_address else ''}",
            _table(["SET", "GEN", "DP", "STATE", "PCP", "MASTER", "MEMBERS", "REASON"], set_rows),
            *(_routing(routing) if routing is not None else []),
        ]
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def render_usage(kvstores: list[KvStoreUsage], gateway: GatewayStatus | None) -> str:
    """The KV STORES table and the GATEWAY line."""
    rows = [
        [k.address, "-", "-", "-", "-", "-", "-", "-", "-", k.error]
        if k.error
        else [
            k.address,
            str(k.objects),
            _mib(k.bytes),
            _mib(k.capacity_bytes),
            f"{100 * k.used_fraction:.1f}%",
            _mib(k.pinned_bytes),
            str(k.prefix_blocks),
            _mib(k.prefix_bytes),
            f"{100 * k.prefix_hit_rate:.1f}%",
            "",
        ]
        for k in kvstores
    ]
    lines = [
        "",
        f"KV STORES ({len(rows)})",
        _table(
            [
                "ADDRESS",
                "OBJECTS",
                "USED",
                "CAPACITY",
                "USE",
                "PINNED",
                "PREFIX BLOCKS",
                "PREFIX BYTES",
                "PREFIX HITS",
                "ERROR",
            ],
            rows,
        ),
    ]
    if gateway is not None:
        state = "up" if gateway.healthy else f"down ({gateway.error})" if gateway.error else "down"
        models = f", models: {', '.join(gateway.models)}" if gateway.models else ""
        lines += ["", f"GATEWAY {gateway.url}/v1: {state}{models}"]
    return "\n".join(lines)


async def _kvstore_usage(address: str, timeout: float) -> KvStoreUsage:
    client = KvStoreClient(address, prefer_shm=False, deadline_s=timeout)
    try:
        stat = await client.stat()
    except (grpc.aio.AioRpcError, ServiceError) as exc:
        return KvStoreUsage(
            address, error=str(exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc)
        )
    finally:
        await client.close()
    return KvStoreUsage(
        address,
        stat.objects,
        stat.bytes,
        stat.pinned_bytes,
        stat.capacity_bytes,
        stat.evictions,
        prefix_blocks=stat.prefix_blocks,
        prefix_bytes=stat.prefix_bytes,
        prefix_blocks_hit=stat.prefix_blocks_hit,
        prefix_blocks_queried=stat.prefix_blocks_queried,
    )


def gateway_status(url: str, timeout: float, api_key: str = "") -> GatewayStatus:
    """Asks the gateway's /health and /v1/models (an https URL verified with PCPSTACK_TLS_CA, if set)."""
    found = GatewayStatus(url.rstrip("/"))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        tls = https_context(security.from_env()) if url.startswith("https:") else None
        with urllib.request.urlopen(f"{found.url}/health", timeout=timeout, context=tls) as answer:
            found.healthy = answer.status == 200
        request = urllib.request.Request(f"{found.url}/v1/models", headers=headers)
        with urllib.request.urlopen(request, timeout=timeout, context=tls) as answer:
            found.models = [m["id"] for m in json.loads(answer.read()).get("data", [])]
    except urllib.error.HTTPError as exc:
        found.error = f"HTTP {exc.code} from {exc.url}"
    except (OSError, ValueError) as exc:  # SecurityConfigError is a ValueError
        found.error = str(getattr(exc, "reason", exc))
    return found


async def _lists_from(
    address: str, timeout: float
) -> tuple[registry_pb2.ListNodesResponse, registry_pb2.ListSetsResponse]:
    async with open_channel(address, default_deadline=timeout) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        nodes = await stub.ListNodes(registry_pb2.ListNodesRequest())
        return nodes, await stub.ListSets(registry_pb2.ListSetsRequest())


async def _lists(
    registry: str, timeout: float
) -> tuple[registry_pb2.ListNodesResponse, registry_pb2.ListSetsResponse]:
    """ListNodes and ListSets from the first registry replica (of "HOST:PORT[,HOST:PORT...]") that answers;
    the last one's error when none does."""
    addresses = [a.strip() for a in registry.split(",") if a.strip()]
    for address in addresses[:-1]:
        with contextlib.suppress(grpc.aio.AioRpcError):
            return await _lists_from(address, timeout)
    return await _lists_from(addresses[-1], timeout)


async def fetch(args: argparse.Namespace) -> ClusterStatus:
    """The cluster's status now; raises grpc.aio.AioRpcError or ServiceError when the registry fails."""
    nodes, sets = await _lists(args.registry, args.timeout)
    resolver = Resolver(args.registry, rpc_deadline_s=args.timeout)
    try:
        routing = await resolver.resolve()
    finally:
        await resolver.close()
    kvstores = list(await asyncio.gather(*(_kvstore_usage(e.address, args.timeout) for e in routing.kvstore)))
    gateway = None
    if args.gateway:
        gateway = await asyncio.to_thread(gateway_status, args.gateway, args.timeout, args.api_key)
    return ClusterStatus(args.registry, nodes, sets, routing, kvstores, gateway)


def _show(args: argparse.Namespace) -> int:
    """Prints the status once; 1 when the registry cannot be reached."""
    try:
        status = asyncio.run(fetch(args))
    except grpc.aio.AioRpcError as exc:
        print(f"registry {args.registry} unreachable: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except ServiceError as exc:
        print(f"registry {args.registry}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status.to_json()), flush=True)
    else:
        tables = render(status.nodes, status.sets, status.routing)
        print(f"{tables}\n{render_usage(status.kvstores, status.gateway)}", flush=True)
    return 0


# The shortest refresh of --watch.
MIN_WATCH_S = 0.1


def check_arguments(args: argparse.Namespace) -> None:
    """Raises UsageError naming the first flag of `status` that breaks a rule, before any service is asked."""
    try:
        check_addresses("--registry", args.registry, required=True)
    except ConfigError as error:
        raise UsageError("--registry", args.registry, error.rule) from None
    _check_gateway(args.gateway, args.api_key)
    check_seconds("--timeout", args.timeout)
    check_seconds("--watch", args.watch, zero="0: print once")
    if 0 < args.watch < MIN_WATCH_S:  # each refresh asks every service: not in a tight loop
        raise UsageError("--watch", args.watch, f"must be 0 (print once) or at least {MIN_WATCH_S} seconds")


def _check_gateway(url: str, api_key: str) -> None:
    """Raises UsageError unless --gateway is '' (skip it) or a base URL the gateway can be asked at; one
    that cannot be asked would otherwise be reported as a gateway that is down."""
    if not url:
        if api_key:  # named by --gateway: the key itself stays out of the message
            raise UsageError("--gateway", url, "skips the gateway, so --api-key would be sent nowhere")
        return
    problem = _gateway_url_problem(url)
    if problem:
        raise UsageError("--gateway", url, problem)


def _gateway_url_problem(url: str) -> str:
    """What is wrong with a gateway base URL ("" for nothing)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an IPv6 host's bracket left open
        return f"must be a URL such as {DEFAULT_GATEWAY}"
    if parts.scheme not in ("http", "https"):
        return "must be an http:// or https:// URL ('' skips the gateway)"
    host = parts.hostname or ""
    if not host or any(char.isspace() for char in host) or not host.isprintable():
        return "must name a host without spaces (an IPv6 host in brackets: http://[::1]:8000)"
    try:
        port = parts.port
    except ValueError:  # not a number, or past 65535
        port = 0
    if port == 0:
        return "must have a port in 1..65535, or none (80 for http, 443 for https)"
    if parts.query or parts.fragment or parts.path.rstrip("/").endswith("/v1"):
        return "must be the base URL, as `pcpstack up` prints it: without /v1, a query or a fragment"
    return ""


def run(args: argparse.Namespace) -> int:
    """Prints the status once, or with --watch every N seconds until Ctrl-C (then exit status 0)."""
    try:
        check_arguments(args)
    except UsageError as error:
        print(f"pcpstack status: {error}", file=sys.stderr, flush=True)
        return USAGE_EXIT_STATUS
    if not args.watch:
        return _show(args)
    # A terminal gets the screen redrawn; a pipe gets one report (JSON: one line) per refresh.
    clear = sys.stdout.isatty() and not args.json
    # Ctrl-C only sets a flag: the refresh in progress (its calls have deadlines) finishes, then the loop
    # ends; a KeyboardInterrupt raised inside the gRPC event loop could leave the process hanging.
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        while not stop.is_set():
            if clear:
                print(_CLEAR_SCREEN, end="")
            if not args.json:
                print(
                    f"pcpstack status, every {args.watch:g} s (Ctrl-C stops) at {time.strftime('%H:%M:%S')}"
                )
            _show(args)
            stop.wait(args.watch)
    finally:
        signal.signal(signal.SIGINT, previous)
    return 0
