"""The documented TLS recipe, run as a user runs it: default development certificates, the environment
variables, `pcpstack up`, then a request through the CLI and one through the OpenAI HTTP API.

    pcpstack certs
    export PCPSTACK_TLS_CA=certs/ca.pem PCPSTACK_TLS_CERT=certs/registry.pem \\
           PCPSTACK_TLS_KEY=certs/registry-key.pem PCPSTACK_TOKEN=$(openssl rand -hex 32)
    pcpstack up --pcp 2
    pcpstack generate --target 127.0.0.1:PORT --chat "Hello"

The stack used to say ready while every request failed "Hostname Verification Check failed": its prefill
sets bound 127.0.0.x addresses the default certificates do not name. Now every service of a local stack
uses 127.0.0.1, and `up` refuses at once a certificate that does not name it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pcpstack.cli.certs import DEFAULT_NAMES, LOCAL_STACK_HOST, certificate_covers, write_certs
from pcpstack.common import security

READY_TIMEOUT_S = 900.0


def _pcpstack(*args: str) -> list[str]:
    return [sys.executable, "-m", "pcpstack.cli", *args]


def _recipe_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in security.ENV_VARS}
    env.update(
        {
            security.CA_ENV: "certs/ca.pem",
            security.CERT_ENV: "certs/registry.pem",
            security.KEY_ENV: "certs/registry-key.pem",
            security.TOKEN_ENV: secrets.token_hex(32),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _wait_for_endpoints(up: subprocess.Popen, stdout: Path, stderr: Path) -> dict[str, str]:
    """The addresses `pcpstack up` prints once the stack is ready ({"decode": ..., "openai": ...,
    "metrics": ...})."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        text = stdout.read_text()
        if "press Ctrl-C" in text:
            return {m[0]: m[1] for m in re.findall(r"^(decode|openai|metrics)\s+(\S+)", text, re.MULTILINE)}
        if up.poll() is not None:
            break
        time.sleep(1)
    raise AssertionError(f"`pcpstack up` did not become ready:\n{stderr.read_text()[-3000:]}")


def _logs_of(stderr: Path) -> str:
    """The tail of every service log of the stack (the folder `up` names), for a failure message."""
    found = re.search(r"logs in (\S+)", stderr.read_text())
    if found is None:
        return ""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(Path(found[1]).glob("*.log")))


@pytest.mark.slow
def test_the_documented_tls_recipe_serves_requests(tmp_path: Path) -> None:
    certs = subprocess.run(_pcpstack("certs"), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert certs.returncode == 0, certs.stderr
    env = _recipe_environment()
    stdout, stderr = tmp_path / "up.out", tmp_path / "up.err"
    with stdout.open("w") as out, stderr.open("w") as err:
        up = subprocess.Popen(
            _pcpstack("up", "--pcp", "2"),
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    try:
        endpoints = _wait_for_endpoints(up, stdout, stderr)
        answer = subprocess.run(
            _pcpstack(
                "generate", "--target", endpoints["decode"], "--max-tokens", "4", "--json", "--chat", "Hello"
            ),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert answer.returncode == 0, f"{answer.stderr}\n{_logs_of(stderr)}"
        assert len(json.loads(answer.stdout)["token_ids"]) > 0

        request = urllib.request.Request(
            f"{endpoints['openai']}/completions",
            data=json.dumps({"prompt": "Hello", "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"},
        )
        # With TLS on, the gateway serves HTTPS with its certificate; the client trusts the recipe's CA.
        ca = ssl.create_default_context(cafile=str(tmp_path / "certs" / "ca.pem"))
        with urllib.request.urlopen(request, timeout=300, context=ca) as reply:
            assert reply.status == 200
            assert json.loads(reply.read())["usage"]["completion_tokens"] > 0
        # the metrics line names the gateway's scheme too
        assert endpoints["metrics"].startswith("https://")
        with urllib.request.urlopen(endpoints["metrics"], timeout=60, context=ca) as reply:
            assert reply.status == 200 and b"pcpstack" in reply.read()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGINT)  # `up` stops its services on Ctrl-C
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def test_up_refuses_at_once_a_certificate_that_does_not_name_the_stacks_address(tmp_path: Path) -> None:
    certs = subprocess.run(
        _pcpstack("certs", "--ip", "10.1.2.3", "--dns", "example.test"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert certs.returncode == 0, certs.stderr
    up = subprocess.run(
        _pcpstack("up", "--pcp", "2", "--log-dir", str(tmp_path / "logs")),
        cwd=tmp_path,
        env=_recipe_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert up.returncode != 0
    assert "PCPSTACK_TLS_CERT='certs/registry.pem' does not name 127.0.0.1" in up.stderr
    assert not list((tmp_path / "logs").glob("*.log")), "no service should have been started"


def test_every_default_certificate_names_the_local_stacks_address(tmp_path: Path) -> None:
    write_certs(tmp_path)
    for name in DEFAULT_NAMES:
        pem = (tmp_path / f"{name}.pem").read_bytes()
        assert certificate_covers(pem, LOCAL_STACK_HOST) and certificate_covers(pem, "localhost")
        assert not certificate_covers(pem, "127.0.0.10")
