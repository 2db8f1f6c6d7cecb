"""The README says what the code does: its flags table is the parsers' own, its TLS recipe is the one
tests/security/test_tls_recipe.py runs, and its OpenAI examples (curl and the `openai` package) run as
written against `pcpstack up` (the embedded model; only the gateway port is swapped for a free one)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pcpstack.cli.launch import cli_command
from pcpstack.common.ports import free_port
from tests.security import test_tls_recipe
from tools.flags_table import render_readme

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCUMENTED_GATEWAY = "127.0.0.1:8000"


def _blocks(language: str) -> list[str]:
    """The README's fenced code blocks of a language ("" for plain ones)."""
    blocks, current, current_language = [], None, ""
    for line in README.splitlines(keepends=True):
        if line.startswith("```") and current is None:
            current, current_language = [], line[3:].strip()
        elif line.startswith("```"):
            if current_language == language:
                blocks.append("".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _words(text: str) -> list[str]:
    return text.replace("\\\n", " ").split()


def test_the_flags_table_is_what_the_parsers_give() -> None:
    assert render_readme(README) == README, "README.md is stale: run python tools/flags_table.py"


def test_the_tls_recipe_is_the_one_the_recipe_test_runs() -> None:
    recipe = test_tls_recipe.__doc__.split("\n\n")[1]
    assert any(_words(recipe) == _words(block) for block in _blocks("")), recipe


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> str:
    """`pcpstack up` with the embedded model, its gateway on a free port; yields HOST:PORT."""
    port = free_port()
    logs = tmp_path_factory.mktemp("readme")
    up = subprocess.Popen(
        cli_command("up", "--pcp", "1", "--gateway-port", str(port), "--log-dir", str(logs)),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while "Ctrl-C" not in up.stdout.readline():
            assert up.poll() is None and time.monotonic() < deadline, "pcpstack up did not become ready"
        yield f"127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


@pytest.mark.slow
def test_the_curl_example_answers_a_chat_completion(gateway: str) -> None:
    (example,) = [b for b in _blocks("") if b.startswith("curl ") and "/v1/chat/completions" in b]
    assert DOCUMENTED_GATEWAY in example
    run = subprocess.run(
        ["bash", "-c", example.replace(DOCUMENTED_GATEWAY, gateway)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"]
    assert 0 < answer["usage"]["completion_tokens"] <= 32


@pytest.mark.slow
def test_the_openai_python_example_streams_an_answer(gateway: str) -> None:
    (example,) = [b for b in _blocks("python") if "from openai import OpenAI" in b]
    assert DOCUMENTED_GATEWAY in example
    run = subprocess.run(
        [sys.executable, "-c", example.replace(DOCUMENTED_GATEWAY, gateway)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()
