"""The model families this engine serves, and what sets each apart, in one table.

Every family here is a dense decoder-only Llama-style transformer (RMSNorm, rotary positions, grouped-query
attention, SwiGLU MLP), so one model class runs them all; a family only says how its checkpoints spell
things. Loading code (weights.py) reads this table instead of branching on names, so adding a family is a new
row here, plus a test against transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pcpstack.common.models import SERVED_MODEL_TYPES


@dataclass(frozen=True)
class Family:
    """How one family's checkpoints differ from plain Llama."""

    name: str
    # config.json `model_type` and GGUF `general.architecture` values of this family.
    hf_model_type: str
    gguf_architectures: tuple[str, ...]
    # q/k/v projections carry biases (Qwen2), whatever the config says.
    qkv_bias: bool = False
    # The config's sliding_window applies unless `use_sliding_window` says otherwise (Mistral); other
    # families apply it only when use_sliding_window is true.
    sliding_window_by_default: bool = False
    # What the tests check of this family against transformers (BENCHMARKS.md's families table shows it).
    verified: str = ""

    def attention_bias(self, config: dict[str, Any]) -> bool:
        """Whether the q/k/v projections have biases in this checkpoint."""
        return self.qkv_bias or bool(config.get("attention_bias", False))

    def sliding_window(self, config: dict[str, Any]) -> int | None:
        """The attention window this checkpoint uses, or None for full attention."""
        window = config.get("sliding_window")
        if window and config.get("use_sliding_window", self.sliding_window_by_default):
            return int(window)
        return None


FAMILIES = (
    Family(
        "Llama 1-3.x, SmolLM2",
        hf_model_type="llama",
        gguf_architectures=("llama",),
        verified=(
            "SmolLM2-135M GGUF (Q4_1): logits and greedy tokens through PCP=1/2/3, TP=3 x PCP=2 and decode "
            "TP=9 x DCP=3; random models (plain, RoPE scaling llama3 / linear / yarn): every position's "
            "logits from the HF folder (1e-5), and through PCP=2 prefill in chunks and decode from the "
            "replica, logits (1e-4) and 16 greedy tokens from the folder and the converted GGUF (yarn: "
            "folder only, llama.cpp's yarn keys are refused); dynamic NTK RoPE (folder only, GGUF has no "
            "such type), prompt beyond max_position_embeddings: the same PCP=2 path against a fresh "
            "transformers generation, and two sequences of different lengths prefilled in one batch and "
            "decoded together, each against its own generation (1e-5), and DCP=2 decode against the single "
            "engine"
        ),
    ),
    Family(
        "Qwen2, Qwen2.5",
        hf_model_type="qwen2",
        gguf_architectures=("qwen2",),
        qkv_bias=True,
        verified=(
            "random model with q/k/v biases: every position's logits from the HF folder (1e-5), and through "
            "PCP=2 prefill in chunks and decode from the replica, logits (1e-4) and 16 greedy tokens from "
            "the folder and the converted GGUF"
        ),
    ),
    Family(
        "Mistral",
        hf_model_type="mistral",
        gguf_architectures=(),
        sliding_window_by_default=True,
        verified=(
            "random HF folder: every position's logits (1e-5), and through PCP=2 prefill in chunks and "
            "decode from the replica, logits (1e-4) and 16 greedy tokens (its GGUF is llama's); a sliding "
            "window caps the context, longer prompts are refused naming it (the window is not implemented)"
        ),
    ),
)


def family_of_config(config: dict[str, Any]) -> Family:
    """The family of a config.json; ValueError naming the supported model types for anything else."""
    model_type = config.get("model_type")
    for family in FAMILIES:
        if family.hf_model_type == model_type:
            return family
    raise ValueError(
        f"config.json model_type={model_type!r} is not supported; supported: {SERVED_MODEL_TYPES}"
    )


def family_of_gguf(architecture: str) -> Family:
    """The family of a GGUF's general.architecture; ValueError naming the supported ones for anything else."""
    for family in FAMILIES:
        if architecture in family.gguf_architectures:
            return family
    supported = [a for f in FAMILIES for a in f.gguf_architectures]
    raise ValueError(f"GGUF general.architecture={architecture!r} is not supported; supported: {supported}")
