"""Show the cluster as the registry sees it: nodes and PCP sets as tables, and where routers are sent."""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from pcpstack.common.channel import open_channel
from pcpstack.common.errors import ServiceError
from pcpstack.registry.client import Resolution, Resolver
from pcpstack.v1 import common_pb2, registry_pb2, registry_pb2_grpc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`pcpstack status` options."""
    parser.add_argument("--registry", default="127.0.0.1:7000", help="registry HOST:PORT")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the registry")


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
                ["NODE", "ROLE", "ADDRESS", "STATE", "SET@GEN", "RANK", "SEEN", "LOAD", "ERROR"], node_rows
            ),
            "",
            f"PCP SETS ({len(set_rows)})",
            _table(["SET", "GEN", "DP", "STATE", "PCP", "MASTER", "MEMBERS", "REASON"], set_rows),
            *(_routing(routing) if routing is not None else []),
        ]
    )


async def _fetch(address: str, timeout: float) -> str:
    async with open_channel(address, default_deadline=timeout) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        nodes = await stub.ListNodes(registry_pb2.ListNodesRequest())
        sets = await stub.ListSets(registry_pb2.ListSetsRequest())
    resolver = Resolver(address, rpc_deadline_s=timeout)
    try:
        routing = await resolver.resolve()
    finally:
        await resolver.close()
    return render(nodes, sets, routing)


def run(args: argparse.Namespace) -> int:
    """Prints the tables; exit status 1 when the registry cannot be reached."""
    try:
        print(asyncio.run(_fetch(args.registry, args.timeout)))
    except grpc.aio.AioRpcError as exc:
        print(f"registry {args.registry} unreachable: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except ServiceError as exc:
        print(f"registry {args.registry}: {exc}", file=sys.stderr)
        return 1
    return 0
