"""Model arguments of a Llama-family decoder: one dataclass, validated when built."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rope.py needs torch; checking a config must not
    from pcpstack.engine.rope import RopeScaling


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = True
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # How the checkpoint scales its RoPE frequencies for long contexts; None: it does not.
    rope_scaling: "RopeScaling | None" = None
    # The checkpoint's sliding attention window (Mistral), if it applies. Attention past a window is not
    # implemented: max_seq_len is capped at it (attention equals full attention while the context fits),
    # and a longer prompt is refused naming the window.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelArgs.{name}={getattr(self, name)} must be > 0")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelArgs.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} "
                "(grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelArgs.head_dim={self.head_dim} must be even (RoPE rotates pairs)")

    @property
    def q_per_kv(self) -> int:
        """Query heads that share one K/V head."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def tiny(cls) -> "ModelArgs":
        """A small random-weight model for fast tests; same code path as real models (GQA included)."""
        return cls(
            vocab_size=320,
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            hidden_dim=128,
            norm_eps=1e-5,
            rope_theta=10000.0,
            max_seq_len=4096,
            tie_embeddings=True,
            bos_token_id=None,
            eos_token_ids=(256,),
        )
