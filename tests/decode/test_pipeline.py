"""Decode's request path without gRPC on its own side: the pipeline in this process, driving a real registry,
KV store and PCP=2 prefill set (tiny model) in their own processes.

Answers equal the engine alone; bad requests are refused before any peer works; the store object is released
exactly once whether the request ends, fails or is cancelled (while the set prefills, as its answer arrives,
or while the replica loads); only a failure of the set takes it out of routing, never an error of one request.
"""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing

import pytest

from pcpstack.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, ServiceError
from pcpstack.common.ids import MAX_REQUEST_ID_CHARS
from pcpstack.common.ports import free_port
from pcpstack.decode.batcher import Batcher
from pcpstack.decode.pipeline import (
    ChatMessage,
    ChatPrompt,
    DecodeSettings,
    GenerateInput,
    GeneratePipeline,
    TextPrompt,
    TokenPrompt,
)
from pcpstack.decode.router import SetRouter
from pcpstack.engine.engine import Engine
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.kvstore.store import DEFAULT_MAX_LEASE_MS
from pcpstack.registry.endpoints import PrefillEndpoint, Resolution
from pcpstack.registry.resolver import Resolver
from tests.decode.support import (
    BLOCK_SIZE,
    TOO_BIG_FOR_THE_STORE,
    answer,
    bytes_stored,
    close_pipeline,
    greedy,
    make_pipeline,
    prefills_answered,
    prompt,
)
from tests.helpers import pinned_bytes


@pytest.mark.slow
def test_greedy_answer_equals_the_engine_alone_and_releases_the_replica(stack, pipeline, reference) -> None:
    ids = prompt(40)
    deltas, summary = stack.run(answer(pipeline, GenerateInput(TokenPrompt(ids), greedy(12))))
    expected = reference.generate(list(ids), greedy(12)).token_ids
    assert [d.token_id for d in deltas] == expected
    assert summary.finish_reason == "length" and summary.completion_tokens == 12
    assert summary.prompt_token_ids == list(ids)
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0


@pytest.mark.slow
def test_same_request_id_twice_at_once_gets_two_answers(stack, pipeline, reference) -> None:
    # Batch sequences are per attempt, not per caller id: two callers sharing an id do not collide.
    async def both():
        return await asyncio.gather(
            *(answer(pipeline, GenerateInput(TokenPrompt(prompt(30, s)), greedy(6), "same")) for s in (1, 2))
        )

    for seed, (deltas, summary) in zip((1, 2), stack.run(both()), strict=True):
        assert [d.token_id for d in deltas] == reference.generate(list(prompt(30, seed)), greedy(6)).token_ids
        assert summary.request_id == "same"


@pytest.mark.slow
def test_empty_request_id_gets_a_generated_one(stack, pipeline) -> None:
    _, summary = stack.run(answer(pipeline, GenerateInput(TokenPrompt(prompt(5)), greedy(2))))
    assert len(summary.request_id) == 32


@pytest.mark.slow
@pytest.mark.parametrize(
    ("request_id", "needle"),
    [("x" * (MAX_REQUEST_ID_CHARS + 1), f"at most {MAX_REQUEST_ID_CHARS}"), ("bad\nid", "printable ASCII")],
)
def test_bad_request_id_is_refused_at_the_edge_naming_the_rule(stack, pipeline, request_id, needle) -> None:
    stored = stack.run(bytes_stored(stack.stack.kvstore_address))
    with pytest.raises(InvalidArgument, match="request_id") as info:
        stack.run(answer(pipeline, GenerateInput(TokenPrompt(prompt(5)), greedy(2), request_id)))
    assert needle in str(info.value)
    assert stack.run(bytes_stored(stack.stack.kvstore_address)) == stored  # no prefill ran


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ids", "sampling", "needle"),
    [
        ((), greedy(2), "token_ids.ids: the prompt is empty"),
        ((1, 999), greedy(2), "token_ids.ids[1]=999 is not below the vocabulary size 320"),
        (prompt(10), greedy(4090), "sampling.max_tokens=4090 with 10 prompt tokens"),
    ],
)
def test_bad_prompt_is_refused_before_any_peer_works(stack, pipeline, ids, sampling, needle) -> None:
    with pytest.raises(InvalidArgument) as info:
        stack.run(answer(pipeline, GenerateInput(TokenPrompt(ids), sampling)))
    assert needle in str(info.value)
    assert pipeline.prefills_in_flight == 0


