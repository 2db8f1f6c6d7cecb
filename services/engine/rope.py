"""Rotary position embeddings and the context-extension schemes checkpoints declare for them.

A checkpoint's RoPE is its base `theta` plus, for long-context models, a scaling of the rotation
frequencies, read once from config.json (`rope_scaling` / `rope_parameters`) or GGUF metadata into a
`RopeScaling`:

- `linear` (position interpolation): every frequency divided by `factor`.
- `llama3` (Llama 3.1/3.2): wavelengths longer than original_context / low_freq_factor are divided by
  `factor`, those shorter than original_context / high_freq_factor are kept, and the band between blends
  the two linearly in original_context / wavelength.
- `yarn`: frequencies blended between interpolated (divided by `factor`) and kept by a ramp over the
  dimensions whose number of rotations within the original context lies between beta_slow and beta_fast;
  cos and sin are then multiplied by an attention factor (0.1 ln(factor) + 1 unless the checkpoint gives
  one).
- `dynamic` (NTK-aware, as transformers computes it): the frequencies follow the sequence's length L.
  While L is within max_position_embeddings (M) they are the plain ones; beyond it the base theta grows to
  theta * (factor * L / M - (factor - 1)) ** (head_dim / (head_dim - 2)). One transformers generation
  recomputes them before each forward for L = the sequence's length at that forward and keeps the K/V it
  cached as they were rotated, so here every forward rotates each sequence's new tokens by its own L: the
  whole prompt's length for every chunk and every context-parallel rank of a prefill, the length after the
  step for a decode step (AttentionMetadata.rope_lens). Its served context is factor * M. A K/V block
  computed for one prompt is then not the block another prompt would compute, so prefix reuse is off
  for such a model (`RopeScaling.rotates_by_length`). Only config.json declares it: llama.cpp's GGUF has
  no dynamic scaling type.
- GGUF files of llama3-scaled models carry the per-frequency divisors themselves (`rope_freqs.weight`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# Kinds this engine computes; anything else a checkpoint declares is refused by name.
SUPPORTED = ("default", "linear", "llama3", "yarn", "dynamic")


@dataclass(frozen=True)
class RopeScaling:
    """How a checkpoint scales its RoPE frequencies (kind "default": not at all)."""

    kind: str = "default"
    factor: float = 1.0
    # llama3 and yarn: the context the model was pre-trained with; dynamic: max_position_embeddings, the
    # length up to which the frequencies stay the plain ones.
    original_context: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # yarn: multiplier of cos and sin; None: derived from factor.
    attention_factor: float | None = None
    truncate: bool = True
    # GGUF `rope_freqs.weight`: a divisor per frequency, when the file states them outright.
    divisors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in SUPPORTED:
            raise ValueError(f"RoPE scaling {self.kind!r} is not supported; supported: {SUPPORTED}")
        if self.factor <= 0:
            raise ValueError(f"RoPE scaling factor={self.factor} must be > 0")
        if self.kind in ("llama3", "yarn", "dynamic") and self.original_context <= 0:
            stated = "max_position_embeddings"
            if self.kind != "dynamic":  # the others scale from the pre-training context
                stated = f"original_{stated}"
            raise ValueError(f"RoPE scaling {self.kind!r} needs {stated} > 0")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 RoPE scaling needs high_freq_factor={self.high_freq_factor} > "
                f"low_freq_factor={self.low_freq_factor}"
            )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> RopeScaling:
        """The scaling a config.json declares (`rope_parameters`, or the older `rope_scaling`)."""
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in SUPPORTED:
            raise ValueError(
                f"config.json rope type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}"
            )
        if kind == "default":
            return cls()
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("config.json partial_rotary_factor other than 1.0 is not supported")
        original = rope.get("original_max_position_embeddings") or config.get("max_position_embeddings", 0)
        if kind == "dynamic":  # transformers scales from max_position_embeddings, whatever else is stated
            original = config.get("max_position_embeddings", 0)
        factor = rope.get("factor")
        if factor is None and kind == "yarn":  # stated through the two context lengths instead
            factor = config["max_position_embeddings"] / original
        if factor is None:
            raise ValueError(f"config.json rope type {kind!r} needs a `factor`")
        return cls(
            kind=kind,
            factor=float(factor),
            original_context=int(original),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            attention_factor=_yarn_attention_factor(rope, float(factor)) if kind == "yarn" else None,
            truncate=bool(rope.get("truncate", True)),
        )

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], arch: str, divisors: torch.Tensor | None) -> RopeScaling:
        """The scaling a GGUF file declares: its scaling type and factor, or per-frequency divisors.

        llama.cpp's format has no dynamic NTK type (its rope.scaling.type is none, linear, yarn or longrope),
        so a dynamic checkpoint is served from its HF folder."""
        kind = meta.get(f"{arch}.rope.scaling.type", "none")
        if divisors is not None:
            return cls(kind="default", divisors=tuple(float(d) for d in divisors.flatten()))
        if kind == "none":
            return cls()
        if kind == "linear":
            return cls(kind="linear", factor=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)))
        raise ValueError(
            f"GGUF rope.scaling.type={kind!r} is not supported; supported: none, linear, rope_freqs (dynamic "
            "NTK scaling, which GGUF cannot declare, is served from the model's HF folder)"
        )

    def inv_frequencies(self, head_dim: int, theta: float) -> torch.Tensor:
        """The head_dim / 2 rotation frequencies (radians per position), scaled."""
        # On the CPU explicitly: models are built under a meta-device context before their weights load.
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (theta**exponent)
        if self.divisors:
            if len(self.divisors) != inv_freq.numel():
                raise ValueError(
                    f"rope_freqs has {len(self.divisors)} values; head_dim={head_dim} needs "
                    f"{inv_freq.numel()}"
                )
            return inv_freq / torch.tensor(self.divisors, dtype=inv_freq.dtype, device="cpu")
        if self.kind == "linear":
            return inv_freq / self.factor
        if self.kind == "llama3":
            return self._llama3(inv_freq)
        if self.kind == "yarn":
            return self._yarn(inv_freq, head_dim, theta)
        return inv_freq

    @property
    def rotates_by_length(self) -> bool:
        """Whether the frequencies depend on the sequence's length (dynamic): the same tokens' K/V then
        differ between prompts of different lengths, so no K/V may be reused across requests."""
        return self.kind == "dynamic"

    def served_context(self, max_position_embeddings: int) -> int:
        """The longest sequence served for a config's max_position_embeddings: factor times it for dynamic,
        whose config states the pre-training context and how far it stretches; the stated one otherwise, as
        the other kinds state the extended context itself."""
        if self.kind == "dynamic":
            return int(max_position_embeddings * self.factor)
        return max_position_embeddings

    def frequencies_by_length(
        self, lengths: torch.Tensor, inv_freq: torch.Tensor, head_dim: int, theta: float
    ) -> torch.Tensor:
        """[B, head_dim / 2] dynamic NTK frequencies for sequences of `lengths` [B] (int64), given the
        plain ones `inv_freq` [head_dim / 2] (on the lengths' device), which lengths up to the original
        context keep.

        In float32 tensor arithmetic, the order transformers' `_compute_dynamic_ntk_parameters` uses when its
        forward passes the length as a tensor, so the frequencies agree to the last bits."""
        longer = lengths > self.original_context
        if not bool(longer.any()):
            return inv_freq.expand(len(lengths), -1)
        stretch = (self.factor * lengths / self.original_context) - (self.factor - 1)  # float32 [B]
        base = theta * stretch ** (head_dim / (head_dim - 2))
        scaled = 1.0 / (base[:, None] ** _exponents(head_dim, lengths.device)[None, :])
        return torch.where(longer[:, None], scaled, inv_freq[None, :])

    @property
    def cos_sin_scale(self) -> float:
        """The factor cos and sin are multiplied by (yarn's attention factor; 1 otherwise)."""
        return self.attention_factor if self.kind == "yarn" and self.attention_factor is not None else 1.0

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        # How many wavelengths of each frequency the original context holds decides its treatment.
        rotations = self.original_context * inv_freq / (2 * math.pi)
        band = self.high_freq_factor - self.low_freq_factor
        blend = ((rotations - self.low_freq_factor) / band).clamp(0, 1)
        # blend 0: long wavelengths, interpolated; blend 1: short ones, kept; between: a linear mix.
        return inv_freq / self.factor * (1 - blend) + inv_freq * blend

    def _yarn(self, inv_freq: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
        def dimension_of(rotations: float) -> float:
            # The dimension index whose frequency turns `rotations` times within the original context.
            turns = self.original_context / (rotations * 2 * math.pi)
            return head_dim * math.log(turns) / (2 * math.log(theta))

        low, high = dimension_of(self.beta_fast), dimension_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001  # a ramp of zero width would divide by zero
        index = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
        ramp = ((index - low) / (high - low)).clamp(0, 1)
        # ramp 0: dimensions that turn often within the original context keep their frequency; ramp 1:
        # slow ones are interpolated.
        return inv_freq * (1 - ramp) + inv_freq / self.factor * ramp


@functools.cache
def _exponents(head_dim: int, device: torch.device) -> torch.Tensor:
    """[head_dim / 2] the exponents 2i / head_dim of theta, made once per device (a decode step with dynamic
    RoPE would otherwise build them every step)."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim


def _yarn_attention_factor(rope: Mapping[str, Any], factor: float) -> float:
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])

    def scale(ratio: float, weight: float = 1.0) -> float:
        return 1.0 if ratio <= 1 else 0.1 * weight * math.log(ratio) + 1.0

    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return scale(factor, mscale) / scale(factor, mscale_all_dim)
    return scale(factor)


NO_SCALING = RopeScaling()


def rotation(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, head_dim] of the rotation at each absolute position (rotate-half convention), for the
    frequencies `inv_freq` [head_dim / 2] (RopeScaling.inv_frequencies, on the positions' device), or
    [n, head_dim / 2] for each position its own (dynamic), and the cos/sin `scale`."""
    freqs = positions.float()[:, None] * inv_freq  # [n, head_dim / 2]
    angles = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return angles.cos().to(dtype), angles.sin().to(dtype)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)
