"""The gateway's API surface through real processes (a tiny-model stack with two decode workers, and a gateway
whose first decode address is dead): the API key, CORS, /tokenize, /detokenize, /version, n samples, the
sampling parameters it passes on, and how it spreads requests over decode workers.

Every answer is checked against the `openai` package's types (model_validate on the raw JSON).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tests.gateway.conftest import ALLOWED_ORIGIN, API_KEY, GatewayProcess, http_get

pytestmark = pytest.mark.slow
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hello there"}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# The tiny model's byte tokenizer: token id b is the byte b.
A = ord("A")


def _call(
    gateway: GatewayProcess,
    path: str,
    body: dict | None = None,
    headers: dict[str, str] | None = None,
    method: str | None = None,
) -> tuple[int, dict, dict[str, str]]:
    """Status, JSON body ({} when empty) and headers of one request."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"{gateway.url}{path}",
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            raw, status, got = answer.read(), answer.status, dict(answer.headers)
    except urllib.error.HTTPError as exc:
        raw, status, got = exc.read(), exc.code, dict(exc.headers)
    return status, json.loads(raw) if raw else {}, got


def _completion(gateway: GatewayProcess, **body) -> Completion:
    status, answer, _ = _call(gateway, "/v1/completions", {"model": MODEL, **body}, AUTH)
    assert status == 200, answer
    return Completion.model_validate(answer)


def _chat(gateway: GatewayProcess, **body) -> ChatCompletion:
    status, answer, _ = _call(gateway, "/v1/chat/completions", {"model": MODEL, **body}, AUTH)
    assert status == 200, answer
    return ChatCompletion.model_validate(answer)


# --- the API key, CORS, /version ----------------------------------------------------------------------------


