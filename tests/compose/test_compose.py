"""compose/docker-compose.yml stays valid and runnable without a docker engine.

The file is validated against the compose specification (check-jsonschema's vendored schema), holds the
services issue 7 asks for, and its declared commands parse and really serve: started as local processes
with every service on a loopback address of its own (see loopback.py), the two prefill nodes form one
cross-host PCP set and a Generate request through decode completes.

Deliberate departures from the file, all for a test on a shared CPU machine: prefill and decode get
`--model tiny` appended (the last --model wins; the compose stack serves the embedded SmolLM2) and the
gateway `--model-name tiny` to match, prefill nodes get a free master port (`--set master-port=N`; the
TCPStore binds every interface) and OTEL_* variables are blanked (no collector runs here).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pcpstack.cli import main as cli
from pcpstack.common.channel import open_channel
from pcpstack.common.config import load_config_file
from pcpstack.common.ports import free_port
from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.v1 import registry_pb2, registry_pb2_grpc
from tests.compose.loopback import (
    COMPOSE_DIR,
    COMPOSE_FILE,
    ROOT,
    ComposeStack,
    LocalCommand,
    bind_mounts,
    command,
    environment,
    load_compose,
    local_command,
    loopback_hosts,
    option,
)

PCPSTACK_SERVICES = ("registry", "kvstore", "prefill-0", "prefill-1", "decode", "gateway")
IMAGE_SERVICES = ("otel-collector", "jaeger", "prometheus", "grafana")
# What each service's metrics show once a request went through (a headless prefill node may show none).
SCRAPED_METRIC = {
    "registry": "pcpstack:pcp_sets",
    "kvstore": "pcpstack:kvstore_pinned_bytes",
    "decode": "pcpstack:request_success_total",
    "gateway": "pcpstack:gateway_requests_total",
}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def test_compose_file_is_valid_under_the_compose_specification() -> None:
    # Beside the interpreter (the venv's bin), which need not be on PATH.
    beside = Path(sys.executable).parent / "check-jsonschema"
    checker = str(beside) if beside.exists() else shutil.which("check-jsonschema")
    checker = checker or pytest.fail("check-jsonschema is not installed")
    result = subprocess.run(
        [checker, "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_file_declares_the_stack_of_issue_7(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {*PCPSTACK_SERVICES, *IMAGE_SERVICES}
    assert compose["services"]["jaeger"]["image"].startswith("jaegertracing/")
    collector = compose["services"]["otel-collector"]
    assert "jaeger:4317" in bind_mounts(collector)["/etc/otelcol/config.yaml"].read_text()


def prometheus_targets() -> dict[str, str]:
    """The `service` label -> HOST:PORT of each target compose/prometheus.yml scrapes."""
    config = load_compose(COMPOSE_DIR / "prometheus.yml")
    return {
        group["labels"]["service"]: target
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }


def test_prometheus_scrapes_every_pcpstack_service_where_it_serves_metrics(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    assert bind_mounts(prometheus)["/etc/prometheus/prometheus.yml"] == COMPOSE_DIR / "prometheus.yml"
    targets = prometheus_targets()
    assert set(targets) == set(PCPSTACK_SERVICES)
    for name, target in targets.items():
        argv = command(compose["services"][name])
        # The gateway serves /metrics on its HTTP port; the gRPC services on --metrics.
        served = f"0.0.0.0:{option(argv, '--port')}" if name == "gateway" else option(argv, "--metrics")
        assert target == f"{name}:{served.rsplit(':', 1)[1]}" and served.startswith("0.0.0.0:")
    # Prometheus scrapes them, so no service also pushes its metrics to the collector.
    assert environment(compose["services"]["decode"]).get("OTEL_METRICS_EXPORTER") == "none"


def test_grafana_provisions_prometheus_and_a_dashboard_that_queries_it(compose: dict[str, Any]) -> None:
    mounts = bind_mounts(compose["services"]["grafana"])
    provisioning = mounts["/etc/grafana/provisioning"]
    (source,) = load_compose(provisioning / "datasources" / "prometheus.yml")["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = load_compose(provisioning / "dashboards" / "pcpstack.yml")["providers"]
    dashboard = json.loads((mounts[provider["options"]["path"]] / "pcpstack.json").read_text())
    targets = [target for panel in dashboard["panels"] for target in panel["targets"]]
    assert targets and {target["datasource"]["uid"] for target in targets} == {source["uid"]}


@pytest.mark.parametrize("name", PCPSTACK_SERVICES)
def test_pcpstack_services_run_the_image_built_from_the_repo_dockerfile(
    compose: dict[str, Any], name: str
) -> None:
    service = compose["services"][name]
    build = service["build"]
    assert (COMPOSE_DIR / build["context"]).resolve() == ROOT
    assert build["dockerfile"] == "Dockerfile"
    assert 'ENTRYPOINT ["pcpstack"]' in (ROOT / "Dockerfile").read_text()
    assert environment(service)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    assert option(command(service), "--host") == "0.0.0.0"


def test_prefill_nodes_form_one_pcp_set_of_two_nodes(compose: dict[str, Any]) -> None:
    for name in ("prefill-0", "prefill-1"):
        argv = command(compose["services"][name])
        config = load_config_file(bind_mounts(compose["services"][name])[option(argv, "--config")])["prefill"]
        assert (config.pcp_size, config.nnodes, config.data_parallel_size) == (2, 2, 1)
        assert option(argv, "--advertise") == name
        assert option(argv, "--node-id") == name


@pytest.mark.parametrize("name", PCPSTACK_SERVICES)
def test_declared_command_parses_as_a_pcpstack_command(compose: dict[str, Any], name: str) -> None:
    assert "entrypoint" not in compose["services"][name]  # the image's ENTRYPOINT is pcpstack
    argv = command(compose["services"][name])
    args = cli.build_parser(argv).parse_args(argv)
    assert hasattr(args, "handler"), f"`pcpstack {' '.join(argv[:2])}` is not available"


def test_loopback_mapping_rewrites_hosts_and_mounts_but_not_identities(compose: dict[str, Any]) -> None:
    hosts = loopback_hosts(list(PCPSTACK_SERVICES))
    local = local_command("prefill-1", compose["services"]["prefill-1"], hosts)
    assert local.args[:2] == ["serve", "prefill"]
    assert option(local.args, "--host") == option(local.args, "--advertise") == hosts["prefill-1"]
    assert option(local.args, "--registry") == f"{hosts['registry']}:7000"
    assert option(local.args, "--kvstore") == f"{hosts['kvstore']}:50053"
    assert option(local.args, "--node-id") == "prefill-1"
    assert Path(option(local.args, "--config")) == COMPOSE_DIR / "prefill.json"
    assert len(set(hosts.values())) == len(hosts) and all(h.startswith("127.") for h in hosts.values())
    registry = local_command("registry", compose["services"]["registry"], hosts)
    assert registry.args[:2] == ["serve", "registry"] and registry.address == f"{hosts['registry']}:7000"


def loopback_commands(compose: dict[str, Any]) -> list[LocalCommand]:
    """The pcpstack services' commands mapped to loopback, with this test's departures applied."""
    names = list(PCPSTACK_SERVICES)
    hosts = loopback_hosts(names)
    master_port = free_port()
    extra = {
        "prefill": ["--model", "tiny", "--set", f"master-port={master_port}"],
        "decode": ["--model", "tiny"],
        "gateway": ["--model-name", "tiny"],
    }
    commands = []
    for name in names:
        local = local_command(name, compose["services"][name], hosts)
        args = [*local.args, *extra.get(local.args[1], [])]
        env = {k: "" if k.startswith("OTEL_") else v for k, v in local.env.items()}
        commands.append(LocalCommand(local.name, local.host, args, env))
    return commands


def complete_through_gateway(address: str, retry_for_s: float = 20.0) -> dict[str, Any]:
    """POST /v1/completions to the gateway; retried while it answers 503 (no decode worker known yet)."""
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": MAX_TOKENS, "ignore_eos": True})
    deadline = time.monotonic() + retry_for_s
    while True:
        request = urllib.request.Request(
            f"http://{address}/v1/completions", body.encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise
        except urllib.error.URLError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


async def _list_sets(registry: str) -> registry_pb2.ListSetsResponse:
    channel = open_channel(registry, default_deadline=5.0)
    try:
        return await registry_pb2_grpc.RegistryServiceStub(channel).ListSets(registry_pb2.ListSetsRequest())
    finally:
        await channel.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_declared_commands_serve_a_request_through_a_cross_host_pcp_set(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    commands = loopback_commands(compose)
    by_name = {c.name: c for c in commands}
    stack = ComposeStack(commands, tmp_path, ready_timeout_s=150)

    async def scenario() -> None:
        async with stack:
            client = DecodeClient(stack.decode_addresses[0])
            try:
                answer = await client.generate(
                    build_request("Hello", max_tokens=MAX_TOKENS, ignore_eos=True), timeout=60
                )
            finally:
                await client.close()
            assert len(answer.token_ids) == MAX_TOKENS
            assert answer.summary is not None and answer.summary.completion_tokens == MAX_TOKENS
            (pcp_set,) = (await _list_sets(stack.registry_address)).sets
            assert sorted(pcp_set.member_node_ids) == ["prefill-0", "prefill-1"]
            assert pcp_set.pcp_size == 2
            assert pcp_set.master_address.rsplit(":", 1)[0] in {
                by_name["prefill-0"].host,
                by_name["prefill-1"].host,
            }
            completion = await asyncio.to_thread(complete_through_gateway, by_name["gateway"].address)
            assert completion["usage"]["completion_tokens"] == MAX_TOKENS
            # What Prometheus would scrape, at each target of prometheus.yml mapped to loopback.
            for name, target in prometheus_targets().items():
                url = f"http://{by_name[name].host}:{target.rsplit(':', 1)[1]}/metrics"
                text = await asyncio.to_thread(scrape_metrics, url)
                assert SCRAPED_METRIC.get(name, "") in text, f"{name}: {text[:500]}"

    asyncio.run(scenario())
    assert leftover_groups(stack, grace_s=5.0) == []


def scrape_metrics(url: str) -> str:
    """The Prometheus text at url (fails on any HTTP error)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def leftover_groups(stack: ComposeStack, grace_s: float) -> list[str]:
    """Services whose process group (rank processes and multiprocessing helpers included) still has a
    member after `grace_s` seconds; helpers exit a moment after their parent."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = []
        for service in stack.services:
            try:
                os.killpg(service.process.pid, 0)
                alive.append(service.name)
            except ProcessLookupError:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)
