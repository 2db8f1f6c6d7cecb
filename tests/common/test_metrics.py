"""A service started with --metrics serves its OpenTelemetry metrics for Prometheus to scrape, named
under `pcpstack:`."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
import urllib.request

import pytest

from pcpstack.cli.launch import spawn_service
from pcpstack.common.ports import free_port
from pcpstack.kvstore.client import KvStoreClient


def scrape(url: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                return reply.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.slow
def test_kvstore_metrics_are_scrapeable_and_count_bytes(child_env) -> None:
    port, metrics_port = free_port(), free_port()
    proc = spawn_service(
        "kvstore",
        ["--port", str(port), "--metrics", f"127.0.0.1:{metrics_port}"],
        env=child_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        scrape(f"http://127.0.0.1:{metrics_port}/metrics")

        async def put() -> None:
            async with KvStoreClient(f"127.0.0.1:{port}", prefer_shm=False) as store:
                # The metrics endpoint starts before the gRPC port is bound: wait for the store itself.
                deadline = time.monotonic() + 30
                while True:
                    try:
                        await store.stat()
                        break
                    except Exception:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.1)
                await store.put("metrics-test", "fp", b"x" * 4096)

        asyncio.run(put())
        text = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        match = re.search(r"^pcpstack:kvstore_bytes_in\S*\s+(\S+)$", text, re.MULTILINE)
        assert match, text[:2000]
        assert float(match.group(1)) >= 4096
        assert re.search(r"^pcpstack:kvstore_pinned_bytes\S*\s+4096", text, re.MULTILINE)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
