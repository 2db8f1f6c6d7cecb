"""The user-facing commands in real processes: `pcpstack up` until Ctrl-C (its gateway on the port asked
for, its progress in plain lines when stderr is a log), `pcpstack generate --target`, and a request that
still succeeds when the set it would have used dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pcpstack.cli.launch import cli_command
from pcpstack.common.channel import open_channel
from pcpstack.common.ports import free_port
from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.v1 import registry_pb2, registry_pb2_grpc
from tests.helpers import child_pids, start_stack


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_up_prints_endpoints_serves_and_stops_cleanly_on_ctrl_c(tmp_path, child_env) -> None:
    gateway_port = free_port()
    up = subprocess.Popen(
        cli_command(
            "up",
            "--pcp",
            "2",
            "--model",
            "tiny",
            "--log-dir",
            str(tmp_path),
            "--host",
            "127.0.0.1",
            "--gateway-port",
            str(gateway_port),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env,
    )
    try:
        lines = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any("Ctrl-C" in line for line in lines):
            lines.append(up.stdout.readline())
        endpoints = dict(line.split()[:2] for line in lines if line.strip() and "Ctrl-C" not in line)
        assert {"registry", "kvstore", "decode", "openai"} <= set(endpoints), lines
        assert endpoints["openai"] == f"http://127.0.0.1:{gateway_port}/v1"
        services = [int(p) for p in child_pids(up.pid)]
        assert len(services) >= 5  # registry, kvstore, prefill, decode, gateway
        run = subprocess.run(
            cli_command(
                "generate",
                "--target",
                endpoints["decode"],
                "--json",
                "--max-tokens",
                "5",
                "--ignore-eos",
                "hello",
            ),
            capture_output=True,
            text=True,
            env=child_env,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        answer = json.loads(run.stdout)
        assert len(answer["token_ids"]) == 5 and answer["finish_reason"] == "length"
        assert answer["prompt_token_ids"] == [104, 101, 108, 108, 111] and len(answer["trace_id"]) == 32
        # Without --max-tokens, its default (64) is cut to the room the tiny model's 4,096-token context
        # leaves: 6 tokens after 4,090, where a --max-tokens 64 would be refused.
        near_the_end = ",".join(["104"] * 4090)
        generate = ("generate", "--target", endpoints["decode"], "--json", "--ignore-eos", "--token-ids")
        run = subprocess.run(
            cli_command(*generate, near_the_end), capture_output=True, text=True, env=child_env, timeout=120
        )
        assert run.returncode == 0, run.stderr
        answer = json.loads(run.stdout)
        assert len(answer["token_ids"]) == 6 and answer["finish_reason"] == "length"
        run = subprocess.run(
            cli_command(*generate, near_the_end, "--max-tokens", "64"),
            capture_output=True,
            text=True,
            env=child_env,
            timeout=120,
        )
        assert run.returncode != 0 and "sampling.max_tokens=64 with 4090 prompt tokens exceeds" in run.stderr
        # A service that dies is reaped and reported on stderr; the others keep running.
        (gateway,) = [pid for pid in services if b"gateway" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(gateway, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{gateway}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)  # a zombie until `up` reaps it
        assert not Path(f"/proc/{gateway}").exists(), "up left the killed gateway unreaped"
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        progress = up.stderr.read().splitlines()
        assert any(
            line.startswith("pcpstack up: gateway exited (killed by SIGKILL); its log: ") for line in progress
        ), progress
        # stderr is a pipe here, not a terminal: plain lines, a step per service's model load.
        assert "decode-0: loading model tiny on cpu" in progress
        assert any(line.startswith("prefill-0: model tiny loaded in ") for line in progress)
        assert any(line.startswith("  ... ") and " ready: " in line for line in progress)
        assert not any("\r" in line or "\x1b" in line for line in progress)
        time.sleep(0.5)
        assert [pid for pid in services if _alive(pid)] == []
        # stopped front to back: each node deregistered from a registry still running
        logs = {path.stem: path.read_text(errors="replace") for path in tmp_path.glob("*.log")}
        assert [name for name, text in logs.items() if "deregister failed" in text] == []
        registry = logs["registry"]
        for node in ("decode-0", "prefill-0", "kvstore-0"):
            assert f'"deregistered", "node_id": "{node}"' in registry, node
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@pytest.mark.slow
def test_request_succeeds_when_the_set_it_would_use_has_just_died(tmp_path) -> None:
    stack = start_stack(tmp_path, pcp=2, prefill_sets=2, model="tiny")
    try:

        async def sets():
            async with open_channel(stack.stack.registry_address, default_deadline=5) as channel:
                stub = registry_pb2_grpc.RegistryServiceStub(channel)
                return (await stub.ListSets(registry_pb2.ListSetsRequest())).sets

        first = min(stack.run(sets()), key=lambda s: s.set_id)  # the router's pick among equally loaded sets
        node = next(s for s in stack.stack.services if s.name == first.member_node_ids[0])
        os.kill(child_pids(node.process.pid)[-1], signal.SIGKILL)

        async def ask():
            client = DecodeClient(stack.decode)
            try:
                return await client.generate(build_request("still there?", max_tokens=4, ignore_eos=True))
            finally:
                await client.close()

        assert stack.run(ask()).summary.completion_tokens == 4
    finally:
        stack.stop()
