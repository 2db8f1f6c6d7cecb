"""The gateway in front of a real SmolLM2 stack, driven by the real `openai` client, sync and streaming.

A streamed greedy answer equals the non-streamed one, usage is counted, bad input is a 400 in the OpenAI
shape, a stack without a ready prefill set gives 503, and the caller's trace continues into decode.
"""

from __future__ import annotations

import secrets

import openai
import pytest

from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.kvstore.prefix import PREFIX_BLOCK_TOKENS
from tests.gateway.conftest import http_get, spans_of_trace

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The history of the printing press"
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def assert_same_usage_the_second_time_from_the_cache(second, first) -> None:
    """The second run of a prompt counts the same tokens as the first, and takes the prompt's full 16-token
    prefix blocks (all but the last token) from the KV store, which the first run stored."""
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(second, c) for c in counts] == [getattr(first, c) for c in counts]
    expected = (first.prompt_tokens - 1) // PREFIX_BLOCK_TOKENS * PREFIX_BLOCK_TOKENS
    assert second.prompt_tokens_details.cached_tokens == expected


async def _generate(address: str, request):
    client = DecodeClient(address)
    try:
        return await client.generate(request, timeout=120)
    finally:
        await client.close()


def test_streamed_completion_equals_the_non_streamed_one_for_greedy(gateway) -> None:
    client = gateway.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text and streamed == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == []
    assert_same_usage_the_second_time_from_the_cache(chunks[-1].usage, whole.usage)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_streamed_chat_equals_the_non_streamed_one_for_greedy(gateway) -> None:
    client = gateway.client()
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content and streamed == message.content
    assert "Paris" in message.content
    assert_same_usage_the_second_time_from_the_cache(chunks[-1].usage, whole.usage)


def test_usage_counts_prompt_and_completion_tokens(gateway) -> None:
    whole = gateway.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6
    assert whole.usage.prompt_tokens == 6  # "The history of the printing press" in SmolLM2's tokenizer
    assert whole.usage.total_tokens == 12


def test_a_token_id_prompt_answers_like_its_text(gateway, traced_stack) -> None:
    stack, _ = traced_stack
    reference = stack.run(_generate(stack.decode, build_request(PROMPT, max_tokens=1)))
    ids = list(reference.summary.prompt_token_ids)
    client = gateway.client()
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_a_stop_string_ends_the_answer_without_itself(gateway) -> None:
    answer = gateway.client().completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=" 7"
    )
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == " 5, 6,"


def test_logprobs_come_for_every_token_the_first_included(gateway) -> None:
    client = gateway.client()
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    values = [t.logprob for t in chat.choices[0].logprobs.content]
    assert len(values) == 5 and all(v is not None and v <= 0 for v in values)
    completion = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0
    )
    assert len(completion.choices[0].logprobs.token_logprobs) == 4


@pytest.mark.parametrize(
    ("arguments", "param"),
    [({"temperature": -1}, "temperature"), ({"n": 0}, "n"), ({"max_tokens": 100_000}, "max_tokens")],
)
def test_bad_input_is_a_400_naming_the_parameter(gateway, arguments: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.client().completions.create(model=MODEL, prompt=PROMPT, **arguments)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param and caught.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_a_404(gateway) -> None:
    with pytest.raises(openai.NotFoundError):
        gateway.client().chat.completions.create(model="gpt-4o", messages=MESSAGES)


def test_models_health_and_metrics(gateway) -> None:
    assert [m.id for m in gateway.client().models.list()] == [MODEL]
    status, body = http_get(f"{gateway.url}/health")
    assert status == 200 and '"status": "ok"' in body
    status, body = http_get(f"{gateway.url}/metrics")
    assert status == 200
    assert 'pcpstack:gateway_requests_total{endpoint="/v1/completions",status="200"}' in body
    assert "pcpstack:gateway_time_to_first_token_seconds_count" in body
    assert 'pcpstack:gateway_tokens_total{kind="completion"}' in body


def test_the_callers_trace_continues_through_the_gateway_into_decode(gateway, traced_stack) -> None:
    _, trace_file = traced_stack
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    raw = gateway.client().completions.with_raw_response.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0,
        extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    assert raw.headers["X-Trace-Id"] == trace_id
    spans = spans_of_trace(trace_file, trace_id, {"gateway", "decode", "prefill"})
    gateway_span = next(s for s in spans if s["service"] == "gateway" and s["kind"] == "SERVER")
    assert gateway_span["parent_span_id"] == parent_id
    assert {"gateway", "decode", "prefill"} <= {s["service"] for s in spans}


def test_no_ready_prefill_set_is_a_503(gateway_without_prefill) -> None:
    client = gateway_without_prefill.client()
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model="tiny", prompt="hello", max_tokens=4)
    assert caught.value.status_code == 503
    assert caught.value.body["type"] == "service_unavailable"
    assert "prefill" in caught.value.body["message"]
    with pytest.raises(openai.InternalServerError) as caught:
        list(client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True))
    assert caught.value.status_code == 503
