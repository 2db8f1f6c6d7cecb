"""The one check of a prompt before any work is done on it: decode and prefill both call it.

A prompt is valid when it holds at least one token, every id is below the vocabulary size, it fits the
model's context (with room for `max_tokens` more when the caller will generate them), and its sampling
parameters are in range. A violation raises `InvalidArgument` naming the field, the value and the rule, so a
servicer answers INVALID_ARGUMENT without a line of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pcpstack.common.errors import InvalidArgument
from pcpstack.engine.sampling import SamplingParams, sampling_from_wire


@dataclass(frozen=True)
class PromptLimits:
    """What a model accepts: ids below `vocab_size`, at most `max_seq_len` tokens in prompt plus answer
    (`sliding_window`: the context is capped at the model's attention window)."""

    vocab_size: int
    max_seq_len: int
    sliding_window: int | None = None

    def context(self) -> str:
        """The context limit as the refusals name it."""
        if self.sliding_window is not None and self.sliding_window <= self.max_seq_len:
            return (
                f"the model context of {self.max_seq_len} tokens (its sliding attention window: attention "
                "past the window is not implemented, so longer contexts are refused)"
            )
        return f"the model context of {self.max_seq_len} tokens"


def check_token_ids(
    token_ids: Sequence[int], limits: PromptLimits, *, field: str = "token_ids", max_tokens: int = 0
) -> list[int]:
    """The ids as a list, or InvalidArgument naming `field` (or `sampling.max_tokens` when only the answer
    does not fit); `max_tokens` is the room the caller will generate into (0: prefill, the prompt alone)."""
    ids = list(token_ids)
    if not ids:
        raise InvalidArgument(f"{field}: the prompt is empty; it must hold at least one token")
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(
            f"{field}[{bad}]={ids[bad]} is not below the vocabulary size {limits.vocab_size}"
        )
    if len(ids) > limits.max_seq_len:
        raise InvalidArgument(f"{field}: {len(ids)} tokens exceed {limits.context()}")
    if len(ids) + max_tokens > limits.max_seq_len:
        raise InvalidArgument(
            f"sampling.max_tokens={max_tokens} with {len(ids)} prompt tokens exceeds {limits.context()}"
        )
    return ids


def check_logit_bias(params: SamplingParams, limits: PromptLimits) -> None:
    """InvalidArgument naming `sampling.logit_bias[id]` when a biased token id is not in the vocabulary
    (for parameters built in Python rather than read by check_sampling with a vocabulary size)."""
    bad = next((t for t in params.logit_bias if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(
            f"sampling.logit_bias[{bad}]={params.logit_bias[bad]!r}: ids must be in [0, vocabulary size "
            f"{limits.vocab_size})"
        )


def check_sampling(
    wire: Any, *, default_max_tokens: int | None = None, vocab_size: int | None = None
) -> SamplingParams:
    """Typed sampling parameters from a pcpstack.v1.SamplingParams message, or InvalidArgument naming the
    field (`sampling.<name>`) and its rule; `default_max_tokens` fills an unset max_tokens (None: it is
    required), and with `vocab_size` every logit_bias and stop_token_ids id must be below it.

    Ranges: temperature >= 0, top_k >= 0, top_p in (0, 1], presence and frequency penalties in [-2, 2],
    repetition_penalty > 0, logit_bias biases in [-100, 100], min_p in [0, 1], min_tokens <= max_tokens,
    logprobs in [0, 20]."""
    try:
        return sampling_from_wire(wire, default_max_tokens=default_max_tokens, vocab_size=vocab_size)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def check_prompt(
    token_ids: Sequence[int],
    sampling: Any,
    limits: PromptLimits,
    *,
    field: str = "token_ids",
    default_max_tokens: int | None = None,
    generates: bool = True,
) -> tuple[list[int], SamplingParams]:
    """The prompt's ids and typed sampling parameters, both checked; `generates` False (prefill, which
    samples one token) checks the prompt alone against the context, not prompt plus max_tokens."""
    params = check_sampling(sampling, default_max_tokens=default_max_tokens, vocab_size=limits.vocab_size)
    ids = check_token_ids(token_ids, limits, field=field, max_tokens=params.max_tokens if generates else 0)
    return ids, params
