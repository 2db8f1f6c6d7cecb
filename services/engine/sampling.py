"""Per-request sampling (greedy, temperature, top-k, top-p, seed) and stop conditions.

Each request owns a torch.Generator seeded from its seed, and rows are sampled one request at a time, so a
request's tokens never depend on which other requests share its batch.
"""

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pcpstack.engine.tokenizer import IncrementalDecoder, Tokenizer

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


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
        """Whether the most likely token is always taken."""
        return self.temperature == 0


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded from `seed`, or from the OS when unset."""
    return torch.Generator().manual_seed(
        seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    )


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from logits [vocab] under `params`, drawing randomness only from `generator`."""
    if params.greedy:
        return int(logits.argmax())
    logits = logits.float().cpu() / params.temperature
    if 0 < params.top_k < logits.numel():
        kth_best = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth_best, -math.inf)
    if params.top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the best token always stays.
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p
        logits = logits.index_fill(0, order[drop], -math.inf)
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


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
