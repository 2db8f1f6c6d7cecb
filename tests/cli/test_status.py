"""`pcpstack status` against a real local stack (tiny model, gateway included): the registry's nodes with
their model, the KV store's usage and the gateway, as tables, as JSON, and refreshed with --watch."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator

import pytest

from pcpstack.cli.launch import cli_command
from tests.helpers import RunningStack, start_stack

KV_CAPACITY = 64 * 2**20


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[RunningStack]:
    running = start_stack(
        tmp_path_factory.mktemp("status"), pcp=1, model="tiny", gateway=True, kv_capacity_bytes=KV_CAPACITY
    )
    try:
        yield running
    finally:
        running.stop()


def _status(stack: RunningStack, *extra: str) -> list[str]:
    return cli_command(
        "status", "--registry", stack.stack.registry_address, "--gateway", stack.stack.gateway_url, *extra
    )


@pytest.mark.slow
def test_status_json_reports_nodes_models_kv_store_usage_and_the_gateway(stack, child_env) -> None:
    run = subprocess.run(_status(stack, "--json"), capture_output=True, text=True, env=child_env, timeout=60)
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout)
    roles = sorted(n["role"] for n in status["nodes"])
    assert roles == ["NODE_ROLE_DECODE", "NODE_ROLE_KVSTORE", "NODE_ROLE_PREFILL"]
    decode = next(n for n in status["nodes"] if n["role"] == "NODE_ROLE_DECODE")
    assert decode["model"] == "tiny"
    (store,) = status["kvstores"]
    assert store["address"] == stack.stack.kvstore_address and store["error"] == ""
    assert store["capacity_bytes"] == KV_CAPACITY and 0 <= store["used_fraction"] <= 1
    assert status["gateway"]["healthy"] is True and status["gateway"]["models"] == ["tiny"]
    assert status["routing"]["decode"] == stack.stack.decode_addresses


@pytest.mark.slow
def test_status_tables_show_the_kv_store_and_the_gateway(stack, child_env) -> None:
    run = subprocess.run(_status(stack), capture_output=True, text=True, env=child_env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "KV STORES (1)" in run.stdout and "64.0 MiB" in run.stdout
    decode_row = next(line for line in run.stdout.splitlines() if line.startswith("decode-0 "))
    assert decode_row.split()[6] == "tiny"  # the MODEL column
    assert f"GATEWAY {stack.stack.gateway_url}/v1: up, models: tiny" in run.stdout


@pytest.mark.slow
def test_status_watch_refreshes_until_ctrl_c_then_exits_0(stack, child_env) -> None:
    watch = subprocess.Popen(
        _status(stack, "--json", "--watch", "0.2"), stdout=subprocess.PIPE, text=True, env=child_env
    )
    try:
        reports = [json.loads(watch.stdout.readline()) for _ in range(3)]
        assert [r["registry"] for r in reports] == [stack.stack.registry_address] * 3
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=30) == 0
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()


def test_status_exits_1_naming_an_unreachable_registry(child_env) -> None:
    run = subprocess.run(
        cli_command("status", "--registry", "127.0.0.1:1", "--timeout", "1", "--gateway", ""),
        capture_output=True,
        text=True,
        env=child_env,
        timeout=60,
    )
    assert run.returncode == 1 and "registry 127.0.0.1:1 unreachable" in run.stderr