def test_a_request_without_the_api_key_is_a_401_in_the_openai_shape(guarded_gateway) -> None:
    status, body, headers = _call(guarded_gateway, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    assert body["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in body["error"]["message"]
    assert _call(guarded_gateway, "/tokenize", {"prompt": "hi"})[0] == 401
    with pytest.raises(openai.AuthenticationError):
        guarded_gateway.client("not-the-key").models.list()
    assert [m.id for m in guarded_gateway.client(API_KEY).models.list()] == [MODEL]


def test_health_metrics_and_version_answer_without_the_api_key(guarded_gateway) -> None:
    for path in ("/health", "/metrics", "/version"):
        assert http_get(f"{guarded_gateway.url}{path}")[0] == 200, path
    version = json.loads(http_get(f"{guarded_gateway.url}/version")[1])
    assert set(version) == {"version"} and version["version"]


def test_a_cors_preflight_from_the_allowed_origin_is_answered_and_another_origin_gets_no_cors_headers(
    guarded_gateway,
) -> None:
    preflight = {
        "Origin": ALLOWED_ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    status, _, headers = _call(guarded_gateway, "/v1/chat/completions", headers=preflight, method="OPTIONS")
    assert status == 204 and headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "Authorization" in headers["Access-Control-Allow-Headers"]
    status, _, headers = _call(guarded_gateway, "/v1/models", headers={**AUTH, "Origin": ALLOWED_ORIGIN})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    status, _, headers = _call(
        guarded_gateway, "/v1/models", headers={**AUTH, "Origin": "http://evil.example"}
    )
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


# --- /tokenize and /detokenize ------------------------------------------------------------------------------


def test_tokenize_counts_a_prompt_as_decode_does_and_detokenize_reverses_it(guarded_gateway) -> None:
    prompt = "Hello, tokens!"
    status, answer, _ = _call(guarded_gateway, "/tokenize", {"model": MODEL, "prompt": prompt}, AUTH)
    assert status == 200 and answer["tokens"] == list(prompt.encode())  # one byte per token
    assert answer["count"] == len(prompt) and answer["max_model_len"] > 0 and answer["token_strs"] is None
    usage = _completion(guarded_gateway, prompt=prompt, max_tokens=1).usage
    assert usage.prompt_tokens == answer["count"]
    status, back, _ = _call(guarded_gateway, "/detokenize", {"tokens": answer["tokens"]}, AUTH)
    assert status == 200 and back == {"prompt": prompt}


def test_tokenize_renders_chat_messages_with_the_template_as_a_chat_completion_counts_them(
    guarded_gateway,
) -> None:
    status, answer, _ = _call(guarded_gateway, "/tokenize", {"messages": MESSAGES}, AUTH)
    assert status == 200
    assert answer["count"] == _chat(guarded_gateway, messages=MESSAGES, max_tokens=1).usage.prompt_tokens


def test_tokenize_gives_each_tokens_string_when_asked(guarded_gateway) -> None:
    body = {"prompt": "ab", "return_token_strs": True}
    status, answer, _ = _call(guarded_gateway, "/tokenize", body, AUTH)
    assert status == 200 and answer["token_strs"] == ["a", "b"]


def test_bad_tokenize_and_detokenize_bodies_are_400s_naming_the_field(guarded_gateway) -> None:
    status, body, _ = _call(guarded_gateway, "/tokenize", {"prompt": 3}, AUTH)
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body, _ = _call(guarded_gateway, "/detokenize", {"tokens": [1, 10**6]}, AUTH)
    assert status == 400 and body["error"]["param"] == "tokens"


# --- n samples ----------------------------------------------------------------------------------------------


def test_n_seeded_samples_differ_and_come_back_the_same_each_time(guarded_gateway) -> None:
    request = {"messages": MESSAGES, "n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 12}
    request["ignore_eos"] = True
    first = _chat(guarded_gateway, **request)
    again = _chat(guarded_gateway, **request)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in again.choices] == texts
    assert len(set(texts)) > 1
    alone = _chat(guarded_gateway, **{**request, "n": 1})
    assert alone.choices[0].message.content == texts[0]  # sample 0 uses the seed itself
    # The prompt is counted once, the completions of all three samples.
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (alone.usage.prompt_tokens, 36)


def test_streamed_samples_arrive_under_their_indices(guarded_gateway) -> None:
    request = {"prompt": "abc", "n": 2, "seed": 5, "temperature": 1.0, "max_tokens": 8}
    whole = _completion(guarded_gateway, **request)
    stream = guarded_gateway.client(API_KEY).completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **request
    )
    texts = ["", ""]
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    assert chunks[-1].usage == whole.usage


# --- sampling parameters passed on --------------------------------------------------------------------------


def test_logit_bias_forces_a_token(guarded_gateway) -> None:
    completion = _completion(
        guarded_gateway, prompt="xyz", max_tokens=5, temperature=0, logit_bias={str(A): 100}
    )
    assert completion.choices[0].text == "AAAAA"


def test_min_tokens_holds_back_a_stop_token(guarded_gateway) -> None:
    forced = {"prompt": "xyz", "max_tokens": 10, "temperature": 0, "logit_bias": {str(A): 100}}
    at_once = _completion(guarded_gateway, stop_token_ids=[A], **forced)
    later = _completion(guarded_gateway, stop_token_ids=[A], min_tokens=4, **forced)
    assert at_once.choices[0].finish_reason == later.choices[0].finish_reason == "stop"
    # Four tokens other than the stop token came first (however decode counts the stop token itself).
    assert later.usage.completion_tokens == at_once.usage.completion_tokens + 4
    assert "A" not in later.choices[0].text


def test_include_stop_str_in_output_shows_the_stop_string(guarded_gateway) -> None:
    forced = {"prompt": "xyz", "max_tokens": 10, "temperature": 0, "logit_bias": {str(A): 100}}
    forced["stop"] = ["AA"]
    hidden = _completion(guarded_gateway, **forced).choices[0]
    shown = _completion(guarded_gateway, include_stop_str_in_output=True, **forced).choices[0]
    assert (hidden.text, hidden.finish_reason) == ("", "stop")
    assert (shown.text, shown.finish_reason) == ("AA", "stop")


def test_min_p_of_one_keeps_only_the_most_likely_token(guarded_gateway) -> None:
    greedy = _completion(guarded_gateway, prompt="abc", max_tokens=12, temperature=0)
    sampled = _completion(guarded_gateway, prompt="abc", max_tokens=12, temperature=1.0, seed=3, min_p=1.0)
    assert sampled.choices[0].text == greedy.choices[0].text


@pytest.mark.parametrize("penalty", [{"frequency_penalty": -2.0}, {"repetition_penalty": 0.01}])
def test_a_penalty_favouring_repeats_makes_the_answer_repeat_one_token(guarded_gateway, penalty) -> None:
    completion = _completion(
        guarded_gateway, prompt="abc", max_tokens=40, temperature=0, ignore_eos=True, logprobs=0, **penalty
    )
    tokens = completion.choices[0].logprobs.tokens
    assert len(tokens) == 40 and len(set(tokens[-10:])) == 1


def test_logprobs_carry_alternatives_for_every_token_the_first_included(guarded_gateway) -> None:
    chat = _chat(
        guarded_gateway, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(t.logprob is not None and t.logprob <= 0 and len(t.top_logprobs) == 3 for t in content)
    # Greedy picks the most likely token, so it leads its alternatives.
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    completion = _completion(guarded_gateway, prompt="abc", max_tokens=3, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert None not in logprobs.token_logprobs and [len(t) for t in logprobs.top_logprobs] == [2, 2, 2]


# --- spreading requests over decode workers -----------------------------------------------------------------


def _decode_requests(tiny_stack) -> list[float]:
    """Generate requests each decode worker has counted (its Prometheus counter)."""
    counts = []
    for service in tiny_stack.stack.services:
        if service.name.startswith("decode"):
            text = http_get(service.metrics_url)[1]
            counts.append(
                sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("pcpstack:decode_requests_total")
                )
            )
    return counts


def test_idle_workers_take_requests_in_turn_and_a_dead_one_is_passed_over(
    guarded_gateway, tiny_stack
) -> None:
    before = _decode_requests(tiny_stack)
    for _ in range(4):
        assert _completion(guarded_gateway, prompt="abc", max_tokens=2).choices[0].finish_reason
    after = _decode_requests(tiny_stack)
    assert [b - a for a, b in zip(before, after, strict=True)] == [2, 2]


def test_skip_special_tokens_false_shows_the_special_tokens_generated(guarded_gateway) -> None:
    im_start = 257  # the tiny tokenizer's specials follow the 256 bytes: <|endoftext|>, <|im_start|>, ...
    forced = {"prompt": "xyz", "max_tokens": 3, "temperature": 0, "logit_bias": {str(im_start): 100}}
    assert _completion(guarded_gateway, **forced).choices[0].text == ""
    shown = _completion(guarded_gateway, skip_special_tokens=False, **forced)
    assert shown.choices[0].text == "<|im_start|>" * 3
    stream = guarded_gateway.client(API_KEY).completions.create(
        model=MODEL, stream=True, extra_body={"skip_special_tokens": False}, **forced
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == "<|im_start|>" * 3


def _in_flight(gateway: GatewayProcess) -> int:
    return sum(json.loads(http_get(f"{gateway.url}/health")[1])["in_flight"].values())


def test_a_client_that_hangs_up_ends_every_decode_call_of_its_request(guarded_gateway) -> None:
    stream = guarded_gateway.client(API_KEY).completions.create(
        model=MODEL,
        prompt="abc",
        max_tokens=4000,
        n=2,
        logprobs=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    # The client reads no more: megabytes of chunks (alternatives make them large) fill the socket buffers,
    # and flow control holds both calls before they could end.
    assert _in_flight(guarded_gateway) == 2
    stream.close()
    deadline = time.monotonic() + 30
    while _in_flight(guarded_gateway) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_flight(guarded_gateway) == 0
