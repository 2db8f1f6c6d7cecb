"""A model with dynamic NTK RoPE serves without prefix reuse: its K are rotated by the whole prompt's length,
so a block cached for one prompt is not the block another prompt would compute (engine/rope.py)."""

from __future__ import annotations

import json
from pathlib import Path

from pcpstack.prefill.node import ModelInfo, NodeOptions, RankSupervisor
from pcpstack.prefill.server import PrefillServicer

# A Llama config.json as transformers writes it (the node reads only the config, never the weights).
CONFIG = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "rope_theta": 10000.0,
}


async def _no_stores(fresh: bool) -> list[str]:
    return []


def _prefix_cache(folder: Path, **extra) -> bool:
    """Whether a prefill servicer for a model of this config reuses prefixes when asked to."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**CONFIG, **extra}))
    info = ModelInfo.probe(str(folder), block_size=16, device="cpu")
    supervisor = RankSupervisor(NodeOptions(str(folder), 16, "127.0.0.1"), info, lambda *_: None)
    return PrefillServicer(supervisor, info, _no_stores, prefix_cache=True).prefix_cache


def test_prefix_cache_is_off_for_a_dynamic_rope_model_only(tmp_path) -> None:
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert _prefix_cache(tmp_path / "dynamic", rope_parameters=dynamic) is False
    assert _prefix_cache(tmp_path / "plain") is True
