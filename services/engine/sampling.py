"""Per-request sampling (greedy, temperature, top-k, top-p, min-p, penalties, logit bias, seed), token
log-probabilities and stop conditions.

Logits are processed in vLLM's order: min_tokens masks the stop tokens, logit_bias is added, the repetition
penalty (Hugging Face semantics, over prompt and generated tokens) and the frequency and presence penalties
(OpenAI semantics, over generated tokens only) are applied; then greedy takes the argmax, or temperature,
min-p, top-k and top-p shape the distribution that is drawn from. A request without any of these options
takes exactly the path it took before they existed (greedy is a bare argmax of the model's logits).
Log-probabilities are always those of the model's raw distribution (log-softmax of the unprocessed logits).

Each request owns a torch.Generator seeded from its seed, and rows are sampled one request at a time, so a
request's tokens never depend on which other requests share its batch.

Sampling is numerically safe for every value validation accepts: a temperature below MIN_TEMPERATURE is
greedy (dividing by it would overflow the logits to inf), probabilities come from a max-shifted softmax in
float32, and when no finite probability is left (NaN logits, everything masked) the best token is taken.
"""

import math
import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# SamplingParams lives in sampling_params (no torch there); importers of this module get it here too.
from pcpstack.engine.sampling_params import MAX_LOGPROBS as MAX_LOGPROBS
from pcpstack.engine.sampling_params import SamplingParams as SamplingParams
from pcpstack.engine.tokenizer import IncrementalDecoder, Tokenizer

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded from `seed`, or from the OS when unset."""
    return torch.Generator().manual_seed(
        seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    )


def skip_draw(generator: torch.Generator, vocab_size: int) -> None:
    """Advances `generator` past one draw of `sample` over `vocab_size` tokens: torch's multinomial takes
    as many random numbers as the distribution has entries, whatever their values."""
    torch.multinomial(torch.ones(vocab_size), 1, generator=generator)


def generator_after_first_token(params: SamplingParams, vocab_size: int) -> torch.Generator:
    """Decode's generator for a request whose first token prefill sampled from make_generator(seed): the
    same stream, past that token's draw. A fresh generator would repeat the draw (a seeded request's first
    two tokens would come from one random number); this way its tokens equal the engine alone's."""
    generator = make_generator(params.seed)
    if params.seed is not None and not params.greedy:
        skip_draw(generator, vocab_size)
    return generator


@dataclass(frozen=True)
class TokenHistory:
    """What the logits processors of one request look at: its prompt, the tokens it generated so far, and
    the tokens that would end it (masked while fewer than min_tokens were generated)."""

    prompt_ids: Sequence[int] = ()
    output_ids: Sequence[int] = ()
    stop_ids: Collection[int] = ()


def stop_token_set(params: SamplingParams, eos_token_ids: Sequence[int]) -> set[int]:
    """The token ids that end a request: its stop_token_ids, and the model's EOS unless ignore_eos."""
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def process_logits(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """Logits [vocab] (float32, on the CPU) after min_tokens, logit_bias and the three penalties.

    The repetition penalty follows Hugging Face's RepetitionPenaltyLogitsProcessor (each distinct token of
    prompt and output once: a positive logit divided by it, a negative one multiplied); the frequency and
    presence penalties follow OpenAI (logit -= frequency * count + presence * (count > 0), generated tokens).
    """
    logits = logits.float().cpu().clone()
    vocab = logits.numel()
    if len(history.output_ids) < params.min_tokens:
        stops = [t for t in history.stop_ids if 0 <= t < vocab]
        if stops:
            logits[torch.tensor(stops, dtype=torch.long)] = -math.inf
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        logits.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=torch.float32))
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([*history.prompt_ids, *history.output_ids], dtype=torch.long).unique()
        if seen.numel():
            score = logits[seen]
            logits[seen] = torch.where(
                score < 0, score * params.repetition_penalty, score / params.repetition_penalty
            )
    if (params.frequency_penalty or params.presence_penalty) and len(history.output_ids):
        counts = torch.bincount(torch.tensor(list(history.output_ids), dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].float()
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    history: TokenHistory | None = None,
) -> int:
    """One token id from logits [vocab] under `params`, drawing randomness only from `generator`;
    `history` feeds the penalties and min_tokens (none given: an empty one, as for a first token without
    a prompt)."""
    if params.processes_logits:
        logits = process_logits(logits, params, history or TokenHistory())
    if params.greedy:
        return int(logits.argmax())
    # NaN is never a candidate; +inf would make the shifted softmax NaN, so it caps at the float32 max.
    logits = logits.float().cpu().nan_to_num(nan=-math.inf, posinf=torch.finfo(torch.float32).max)
    best = int(logits.argmax())
    logits = logits / params.temperature
    if params.min_p > 0:
        # Relative to the best token after temperature, as vLLM's min-p; the best token always stays.
        probs = _softmax(logits)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), -math.inf)
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
        skip_draw(generator, probs.numel())  # every sample takes one draw: the stream stays aligned
        return best  # nothing left to draw from (every logit NaN or -inf)
    return int(torch.multinomial(probs, 1, generator=generator))


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    """softmax shifted by the largest finite logit; all zeros (never NaN) when no logit is finite."""
    top = logits.max()
    if not bool(torch.isfinite(top)):
        return torch.zeros_like(logits)
    return (logits - top).exp() / (logits - top).exp().sum()


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    histories: Sequence[TokenHistory] | None = None,
) -> list[int]:
    """One token per row of logits [B, vocab]; row i uses params[i], generators[i] and histories[i] only."""
    if all(p.greedy and not p.processes_logits for p in params):
        return logits.argmax(-1).tolist()
    histories = histories if histories is not None else [TokenHistory()] * len(params)
    return [sample(row, p, g, h) for row, p, g, h in zip(logits, params, generators, histories, strict=True)]


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's raw log-probability and the `top` most likely tokens, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """The model's raw log-probabilities: log-softmax of unprocessed logits in float32 (any shape)."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logprobs: torch.Tensor, token_id: int, top: int) -> TokenLogprobs:
    """The log-probability of `token_id` in logprobs [vocab] and the `top` most likely tokens (equal
    log-probabilities: the lower id first)."""
    logprobs = logprobs.float().cpu()
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, logprobs.numel())
        # Every token at least as likely as the k-th, then an exact (log-probability, id) order.
        kth = torch.topk(logprobs, k).values[-1]
        candidates = (logprobs >= kth).nonzero().flatten().tolist()
        ranked = sorted(candidates, key=lambda t: (-float(logprobs[t]), t))[:k]
        alternatives = tuple((t, float(logprobs[t])) for t in ranked)
    return TokenLogprobs(token_id, float(logprobs[token_id]), alternatives)


