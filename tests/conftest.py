"""Shared test helpers: the repo root on sys.path, and the environment child processes inherit."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for subprocesses: the repo importable, output unbuffered, telemetry exporters off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PCPSTACK_TRACE_FILE", None)
    return env
