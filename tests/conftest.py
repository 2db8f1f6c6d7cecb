"""Shared test helpers: the repo root, and the environment child processes inherit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for subprocesses: output unbuffered, telemetry exporters off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PCPSTACK_TRACE_FILE", None)
    return env
