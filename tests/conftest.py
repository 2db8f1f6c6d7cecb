"""Shared test helpers: the repo root, and the environment child processes inherit."""

from __future__ import annotations

from pathlib import Path

import pytest

from pcpstack.cli import launch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for subprocesses: output unbuffered, telemetry exporters off (launch.child_env)."""
    return launch.child_env(inherit_telemetry=False)
