"""What a request asks of sampling (`SamplingParams`): its fields, their rules and a compact wire encoding.

Kept apart from sampling.py, which does the sampling with torch, so that the CLI and other light callers
can check a request's settings without importing torch (about 2 s on these machines).
"""

import math
import struct
from dataclasses import dataclass, field

# Below this a temperature is greedy: logits / 1e-45 overflow float32, and at 1e-6 the softmax of any two
# distinct float32 logits is already one-hot.
MIN_TEMPERATURE = 1e-6
# The most alternatives a token's log-probabilities may list (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20
# The range of one logit_bias entry (OpenAI's).
MAX_LOGIT_BIAS = 100.0
# The range of the presence and frequency penalties (OpenAI's).
MAX_OPENAI_PENALTY = 2.0
# to_bytes layout: max_tokens, temperature, top_k, top_p, seed (-1: unset), ignore_eos, counts of stop
# strings and stop token ids; then each stop string (u32 length, utf-8) and the stop ids (int64 each); then
# presence, frequency and repetition penalties, min_p, min_tokens, logprobs (-1: unset) and the number of
# logit_bias entries, followed by the entries (int64 id, float64 bias each).
_FIXED = struct.Struct("<qdqdq?II")
_EXTRA = struct.Struct("<ddddqqI")
_BIAS = struct.Struct("<qd")
_LENGTH = struct.Struct("<I")


@dataclass
class SamplingParams:
    """How one request picks tokens and when it stops (temperature 0 is greedy; top_k 0, top_p 1 are off)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    min_tokens: int = 0
    # None: no log-probabilities; n: each token's log-probability and its n most likely alternatives.
    logprobs: int | None = None

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise ValueError naming the field, its value and the rule; return self when valid. With
        `vocab_size`, logit_bias and stop_token_ids ids are checked to be below it too (an id past the
        vocabulary can never be sampled: a stop on it would be accepted and never happen)."""
        bad_bias = next(
            (
                (t, b)
                for t, b in self.logit_bias.items()
                if t < 0
                or (vocab_size is not None and t >= vocab_size)
                or not (math.isfinite(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS)
            ),
            None,
        )
        if bad_bias is not None:
            token, bias = bad_bias
            raise ValueError(
                f"SamplingParams.logit_bias[{token}]={bias!r}: ids must be in [0, vocabulary size"
                f"{'' if vocab_size is None else f' {vocab_size}'}) and biases in [-100, 100]"
            )
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            (
                "temperature",
                math.isfinite(self.temperature) and self.temperature >= 0,
                "must be finite and >= 0",
            ),
            ("top_k", self.top_k >= 0, "must be >= 0 (0 disables top-k)"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1] (1 disables top-p)"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "must be in [0, 2**63) or unset"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must hold non-empty strings"),
            (
                "stop_token_ids",
                all(t >= 0 and (vocab_size is None or t < vocab_size) for t in self.stop_token_ids),
                "must hold ids >= 0" if vocab_size is None else f"must hold ids in [0, {vocab_size})",
            ),
            (
                "presence_penalty",
                math.isfinite(self.presence_penalty) and abs(self.presence_penalty) <= MAX_OPENAI_PENALTY,
                "must be in [-2, 2] (0 disables)",
            ),
            (
                "frequency_penalty",
                math.isfinite(self.frequency_penalty) and abs(self.frequency_penalty) <= MAX_OPENAI_PENALTY,
                "must be in [-2, 2] (0 disables)",
            ),
            (
                "repetition_penalty",
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                "must be finite and > 0 (1 disables)",
            ),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1] (0 disables)"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"must be in [0, {MAX_LOGPROBS}] or unset",
            ),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {rule}")
        return self

    @property
    def greedy(self) -> bool:
        """Whether the most likely token is always taken (temperature 0, or too small to divide by)."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def processes_logits(self) -> bool:
        """Whether logits change before greedy or sampling (penalties, logit_bias or min_tokens are set)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def to_bytes(self) -> bytes:
        """A compact encoding that from_bytes reads back exactly (what a prefill job carries to its ranks)."""
        stops = [s.encode() for s in self.stop]
        parts = [
            _FIXED.pack(
                self.max_tokens,
                self.temperature,
                self.top_k,
                self.top_p,
                -1 if self.seed is None else self.seed,
                self.ignore_eos,
                len(stops),
                len(self.stop_token_ids),
            )
        ]
        parts += [_LENGTH.pack(len(s)) + s for s in stops]
        parts.append(struct.pack(f"<{len(self.stop_token_ids)}q", *self.stop_token_ids))
        parts.append(
            _EXTRA.pack(
                self.presence_penalty,
                self.frequency_penalty,
                self.repetition_penalty,
                self.min_p,
                self.min_tokens,
                -1 if self.logprobs is None else self.logprobs,
                len(self.logit_bias),
            )
        )
        parts += [_BIAS.pack(token, bias) for token, bias in self.logit_bias.items()]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, offset: int = 0) -> tuple["SamplingParams", int]:
        """The params encoded by to_bytes at `offset`, and the offset just past them."""
        max_tokens, temperature, top_k, top_p, seed, ignore_eos, n_stop, n_ids = _FIXED.unpack_from(
            data, offset
        )
        offset += _FIXED.size
        stop = []
        for _ in range(n_stop):
            (length,) = _LENGTH.unpack_from(data, offset)
            offset += _LENGTH.size
            stop.append(bytes(data[offset : offset + length]).decode())
            offset += length
        ids = list(struct.unpack_from(f"<{n_ids}q", data, offset))
        offset += 8 * n_ids
        extra = _EXTRA.unpack_from(data, offset)
        presence, frequency, repetition, min_p, min_tokens, logprobs, n_bias = extra
        offset += _EXTRA.size
        logit_bias = {}
        for _ in range(n_bias):
            token, bias = _BIAS.unpack_from(data, offset)
            offset += _BIAS.size
            logit_bias[token] = bias
        params = cls(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=None if seed < 0 else seed,
            stop=stop,
            stop_token_ids=ids,
            ignore_eos=ignore_eos,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            logit_bias=logit_bias,
            min_p=min_p,
            min_tokens=min_tokens,
            logprobs=None if logprobs < 0 else logprobs,
        )
        return params, offset
