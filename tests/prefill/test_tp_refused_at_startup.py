"""Until tensor parallelism (and DCP, and a layerwise KV transfer) are wired into a service, a prefill
node or decode worker configured with them is refused at start-up (exit 2, one line naming the key and the
value) instead of being accepted and run as if they were off. Real `pcpstack serve` processes, refused before
any model loads."""

from __future__ import annotations

import pytest

from tests.common.test_startup import REGISTRY, refusal


# Decode runs TP too: a worker is refused a TP size its model cannot split (found once its ranks load their
# shards) or more ranks than devices.
@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (
            ["--model", "tiny", "--set", "tensor_parallel_size=3"],
            {},
            "tensor_parallel_size=3 must divide the model's num_attention_heads=4",
        ),
        (
            ["--model", "tiny", "--device", "cuda", "--set", "tensor_parallel_size=2"],
            {"CUDA_VISIBLE_DEVICES": ""},
            "tensor_parallel_size=2 needs 2 cuda devices",
        ),
    ],
)
def test_decode_refuses_a_tp_its_model_or_devices_cannot_run(child_env, args, env, expected) -> None:
    line = refusal(child_env, "decode", "--registry", REGISTRY, "--log-level", "WARNING", *args, env=env)
    assert expected in line


# Prefill runs TP: a node is refused only a TP size its model cannot split, or more rank processes than
# devices (CUDA_VISIBLE_DEVICES="" hides every GPU, so the refusal holds on any machine).
@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (
            ["--model", "tiny", "--set", "tensor_parallel_size=3"],
            {},
            "tensor_parallel_size=3 must divide the model's num_attention_heads=4",
        ),
        (
            ["--model", "tiny", "--device", "cuda", "--set", "tensor_parallel_size=2"],
            {"CUDA_VISIBLE_DEVICES": ""},
            "tensor_parallel_size=2 x (prefill_context_parallel_size / nnodes)=1 needs 2 cuda devices",
        ),
    ],
)
def test_prefill_refuses_a_tp_its_model_or_devices_cannot_run(child_env, args, env, expected) -> None:
    # The head rule needs the model's shape, read by loading it: WARNING keeps its progress lines quiet.
    line = refusal(child_env, "prefill", "--registry", REGISTRY, "--log-level", "WARNING", *args, env=env)
    assert expected in line


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
