"""Until tensor parallelism (and DCP, and a layerwise KV transfer) are wired into the services, a prefill
node or decode worker configured with them is refused at start-up (exit 2, one line naming the key and the
value) instead of being accepted and run as if they were off. Real `pcpstack serve` processes, refused before
any model loads."""

from __future__ import annotations

import pytest

from tests.common.test_startup import REGISTRY, refusal


@pytest.mark.parametrize("service", ["prefill", "decode"])
def test_tensor_parallel_size_above_one_is_refused_naming_the_service(child_env, service: str) -> None:
    line = refusal(child_env, service, "--registry", REGISTRY, "--set", "tensor_parallel_size=3")
    assert f"tensor_parallel_size=3: tensor parallelism is not wired into the {service} service yet" in line


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("decode_context_parallel_size=3", "decode_context_parallel_size=3: decode CP is not wired"),
        ("kv_transfer_mode=layerwise", "kv_transfer_mode='layerwise': a layerwise KV transfer is not wired"),
    ],
)
def test_other_accepted_but_unbuilt_settings_are_refused_at_start_up(child_env, override, expected) -> None:
    # DCP 3 needs TP 9 by seed 001's rules; the DCP refusal comes first
    extra = ["--set", "tensor_parallel_size=9"] if override.startswith("decode_context") else []
    line = refusal(child_env, "decode", "--registry", REGISTRY, "--set", override, *extra)
    assert expected in line
