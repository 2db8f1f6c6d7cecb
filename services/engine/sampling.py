"""Per-request sampling (greedy, temperature, top-k, top-p, seed) and stop conditions.

Each request owns a torch.Generator seeded from its seed, and rows are sampled one request at a time, so a
request's tokens never depend on which other requests share its batch.

Sampling is numerically safe for every value validation accepts: a temperature below MIN_TEMPERATURE is
greedy (dividing by it would overflow the logits to inf), probabilities come from a max-shifted softmax in
float32, and when no finite probability is left (NaN logits, everything masked) the best token is taken.
"""

import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pcpstack.engine.tokenizer import IncrementalDecoder, Tokenizer

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
# Below this a temperature is greedy: logits / 1e-45 overflow float32, and at 1e-6 the softmax of any two
# distinct float32 logits is already one-hot.
MIN_TEMPERATURE = 1e-6
# to_bytes layout: max_tokens, temperature, top_k, top_p, seed (-1: unset), ignore_eos, counts of stop
# strings and stop token ids; then each stop string (u32 length, utf-8) and the stop ids (int64 each).
_FIXED = struct.Struct("<qdqdq?II")
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

    def validate(self) -> "SamplingParams":
        """Raise ValueError naming the field, its value and the rule; return self when valid."""
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
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must hold ids >= 0"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {rule}")
        return self

    @property
    def greedy(self) -> bool:
        """Whether the most likely token is always taken (temperature 0, or too small to divide by)."""
        return self.temperature < MIN_TEMPERATURE

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
        params = cls(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=None if seed < 0 else seed,
            stop=stop,
            stop_token_ids=ids,
            ignore_eos=ignore_eos,
        )
        return params, offset


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded from `seed`, or from the OS when unset."""
    return torch.Generator().manual_seed(
        seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    )


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from logits [vocab] under `params`, drawing randomness only from `generator`."""
    if params.greedy:
        return int(logits.argmax())
    # NaN is never a candidate; +inf would make the shifted softmax NaN, so it caps at the float32 max.
    logits = logits.float().cpu().nan_to_num(nan=-math.inf, posinf=torch.finfo(torch.float32).max)
    best = int(logits.argmax())
    logits = logits / params.temperature
    if 0 < params.top_k < logits.numel():
        kth_best = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth_best, -math.inf)
    if params.top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        probs = _softmax(sorted_logits)
        # Drop a token when the tokens before it already reach top_p; the best token always stays.
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[0] = False
        logits = logits.index_fill(0, order[drop], -math.inf)
    probs = _softmax(logits)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        return best  # nothing left to draw from (every logit NaN or -inf)
    return int(torch.multinomial(probs, 1, generator=generator))


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    """softmax shifted by the largest finite logit; all zeros (never NaN) when no logit is finite."""
    top = logits.max()
    if not bool(torch.isfinite(top)):
        return torch.zeros_like(logits)
    return (logits - top).exp() / (logits - top).exp().sum()


def sample_batch(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[int]:
    """One token per row of logits [B, vocab]; row i uses params[i] and generators[i] only."""
    if all(p.greedy for p in params):
        return logits.argmax(-1).tolist()
    return [sample(row, p, g) for row, p, g in zip(logits, params, generators, strict=True)]


class StopChecker:
    """Decides when a request is finished and which text may be streamed so far.

    Stop and EOS tokens end the request without being emitted. A stop string ends it with the text cut just
    before the string, even when the string spans several tokens; text that could still become a stop string
    is held back until it cannot.
    """

    def __init__(
        self, params: SamplingParams, eos_token_ids: Sequence[int], tokenizer: Tokenizer | None = None
    ) -> None:
        if params.stop and tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer to see text; this model has none")
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self._pending = ""

    def push(self, token_id: int) -> str:
        """Record one generated token; return the text now safe to stream. Sets `finish_reason` when done."""
        if self.finish_reason is not None:
            raise RuntimeError("push() after the request finished")
        if token_id in self.stop_ids:
            return self._finish(FINISH_STOP, self._pending)
        self.token_ids.append(token_id)
        if self.decoder is not None:
            self._pending += self.decoder.push(token_id)
        cut = min((i for i in (self._pending.find(s) for s in self.params.stop) if i >= 0), default=-1)
        if cut >= 0:
            return self._finish(FINISH_STOP, self._pending[:cut])
        if len(self.token_ids) >= self.params.max_tokens:
            return self._finish(FINISH_LENGTH, self._pending)
        held = self._held_back(self._pending)
        ready, self._pending = (
            self._pending[: len(self._pending) - held],
            self._pending[len(self._pending) - held :],
        )
        self.text += ready
        return ready

    def _held_back(self, text: str) -> int:
        # Length of the longest tail of `text` that is the start of some stop string.
        for length in range(min(len(text), max((len(s) for s in self.params.stop), default=0)), 0, -1):
            if any(s.startswith(text[-length:]) for s in self.params.stop):
                return length
        return 0

    def _finish(self, reason: str, text: str) -> str:
        self.finish_reason = reason
        self._pending = ""
        self.text += text
        return text


def sampling_from_wire(msg: Any, default_max_tokens: int | None = None) -> SamplingParams:
    """Validated SamplingParams from the wire form (a pcpstack.v1.SamplingParams message).

    On the wire 0 means unset: top_p 0 is 1 (off), and max_tokens 0 takes default_max_tokens, or is refused
    when there is none. A ValueError names the field as `sampling.<name>`, as clients spell it.
    """
    if msg.max_tokens == 0 and default_max_tokens is None:
        raise ValueError("sampling.max_tokens=0 must be >= 1")
    try:
        return SamplingParams(
            max_tokens=msg.max_tokens or default_max_tokens,
            temperature=msg.temperature,
            top_k=msg.top_k,
            top_p=msg.top_p or 1.0,
            seed=msg.seed if msg.HasField("seed") else None,
            stop=list(msg.stop),
            stop_token_ids=list(msg.stop_token_ids),
            ignore_eos=msg.ignore_eos,
        ).validate()
    except ValueError as exc:
        raise ValueError(str(exc).replace("SamplingParams.", "sampling.")) from None
