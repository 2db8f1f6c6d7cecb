"""Until tensor parallelism is wired into the services, a prefill node or decode worker configured with
tensor_parallel_size > 1 is refused at start-up (exit 2, one line naming the key and the value) instead of
being accepted and run as if TP were 1. Real `pcpstack serve` processes, refused before any model loads."""

from __future__ import annotations

import pytest

from tests.common.test_startup import REGISTRY, refusal


@pytest.mark.parametrize("service", ["prefill", "decode"])
def test_tensor_parallel_size_above_one_is_refused_naming_the_service(child_env, service: str) -> None:
    line = refusal(child_env, service, "--registry", REGISTRY, "--set", "tensor_parallel_size=3")
    assert f"tensor_parallel_size=3: tensor parallelism is not wired into the {service} service yet" in line
