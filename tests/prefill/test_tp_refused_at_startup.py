"""What a prefill node or decode worker refuses at start-up (exit 2, one line naming the key and the value):
a TP size its model or devices cannot run, and settings the config rules accept that no service runs yet (DCP,
a layerwise KV transfer), refused rather than run as if they were off. Real `pcpstack serve` processes."""

from __future__ import annotations

import pytest

from tests.common.test_startup import REGISTRY, refusal


# Prefill and decode run TP: a node is refused only a TP size its model cannot split (found once it has read
# the model's shape, by loading it) or more rank processes than devices (CUDA_VISIBLE_DEVICES="" hides every
# GPU, so that refusal holds on any machine).
@pytest.mark.parametrize(
    ("service", "args", "env", "expected"),
    [
        (
            service,
            ["--model", "tiny", "--set", "tensor_parallel_size=3"],
            {},
            "tensor_parallel_size=3 must divide the model's num_attention_heads=4",
        )
        for service in ("prefill", "decode")
    ]
    + [
        (
            "prefill",
            ["--model", "tiny", "--device", "cuda", "--set", "tensor_parallel_size=2"],
            {"CUDA_VISIBLE_DEVICES": ""},
            "tensor_parallel_size=2 x (prefill_context_parallel_size / nnodes)=1 needs 2 cuda devices",
        ),
        (
            "decode",
            ["--model", "tiny", "--device", "cuda", "--set", "tensor_parallel_size=2"],
            {"CUDA_VISIBLE_DEVICES": ""},
            "tensor_parallel_size=2 needs 2 cuda devices",
        ),
    ],
)
def test_a_tp_the_model_or_devices_cannot_run_is_refused_at_start_up(
    child_env, service, args, env, expected
) -> None:
    # WARNING keeps the model's loading progress lines out of the one line read back.
    line = refusal(child_env, service, "--registry", REGISTRY, "--log-level", "WARNING", *args, env=env)
    assert expected in line


@pytest.mark.parametrize(
    ("service", "override", "expected"),
    [
        (
            "prefill",
            "decode_context_parallel_size=3",
            "decode_context_parallel_size=3: decode CP is not wired",
        ),
        (
            "decode",
            "kv_transfer_mode=layerwise",
            "kv_transfer_mode='layerwise': a layerwise KV transfer is not wired",
        ),
    ],
)
def test_other_accepted_but_unbuilt_settings_are_refused_at_start_up(
    child_env, service, override, expected
) -> None:
    # DCP 3 needs TP 9 by seed 001's rules; the DCP refusal comes first (decode runs DCP, prefill does not)
    extra = ["--set", "tensor_parallel_size=9"] if override.startswith("decode_context") else []
    line = refusal(child_env, service, "--registry", REGISTRY, "--set", override, *extra)
    assert expected in line


# A decode worker runs DCP, within seed 001's rules: a DCP size they forbid is refused at start-up, the rule
# named, before any rank starts (the tiny model has 2 K/V heads, so TP=2 leaves none to split by tokens).
@pytest.mark.parametrize(
    ("overrides", "rule"),
    [
        (["decode_context_parallel_size=2"], "tp % dcp == 0 and tp >= dcp"),
        (
            ["tensor_parallel_size=2", "decode_context_parallel_size=2"],
            "(tp // num_kv_heads)=1 must be >= dcp",
        ),
        (
            ["prefill_context_parallel_size=2", "decode_context_parallel_size=2"],
            "PCP and DCP cannot both be > 1",
        ),
    ],
    ids=["dcp-without-tp", "gqa", "with-pcp"],
)
def test_a_dcp_the_rules_forbid_is_refused_at_decode_start_up(child_env, overrides, rule) -> None:
    sets = [arg for override in overrides for arg in ("--set", override)]
    args = ["--registry", REGISTRY, "--log-level", "WARNING", "--model", "tiny", *sets]
    line = refusal(child_env, "decode", *args)
    assert rule in line and "decode_context_parallel_size=" in line
