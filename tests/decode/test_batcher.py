"""The continuous-batching loop: batched results equal solo runs; cancellation and admission free blocks."""

from __future__ import annotations

import threading

import pytest
import torch

from pcpstack.common.errors import ResourceExhausted
from pcpstack.decode.batcher import Batcher, DecodeRequest, TokenEvent, accept_token
from pcpstack.engine.engine import Engine
from pcpstack.engine.sampling import SamplingParams, StopChecker, make_generator, sample


@pytest.fixture(scope="module")
def prefill_engine() -> Engine:
    return Engine.load("tiny")


class Collector:
    """Gathers a request's events and signals when it ended."""

    def __init__(self) -> None:
        self.events: list[TokenEvent] = []
        self.done = threading.Event()

    def __call__(self, event: TokenEvent) -> None:
        self.events.append(event)
        if event.finish_reason or event.error:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if e.token_id is not None]

    @property
    def finish(self) -> str | None:
        return self.events[-1].finish_reason if self.events else None


def prefilled(engine: Engine, prompt: list[int], params: SamplingParams) -> tuple[torch.Tensor, int]:
    """What the prefill service hands over: the prompt's KV replica and the first sampled token."""
    logits = engine.prefill("p", prompt)
    kv = engine.export_sequence("p").clone()
    engine.free("p")
    return kv, sample(logits, params, make_generator(params.seed))


def request(engine: Engine, seq_id: str, prompt: list[int], params: SamplingParams, sink: Collector):
    """What the servicer submits: the replica, and a checker that has taken (and streamed) the first token."""
    kv, first = prefilled(engine, prompt, params)
    checker = StopChecker(params, engine.args.eos_token_ids, engine.tokenizer)
    event = accept_token(checker, first, None)
    if event is not None:
        sink(event)
    return DecodeRequest(seq_id, kv, len(prompt), checker, params, sink)


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (3, 17, 40, 9, 64)]


def test_batched_decode_equals_each_request_alone(prefill_engine: Engine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batcher = Batcher(Engine.load("tiny", num_blocks=64), max_batch=3)  # 5 requests, batch of 3: rotation
    try:
        sinks = [Collector() for _ in prompts(prefill_engine.args.vocab_size)]
        for i, (prompt, sink) in enumerate(zip(prompts(prefill_engine.args.vocab_size), sinks, strict=True)):
            batcher.submit(request(prefill_engine, f"r{i}", prompt, params, sink))
        for sink in sinks:
            assert sink.done.wait(60)
        for prompt, sink in zip(prompts(prefill_engine.args.vocab_size), sinks, strict=True):
            alone = prefill_engine.generate(prompt, params)
            assert sink.tokens == alone.token_ids
            assert sink.finish == "length"
        assert batcher.engine.allocator.num_free == 64
    finally:
        batcher.close()


def test_seeded_sampling_is_independent_of_batch_mates(prefill_engine: Engine) -> None:
    prompt = prompts(prefill_engine.args.vocab_size)[1]
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    runs = []
    for mates in (0, 3):
        batcher = Batcher(Engine.load("tiny", num_blocks=64))
        try:
            sink = Collector()
            for m in range(mates):
                batcher.submit(
                    request(
                        prefill_engine,
                        f"m{m}",
                        prompts(prefill_engine.args.vocab_size)[m],
                        other,
                        Collector(),
                    )
                )
            batcher.submit(request(prefill_engine, "seeded", prompt, seeded, sink))
            assert sink.done.wait(60)
            runs.append(sink.tokens)
        finally:
            batcher.close()
    assert runs[0] == runs[1] and len(runs[0]) == 10


def test_cancel_frees_blocks_and_ends_the_stream(prefill_engine: Engine) -> None:
    batcher = Batcher(Engine.load("tiny", num_blocks=64))
    try:
        sink = Collector()
        params = SamplingParams(max_tokens=10_000 // 16, temperature=0, ignore_eos=True)
        batcher.submit(
            request(prefill_engine, "long", prompts(prefill_engine.args.vocab_size)[2], params, sink)
        )
        while len(sink.tokens) < 3:
            assert not sink.done.wait(0.01)
        batcher.cancel("long")
        assert sink.done.wait(10)
        assert sink.finish == "cancelled"
        assert batcher.engine.allocator.num_free == 64
    finally:
        batcher.close()


def test_request_waits_for_blocks_instead_of_failing_midway(prefill_engine: Engine) -> None:
    # 8 blocks of 16 tokens: each request needs ceil((40 + 60) / 16) = 7 blocks, so only one fits at a time.
    batcher = Batcher(Engine.load("tiny", num_blocks=8))
    try:
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        sinks = [Collector(), Collector()]
        for i, sink in enumerate(sinks):
            batcher.submit(
                request(prefill_engine, f"r{i}", prompts(prefill_engine.args.vocab_size)[2], params, sink)
            )
        for sink in sinks:
            assert sink.done.wait(60)
            assert sink.finish == "length" and len(sink.tokens) == 60
        assert sinks[0].tokens == sinks[1].tokens
    finally:
        batcher.close()


def test_request_larger_than_the_cache_is_refused_with_a_reason(prefill_engine: Engine) -> None:
    batcher = Batcher(Engine.load("tiny", num_blocks=2))
    try:
        sink = Collector()
        params = SamplingParams(max_tokens=100, temperature=0)
        batcher.submit(
            request(prefill_engine, "big", prompts(prefill_engine.args.vocab_size)[2], params, sink)
        )
        assert sink.done.wait(10)
        assert isinstance(sink.events[-1].error, ResourceExhausted)
        assert "KV blocks" in str(sink.events[-1].error)
    finally:
        batcher.close()