@pytest.mark.slow
def test_a_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(
    stack, pipeline, monkeypatch
) -> None:
    # ten megabytes once took the worker's loop for ten seconds, and its registry session with it
    longest = max(
        len(pipeline.engine.tokenizer.token_bytes(t)) for t in range(pipeline.engine.tokenizer.vocab_size)
    )
    text = "a" * (pipeline.engine.args.max_seq_len * longest + 1)

    def no_encoding(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(pipeline.engine.tokenizer, "encode", no_encoding)
    with pytest.raises(InvalidArgument, match=f"text: {len(text)} characters cannot fit the context"):
        stack.run(answer(pipeline, GenerateInput(TextPrompt(text), greedy(2))))
    chat = ChatPrompt((ChatMessage("system", text[:10]), ChatMessage("user", text)))
    with pytest.raises(InvalidArgument, match=f"chat: {len(text) + 10} characters cannot fit"):
        stack.run(answer(pipeline, GenerateInput(chat, greedy(2))))
    assert pipeline.prefills_in_flight == 0


@pytest.mark.slow
def test_first_token_that_ends_the_request_releases_without_a_fetch(stack, pipeline) -> None:
    deltas, summary = stack.run(answer(pipeline, GenerateInput(TokenPrompt(prompt(20)), greedy(1))))
    assert len(deltas) == 1 and summary.finish_reason == "length"
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0


@pytest.mark.slow
def test_cancel_while_the_set_prefills_leaves_nothing_pinned(stack, pipeline) -> None:
    async def cancel_during_prefill() -> None:
        request = GenerateInput(TokenPrompt(prompt(1500)), greedy(50))
        task = asyncio.ensure_future(answer(pipeline, request))
        while pipeline.prefills_in_flight == 0:
            assert not task.done()
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    stack.run(cancel_during_prefill())
    # The Prefill call is cancelled with its caller: the set drops the job if it still queued, or deletes
    # its replica after the forward (tests/prefill/test_abandoned_jobs.py); either way nothing stays pinned.
    assert stack.run(prefills_answered(pipeline))
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0


class CancelsAsTheSetAnswers(SetRouter):
    """A set router that cancels the request's task at the instant its set's answer arrives, before the
    request has seen it: the window in which a replica used to stay pinned until its lease."""

    victim: asyncio.Task | None = None

    def finished(self, *targets: str) -> None:
        super().finished(*targets)
        if self.victim is not None:
            self.victim.cancel()


@pytest.mark.slow
def test_cancel_as_the_set_answers_leaves_nothing_pinned(stack) -> None:
    pipeline, resolver = make_pipeline(stack, CancelsAsTheSetAnswers)

    async def cancel_as_answered() -> None:
        task = asyncio.ensure_future(answer(pipeline, GenerateInput(TokenPrompt(prompt(200)), greedy(20))))
        pipeline.router.victim = task
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        stored = stack.run(bytes_stored(stack.stack.kvstore_address))
        stack.run(cancel_as_answered())
        assert stack.run(bytes_stored(stack.stack.kvstore_address)) > stored
        assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0
    finally:
        close_pipeline(stack, pipeline, resolver)


@pytest.mark.slow
def test_cancel_while_the_replica_loads_leaves_nothing_pinned(stack, pipeline) -> None:
    async def leave_after_first_token() -> tuple[int | None, int]:
        request = GenerateInput(TokenPrompt(prompt(1000)), greedy(50))
        async with aclosing(pipeline.generate(request)) as events:
            first = await anext(events)
        # Closed right after the first token, while the replica's fetch had only just started: by the time
        # the close returns, the release is done (asked once, no waiting).
        async with KvStoreClient(stack.stack.kvstore_address) as store:
            return first.token_id, (await store.stat()).pinned_bytes

    first, pinned = stack.run(leave_after_first_token())
    assert first is not None
    assert pinned == 0
    assert pipeline.batcher.queue_depth == 0


async def _bytes_in(store_address: str) -> int:
    async with KvStoreClient(store_address) as store:
        return (await store.stat()).bytes_in


@pytest.mark.slow
def test_a_request_the_cache_can_never_hold_is_refused_before_any_prefill(stack) -> None:
    # One KV block of 128 tokens on this worker: 100 prompt tokens plus 50 more can never be admitted, so
    # no prefill set spends a forward on them (none pushes a replica to the store).
    pipeline, resolver = make_pipeline(stack, num_blocks=1)
    store = stack.stack.kvstore_address
    try:
        before = stack.run(_bytes_in(store))
        refusal = r"100 tokens plus max_tokens=50 need 2 KV blocks .* cache has 1"
        with pytest.raises(ResourceExhausted, match=refusal):
            stack.run(answer(pipeline, GenerateInput(TokenPrompt(prompt(100)), greedy(50))))
        assert stack.run(_bytes_in(store)) == before
        assert stack.run(pinned_bytes(store)) == 0
        # The same 50 as a default (no max_tokens from the client) is cut to what the cache leaves: 28.
        fitted = GenerateInput(TokenPrompt(prompt(100)), greedy(50), fit_max_tokens=True)
        assert pipeline.validate(fitted)[1].sampling.max_tokens == BLOCK_SIZE - 100
    finally:
        close_pipeline(stack, pipeline, resolver)


def test_a_default_max_tokens_is_cut_to_the_room_the_prompt_leaves(pipeline) -> None:
    # The tiny model's context holds 4096 tokens; a client that gave no max_tokens gets what room there is.
    room = pipeline.engine.args.max_seq_len - 4090
    near_the_end = GenerateInput(TokenPrompt(prompt(4090)), greedy(16), fit_max_tokens=True)
    ids, fitted = pipeline.validate(near_the_end)
    assert len(ids) == 4090 and fitted.sampling.max_tokens == room
    # A max_tokens the client asked for is never changed: it is refused, naming it.
    with pytest.raises(InvalidArgument, match=r"sampling.max_tokens=16 with 4090 prompt tokens exceeds"):
        pipeline.validate(dataclasses.replace(near_the_end, fit_max_tokens=False))
    # One that already fits is kept; a prompt that fills the context, or a min_tokens over the room, refused.
    assert pipeline.validate(GenerateInput(TokenPrompt(prompt(40)), greedy(16), fit_max_tokens=True))[1] == (
        GenerateInput(TokenPrompt(prompt(40)), greedy(16), fit_max_tokens=True)
    )
    with pytest.raises(InvalidArgument, match=r"sampling.max_tokens=16 with 4096 prompt tokens"):
        pipeline.validate(GenerateInput(TokenPrompt(prompt(4096)), greedy(16), fit_max_tokens=True))
    with pytest.raises(InvalidArgument, match=r"sampling.min_tokens=10: the prompt's 4090 tokens leave room"):
        pipeline.validate(dataclasses.replace(near_the_end, sampling=greedy(16, min_tokens=10)))


@pytest.mark.slow
def test_request_level_failure_leaves_the_set_routable(stack, pipeline) -> None:
    # The store refuses this request's replica (it cannot fit): an error of the request, not of the set.
    with pytest.raises(ServiceError) as info:
        stack.run(answer(pipeline, GenerateInput(TokenPrompt(prompt(TOO_BIG_FOR_THE_STORE)), greedy(1))))
    assert info.value.code == "RESOURCE_EXHAUSTED", info.value
    # The router's view never refreshes here, so a set it had dropped would stay dropped.
    _, summary = stack.run(answer(pipeline, GenerateInput(TokenPrompt(prompt(10)), greedy(2))))
    assert summary.completion_tokens == 2


@pytest.mark.slow
def test_a_kv_lease_over_the_stores_cap_fails_as_this_workers_setting_not_the_clients(
    stack, pipeline
) -> None:
    # The request's kv_lease_ms is the worker's --kv-lease-ms: the set refuses it, and the client can change
    # nothing (FAILED_PRECONDITION naming the flag, not INVALID_ARGUMENT).
    lease = DEFAULT_MAX_LEASE_MS + 1
    pipeline.settings = dataclasses.replace(pipeline.settings, kv_lease_ms=lease)
    with pytest.raises(FailedPrecondition) as info:
        stack.run(answer(pipeline, GenerateInput(TokenPrompt(prompt(10)), greedy(2))))
    assert str(info.value).startswith(f"this decode worker's --kv-lease-ms={lease} is too long")
    assert f"cap of {DEFAULT_MAX_LEASE_MS} ms" in str(info.value)


@pytest.mark.slow
def test_unreachable_set_is_dropped_and_the_request_retried_on_another(stack, reference) -> None:
    engine = Engine.load("tiny", block_size=BLOCK_SIZE)
    resolver = Resolver(stack.stack.registry_address)

    routing: list[Resolution] = []

    async def with_a_dead_set() -> Resolution:
        # One answer for the whole test (as a resolver between refreshes): the live set and, less loaded,
        # a set whose address nobody listens on.
        if not routing:
            found = await resolver.resolve()
            live = dataclasses.replace(found.prefill_sets[0], load=5)
            nowhere = f"127.0.0.1:{free_port()}"
            dead = PrefillEndpoint("dead-set", 1, nowhere, 2, 0, live.kv_fingerprint, "tiny")
            routing.append(dataclasses.replace(found, prefill_sets=(dead, live)))
        return routing[0]

    router = SetRouter(with_a_dead_set, engine.layout.fingerprint())
    settings = DecodeSettings(model_name="tiny", kv_fingerprint=engine.layout.fingerprint())
    pipeline = GeneratePipeline(engine, Batcher(engine), router, settings)

    async def twice() -> tuple[list[list[int]], str]:
        answers = [await answer(pipeline, GenerateInput(TokenPrompt(prompt(8)), greedy(3))) for _ in range(2)]
        chosen = await router.choose()
        return [[d.token_id for d in deltas] for deltas, _ in answers], chosen.set_id

    try:
        answers, chosen = stack.run(twice())
        expected = reference.generate(list(prompt(8)), greedy(3)).token_ids
        assert answers == [expected, expected]
        assert chosen != "dead-set"
    finally:
        close_pipeline(stack, pipeline, resolver)
