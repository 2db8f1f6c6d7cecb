"""Penalties, logit_bias and log-probabilities through the whole path: a Generate call over real gRPC to a
decode servicer whose PCP=2 prefill set (tiny model) samples the first token in its own processes. The
tokens and every log-probability, the first token's included, equal a direct computation on the engine
alone, with the penalties written out here as their documented formulas."""

from __future__ import annotations

import grpc
import pytest
import torch

from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.engine.engine import Engine
from pcpstack.engine.sampling import SamplingParams
from pcpstack.v1 import decode_pb2
from tests.decode.support import greedy, prompt
from tests.decode.test_server import generate, serving

PRESENCE, FREQUENCY, REPETITION, TOP = 0.5, 0.8, 1.3, 5
MAX_TOKENS = 10


def _penalised(logits: torch.Tensor, prompt_ids: list[int], output: list[int], bias: dict[int, float]):
    """HF's repetition penalty over prompt and output, then OpenAI's penalties over output, plus the bias
    (vLLM's order: bias, repetition, frequency and presence), token by token."""
    out = logits.double().clone()
    for token, value in bias.items():
        out[token] += value
    for token in set(prompt_ids) | set(output):
        out[token] = out[token] * REPETITION if out[token] < 0 else out[token] / REPETITION
    for token in set(output):
        out[token] -= FREQUENCY * output.count(token) + PRESENCE
    return out


def _expected(engine: Engine, ids: list[int], bias: dict[int, float]):
    """Greedy tokens under the penalties and, per token, the raw log-probability and the top ids."""
    seq_id = object()
    tokens, logprobs, tops = [], [], []
    try:
        logits = engine.prefill(seq_id, ids)
        for _ in range(MAX_TOKENS):
            token = int(_penalised(logits.cpu(), ids, tokens, bias).argmax())
            raw = torch.log_softmax(logits.double().cpu(), -1)
            tokens.append(token)
            logprobs.append(float(raw[token]))
            tops.append(raw.topk(TOP).indices.tolist())
            logits = engine.decode_step([seq_id], [token])[0]
    finally:
        engine.free(seq_id)
    return tokens, logprobs, tops


async def _deltas(address: str, request: decode_pb2.GenerateRequest) -> list[decode_pb2.TokenDelta]:
    client = DecodeClient(address)
    try:
        return [m.delta async for m in client.stream(request, timeout=60) if m.HasField("delta")]
    finally:
        await client.close()


@pytest.mark.slow
def test_penalties_bias_and_logprobs_through_the_stack_equal_the_engine_alone(stack, reference) -> None:
    ids = list(prompt(30, seed=4))
    plain = reference.generate(ids, greedy(MAX_TOKENS))
    bias = {plain.token_ids[1]: -7.5, 17: 3.0}
    tokens, logprobs, tops = _expected(reference, ids, bias)
    assert tokens != plain.token_ids  # the options change this answer, so the comparison has teeth
    request = build_request(ids, max_tokens=MAX_TOKENS, ignore_eos=True)
    sampling = request.sampling
    sampling.presence_penalty, sampling.frequency_penalty = PRESENCE, FREQUENCY
    sampling.repetition_penalty, sampling.logprobs = REPETITION, TOP
    sampling.logit_bias.update(bias)
    with serving(stack) as address:
        deltas = stack.run(_deltas(address, request))
    got = [d for d in deltas if d.token_ids]
    assert [t for d in got for t in d.token_ids] == tokens
    entries = [e for d in got for e in d.token_logprobs]
    assert len(entries) == MAX_TOKENS  # the first token (sampled by prefill) carries its own too
    assert [e.chosen.token_id for e in entries] == tokens
    assert [e.chosen.logprob for e in entries] == pytest.approx(logprobs, abs=1e-4)
    assert [d.logprobs[0] for d in got] == pytest.approx(logprobs, abs=1e-4)
    assert [[t.token_id for t in e.top] for e in entries] == tops
    assert all(e.top[0].logprob >= e.top[-1].logprob for e in entries)


@pytest.mark.slow
def test_seeded_sampling_through_the_stack_equals_the_engine_alone(stack, reference) -> None:
    """Prefill samples the first token and decode the rest, from one random stream as the engine alone
    does: a fresh generator in decode would draw its first token with the first token's random numbers."""
    ids = list(prompt(20, seed=8))
    with serving(stack) as address:
        for seed in (1, 2, 3, 4):
            options = {"max_tokens": 8, "temperature": 1.5, "top_k": 40, "seed": seed, "ignore_eos": True}
            expected = reference.generate(ids, SamplingParams(**options)).token_ids
            assert stack.run(generate(address, build_request(ids, **options))).token_ids == expected, seed


@pytest.mark.slow
def test_logprobs_flag_alone_gives_each_token_its_logprob_without_alternatives(stack, reference) -> None:
    ids = list(prompt(12, seed=5))
    with serving(stack) as address:
        deltas = stack.run(_deltas(address, build_request(ids, max_tokens=3, ignore_eos=True, logprobs=True)))
    entries = [e for d in deltas for e in d.token_logprobs]
    assert [e.chosen.token_id for e in entries] == reference.generate(ids, greedy(3)).token_ids
    assert len(entries) == 3 and all(not e.top for e in entries)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("logit_bias", {10_000_000: 1.0}, "sampling.logit_bias[10000000]=1.0: ids must be in [0, vocab"),
        ("presence_penalty", 3.0, "sampling.presence_penalty=3.0 must be in [-2, 2]"),
        ("min_tokens", 9, "sampling.min_tokens=9 must be in [0, max_tokens]"),
        ("logprobs", 25, "sampling.logprobs=25 must be in [0, 20]"),
    ],
)
def test_out_of_range_sampling_is_invalid_argument_naming_field_and_rule(stack, field, value, needle) -> None:
    request = build_request([1, 2, 3], max_tokens=4)
    if isinstance(value, dict):
        getattr(request.sampling, field).update(value)
    else:
        setattr(request.sampling, field, value)
    with serving(stack) as address, pytest.raises(grpc.aio.AioRpcError) as caught:
        stack.run(_deltas(address, request))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in caught.value.details()


async def _summary(address: str, request: decode_pb2.GenerateRequest) -> decode_pb2.GenerateSummary:
    client = DecodeClient(address)
    try:
        return [m.summary async for m in client.stream(request, timeout=60) if m.HasField("summary")][-1]
    finally:
        await client.close()


@pytest.mark.slow
def test_the_summary_names_the_stop_token_that_ended_generation(stack, reference) -> None:
    ids = list(prompt(12, seed=6))
    plain = reference.generate(ids, greedy(8)).token_ids
    # the first token that did not come before: generation stops there, after `at` tokens
    at = next(i for i in range(1, len(plain)) if plain[i] not in plain[:i])
    request = build_request(ids, max_tokens=8, ignore_eos=True)
    request.sampling.stop_token_ids.append(plain[at])
    with serving(stack) as address:
        summary = stack.run(_summary(address, request))
    assert summary.finish_reason == decode_pb2.FINISH_REASON_STOP
    assert summary.completion_tokens == at
    assert summary.matched_stop == reference.tokenizer.token_text(plain[at])
