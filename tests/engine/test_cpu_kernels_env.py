"""PCPSTACK_CPU_KERNELS as the engine reads it: 0, 1 or unset, and a ConfigError for anything else rather
than the default taken in silence."""

from __future__ import annotations

import pytest

from pcpstack.common.config import ConfigError
from pcpstack.engine import cpu_kernels


@pytest.fixture
def uncached(monkeypatch):
    """The kernels looked up afresh, and again after the test (its environment is undone by then)."""
    cpu_kernels.build_library.cache_clear()
    cpu_kernels.library.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    cpu_kernels.build_library.cache_clear()
    cpu_kernels.library.cache_clear()


@pytest.mark.parametrize("value", ["", "0", "1", " 1 "])
def test_the_known_values_are_read(monkeypatch, value: str) -> None:
    monkeypatch.setenv(cpu_kernels.ENABLE_ENV, value)
    assert cpu_kernels.enable_setting() == value.strip()


def test_switched_off_the_kernels_are_not_built(uncached) -> None:
    uncached.setenv(cpu_kernels.ENABLE_ENV, "0")
    assert cpu_kernels.build_library() is None and cpu_kernels.library() is None


@pytest.mark.parametrize("value", ["yes", "off", "2"])
def test_an_unknown_value_is_refused_where_the_engine_reads_it(uncached, value: str) -> None:
    uncached.setenv(cpu_kernels.ENABLE_ENV, value)
    with pytest.raises(ConfigError, match=f"PCPSTACK_CPU_KERNELS='{value}': must be one of") as info:
        cpu_kernels.library()
    assert "0 (never use them)" in str(info.value) and "1 (use them without" in str(info.value)
