"""Observability of a whole local stack, started as a user would: `pcpstack up --metrics --log-dir DIR`.

One stack for the module (tiny model, one PCP set of 2 ranks, one decode worker, the gateway). It gets a
few completions through the gateway; then every service's metrics, printed by `up`, are scraped and each
metric of issue 19 is found with the value those requests imply, the Grafana dashboard's queries are
checked against what the services export, and the gateway's log is read for its access lines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pcpstack.cli.launch import child_env, cli_command
from tests.conftest import ROOT

REQUESTS = 3
MAX_TOKENS = 5
DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "pcpstack.json"
SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@dataclass
class Stack:
    """What `pcpstack up` printed, the answers of the requests sent, and every service's scrape after."""

    openai: str
    metrics_urls: dict[str, str]
    log_dir: Path
    usages: list[dict]
    request_ids: list[str]
    scrapes: dict[str, str]


def _read_until_ready(up: subprocess.Popen, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = up.stdout.readline()  # type: ignore[union-attr]
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if "Ctrl-C" in line:
            return lines
    raise AssertionError(f"`pcpstack up` did not become ready: {lines}\n{up.stderr.read()}")  # type: ignore[union-attr]


def _complete(openai: str, request_id: str) -> dict:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    request = urllib.request.Request(
        f"{openai}/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.status == 200
        return answer.read().decode()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("logs")
    flags = ["--model", "tiny", "--pcp", "2", "--metrics", "--log-dir", str(log_dir), "--gateway-port", "0"]
    up = subprocess.Popen(
        cli_command("up", *flags),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(inherit_telemetry=False),
        start_new_session=True,
    )
    try:
        lines = _read_until_ready(up, timeout_s=300)
        words = [line.split() for line in lines if line.strip()]
        openai = next(w[1] for w in words if w[0] == "openai")
        printed_logs = Path(next(w[1] for w in words if w[0] == "logs"))
        # "metrics   URL   (service)"
        metrics_urls = {w[2].strip("()"): w[1] for w in words if w[0] == "metrics"}
        usages, request_ids = [], []
        for index in range(REQUESTS):
            request_ids.append(f"obs-{index}-{os.getpid()}")
            usages.append(_complete(openai, request_ids[-1])["usage"])
        # The registry counts sets at its clock's tick (at most a quarter second); the rest is settled once
        # the answers are back, releases included (decode releases the replica before its last token).
        time.sleep(1.0)
        scrapes = {name: _scrape(url) for name, url in metrics_urls.items()}
        yield Stack(openai, metrics_urls, printed_logs, usages, request_ids, scrapes)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value of a Prometheus text exposition."""
    found = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
        found[(match["name"], labels)] = float(match["value"])
    return found


def value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels` (fails when there is none)."""
    wanted = set(labels.items())
    hits = [v for (n, ls), v in samples(text).items() if n == name and wanted <= ls]
    assert hits, f"no sample {name}{labels or ''} in:\n{text[:3000]}"
    return sum(hits)


def test_up_prints_a_metrics_url_for_every_service_and_the_log_dir(stack: Stack) -> None:
    assert set(stack.metrics_urls) == {"registry", "kvstore", "prefill-0", "decode-0", "gateway"}
    assert stack.metrics_urls["gateway"] == stack.openai.removesuffix("/v1") + "/metrics"
    assert {p.name for p in stack.log_dir.glob("*.log")} >= {f"{n}.log" for n in stack.metrics_urls}


def test_decode_counts_every_request_and_its_tokens(stack: Stack) -> None:
    text = stack.scrapes["decode-0"]
    assert value(text, "pcpstack:request_success_total", finished_reason="length") == REQUESTS
    assert value(text, "pcpstack:prompt_tokens_total") == sum(u["prompt_tokens"] for u in stack.usages)
    assert value(text, "pcpstack:generation_tokens_total") == REQUESTS * MAX_TOKENS
    for histogram in (
        "time_to_first_token",
        "time_per_output_token",
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "kv_fetch_time",
    ):
        assert value(text, f"pcpstack:{histogram}_seconds_count") == REQUESTS, histogram
        assert value(text, f"pcpstack:{histogram}_seconds_sum") > 0, histogram
    # Every request has finished: nothing runs, waits or holds KV blocks.
    assert value(text, "pcpstack:num_requests_running") == 0
    assert value(text, "pcpstack:num_requests_waiting") == 0
    assert value(text, "pcpstack:kv_cache_usage_perc") == 0


def test_prefill_times_every_forward_and_kv_push(stack: Stack) -> None:
    text = stack.scrapes["prefill-0"]
    assert value(text, "pcpstack:prefill_requests_total", outcome="ok") == REQUESTS
    for histogram in ("prefill_forward_time", "kv_push_time"):
        assert value(text, f"pcpstack:{histogram}_seconds_count") == REQUESTS, histogram
        assert value(text, f"pcpstack:{histogram}_seconds_sum") > 0, histogram
    # One request at a time: a forward each, of one prompt.
    assert value(text, "pcpstack:prefill_batch_prompts_count") == REQUESTS
    assert value(text, "pcpstack:prefill_batch_prompts_sum") == REQUESTS


def test_kvstore_bytes_are_cached_not_pinned_once_released(stack: Stack) -> None:
    text = stack.scrapes["kvstore"]
    assert value(text, "pcpstack:kvstore_pinned_bytes") == 0
    received = value(text, "pcpstack:kvstore_bytes_in_bytes_total")
    assert received > 0
    # Released replicas stay cached until evicted (2 GiB of room: none was).
    assert value(text, "pcpstack:kvstore_cached_bytes") == received


def test_registry_reports_the_one_set_ready(stack: Stack) -> None:
    text = stack.scrapes["registry"]
    assert value(text, "pcpstack:pcp_sets", state="ready") == 1
    assert value(text, "pcpstack:pcp_sets", state="starting") == 0
    assert value(text, "pcpstack:pcp_sets", state="broken") == 0


def test_gateway_counts_requests_first_tokens_and_tokens(stack: Stack) -> None:
    text = stack.scrapes["gateway"]
    endpoint = "/v1/completions"
    assert value(text, "pcpstack:gateway_requests_total", endpoint=endpoint, status="200") == REQUESTS
    assert value(text, "pcpstack:gateway_time_to_first_token_seconds_count", endpoint=endpoint) == REQUESTS
    assert value(text, "pcpstack:gateway_request_duration_seconds_count", endpoint=endpoint) == REQUESTS
    assert value(text, "pcpstack:gateway_tokens_total", kind="completion") == REQUESTS * MAX_TOKENS


def test_every_pcpstack_metric_is_exported_under_the_pcpstack_prefix(stack: Stack) -> None:
    for name, text in stack.scrapes.items():
        names = {sample for sample, _ in samples(text)}
        assert not {n for n in names if n.startswith("pcpstack_")}, name


def test_every_dashboard_query_names_metrics_the_services_export(stack: Stack) -> None:
    exported = {sample for text in stack.scrapes.values() for sample, _ in samples(text)}
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert queries
    for query in queries:
        named = re.findall(r"pcpstack:[A-Za-z0-9_:]+", query)
        assert named, query
        assert set(named) <= exported, f"{query}: {set(named) - exported} not exported"


def test_gateway_writes_one_access_line_per_request(stack: Stack) -> None:
    # The log file is not a terminal, so log records are JSON lines (beside the service's own prints).
    text = (stack.log_dir / "gateway.log").read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    access = [e for e in lines if e.get("logger") == "pcpstack.gateway.access"]
    by_id = {e["request_id"]: e for e in access}
    for request_id in stack.request_ids:
        entry = by_id[request_id]
        assert (entry["method"], entry["path"], entry["status"]) == ("POST", "/v1/completions", 200)
        assert entry["duration_s"] > 0 and re.fullmatch(r"[0-9a-f]{32}", entry["trace_id"])