class StopChecker:
    """Decides when a request is finished and which text may be streamed so far.

    Stop and EOS tokens end the request without being emitted. A stop string ends it with the text cut just
    before the string, even when the string spans several tokens; text that could still become a stop string
    is held back until it cannot. `matched_stop` names what ended it: the stop string, or the stop token's
    surface form (e.g. "<|im_end|>"; empty without a tokenizer).
    """

    def __init__(
        self, params: SamplingParams, eos_token_ids: Sequence[int], tokenizer: Tokenizer | None = None
    ) -> None:
        if params.stop and tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer to see text; this model has none")
        self.params = params
        self.stop_ids = stop_token_set(params, eos_token_ids)
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.matched_stop = ""
        self._tokenizer = tokenizer
        self._pending = ""

    def push(self, token_id: int) -> str:
        """Record one generated token; return the text now safe to stream. Sets `finish_reason` when done."""
        if self.finish_reason is not None:
            raise RuntimeError("push() after the request finished")
        if token_id in self.stop_ids:
            if self._tokenizer is not None:
                self.matched_stop = self._tokenizer.token_text(token_id) or ""
            return self._finish(FINISH_STOP, self._pending)
        self.token_ids.append(token_id)
        if self.decoder is not None:
            self._pending += self.decoder.push(token_id)
        if len(self.token_ids) < self.params.min_tokens:
            # Before min_tokens no stop string may end the request (vLLM's rule): the text goes out as is,
            # so an occurrence in it is never found later either.
            ready, self._pending = self._pending, ""
            self.text += ready
            return ready
        # The earliest occurrence wins; of two starting there, the longer one (it holds the other).
        found = [(i, -len(s), s) for s in self.params.stop if (i := self._pending.find(s)) >= 0]
        if found:
            cut, _, self.matched_stop = min(found)
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


def sampling_from_wire(
    msg: Any, default_max_tokens: int | None = None, vocab_size: int | None = None
) -> SamplingParams:
    """Validated SamplingParams from the wire form (a pcpstack.v1.SamplingParams message).

    On the wire 0 means unset: top_p 0 and repetition_penalty 0 are 1 (off), and max_tokens 0 takes
    default_max_tokens, or is refused when there is none. With `vocab_size`, logit_bias and stop_token_ids
    ids are checked against it. A ValueError names the field as `sampling.<name>`, as clients spell it.
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
            presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            repetition_penalty=msg.repetition_penalty or 1.0,
            logit_bias=dict(msg.logit_bias),
            min_p=msg.min_p,
            min_tokens=msg.min_tokens,
            logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        ).validate(vocab_size)
    except ValueError as exc:
        raise ValueError(str(exc).replace("SamplingParams.", "sampling.")) from None


def sampling_to_wire(params: SamplingParams, wire: Any) -> Any:
    """Fills `wire` (an empty pcpstack.v1.SamplingParams message) from parsed parameters; returns it.
    sampling_from_wire reads the result back to equal parameters."""
    wire.max_tokens = params.max_tokens
    wire.temperature = params.temperature
    wire.top_k = params.top_k
    wire.top_p = params.top_p
    wire.stop.extend(params.stop)
    wire.stop_token_ids.extend(params.stop_token_ids)
    wire.ignore_eos = params.ignore_eos
    wire.presence_penalty = params.presence_penalty
    wire.frequency_penalty = params.frequency_penalty
    wire.repetition_penalty = params.repetition_penalty
    wire.logit_bias.update(params.logit_bias)
    wire.min_p = params.min_p
    wire.min_tokens = params.min_tokens
    if params.seed is not None:
        wire.seed = params.seed
    if params.logprobs is not None:
        wire.logprobs = params.logprobs
    return wire
