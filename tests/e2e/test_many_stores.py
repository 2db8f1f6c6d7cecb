"""Many KV stores: each request's replica goes to the store on its decode worker's host (#17).

Two hosts (network namespaces on a bridge, the prefill cross-host test's fixture) each run a KV store and a
decode worker; the registry and one PCP=1 prefill set (tiny model) run on the bridge. A host is the host of
a node's advertised address, so each namespace is one. A request through either worker leaves its bytes in
that worker's own store only. Then one store is killed: a request whose worker still routes to it fails with
UNAVAILABLE, the other host's worker is unaffected, and once the dead store's lease has run out a retry goes
through the store that lives. Needs root and `ip`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess

import grpc
import pytest

from pcpstack.common.ports import free_port
from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.registry.client import Resolver
from tests.prefill.test_cross_host import spawn, two_hosts, wait_for_set
from tests.reliability.support import store_stat, wait_until

__all__ = ["two_hosts"]  # the fixture, shared with the cross-host prefill test

pytestmark = [
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"),
]

LEASE_S = 3.0
PROMPT = [1, 5, 9, 12, 40, 41, 42, 43]


def test_each_replica_goes_to_the_store_on_its_decode_workers_host(two_hosts, tmp_path) -> None:
    bridge_ip, hosts = two_hosts
    registry = f"{bridge_ip}:{free_port(bridge_ip)}"
    config = tmp_path / "prefill.json"
    engine = {"prefill-context-parallel-size": 1, "block_size": 128, "master-port": free_port(bridge_ip)}
    engine["model"] = "tiny"
    config.write_text(json.dumps({"motor_engine_prefill_config": {"engine_config": engine}}))
    registry_args = ["--host", bridge_ip, "--port", registry.split(":")[1], "--lease", str(LEASE_S)]
    procs = {
        "registry": spawn(["registry", *registry_args, "--restore-grace", "0"], tmp_path / "registry.log"),
        "prefill": spawn(
            ["prefill", "--registry", registry, "--host", bridge_ip, "--config", str(config)],
            tmp_path / "prefill.log",
        ),
    }
    stores, workers = [], []
    for i, (ns, address) in enumerate(hosts):
        stores.append(f"{address}:7400")
        workers.append(f"{address}:7401")
        node = ["--registry", registry, "--host", address, "--node-id"]
        procs[f"store-{i}"] = spawn(
            ["kvstore", *node, f"store-{i}", "--port", "7400"], tmp_path / f"store-{i}.log", netns=ns
        )
        procs[f"decode-{i}"] = spawn(
            ["decode", *node, f"decode-{i}", "--port", "7401", "--model", "tiny", "--threads", "1"],
            tmp_path / f"decode-{i}.log",
            netns=ns,
        )
    loop = asyncio.new_event_loop()
    resolver = Resolver(registry, ttl_s=0)

    def listed() -> tuple[set[str], set[str]]:
        with contextlib.suppress(Exception):
            found = loop.run_until_complete(resolver.resolve(fresh=True))
            return {e.address for e in found.kvstore}, {e.address for e in found.decode}
        return set(), set()

    async def generate(worker: str) -> list[int]:
        client = DecodeClient(worker)
        try:
            return (await client.generate(build_request(PROMPT, max_tokens=4), timeout=60)).token_ids
        finally:
            await client.close()

    def bytes_in(*indexes: int) -> list[int]:
        return [loop.run_until_complete(store_stat(stores[i])).bytes_in for i in indexes or (0, 1)]

    try:
        loop.run_until_complete(wait_for_set(registry, 120))
        wait_until("the stores and workers", lambda: listed() == (set(stores), set(workers)), 120)
        for i, worker in enumerate(workers):
            before = bytes_in()
            assert len(loop.run_until_complete(generate(worker))) == 4
            after = bytes_in()
            assert after[i] > before[i], f"request through {worker}: nothing reached its host's store {after}"
            assert after[1 - i] == before[1 - i], f"request through {worker} wrote to the other host's store"

        os.killpg(procs["store-1"].pid, signal.SIGKILL)
        procs["store-1"].wait()
        # Within the dead store's lease decode-1 still routes to it: the request fails cleanly.
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            loop.run_until_complete(generate(workers[1]))
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        assert len(loop.run_until_complete(generate(workers[0]))) == 4
        wait_until("the dead store to leave routing", lambda: listed()[0] == {stores[0]}, 4 * LEASE_S)
        before = bytes_in(0)[0]

        def retried() -> bool:
            with contextlib.suppress(grpc.aio.AioRpcError):
                return len(loop.run_until_complete(generate(workers[1]))) == 4
            return False

        # A retry may meet decode-1's cached answer once more; it goes through store-0 within a refresh.
        wait_until("a retry through decode-1 to succeed", retried, 30, interval=0.5)
        assert bytes_in(0)[0] > before
    finally:
        loop.run_until_complete(resolver.close())
        loop.close()
        for proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
