"""OpenAI request bodies become the right GenerateRequest with OpenAI's defaults; bad input is a 400 naming
the parameter."""

from __future__ import annotations

import pytest

from pcpstack.gateway.errors import ApiError
from pcpstack.gateway.openai_requests import (
    CHAT_DEFAULT_MAX_TOKENS,
    COMPLETION_DEFAULT_MAX_TOKENS,
    MAX_JSON_DEPTH,
    load_body,
    parse_chat,
    parse_completion,
)

MODEL = "SmolLM2-135M-Instruct"


def _refused(parse, body: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, MODEL)
    return caught.value


def test_completion_defaults_follow_openai() -> None:
    request = parse_completion({"model": MODEL, "prompt": "Hi"}, MODEL).to_generate_request("r1")
    assert request.text == "Hi"
    assert request.request_id == "r1"
    assert request.model == MODEL
    assert request.sampling.max_tokens == COMPLETION_DEFAULT_MAX_TOKENS
    assert request.sampling.temperature == 1.0
    assert request.sampling.top_p == 1.0
    assert not request.sampling.HasField("seed")
    assert not request.logprobs


def test_chat_defaults_to_its_own_max_tokens_and_maps_messages() -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}],
            },
        ],
    }
    request = parse_chat(body, MODEL).to_generate_request("r")
    assert request.sampling.max_tokens == CHAT_DEFAULT_MAX_TOKENS
    assert [(m.role, m.content) for m in request.chat.messages] == [
        ("system", "Be brief."),
        ("user", "Hello there"),
    ]


def test_sampling_parameters_reach_the_request() -> None:
    body = {
        "prompt": [1, 2, 3],
        "max_tokens": 7,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 40,
        "seed": 9,
        "stop": "\n",
        "stop_token_ids": [2],
        "ignore_eos": True,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parsed = parse_completion(body, MODEL)
    request = parsed.to_generate_request("r")
    assert list(request.token_ids.ids) == [1, 2, 3]
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (7, 0.0, 0.5, 40)
    assert sampling.seed == 9
    assert list(sampling.stop) == ["\n"]
    assert list(sampling.stop_token_ids) == [2]
    assert sampling.ignore_eos and request.logprobs
    assert parsed.stream and parsed.include_usage


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 9}
    assert parse_chat(body, MODEL).max_tokens == 9


def test_vllm_top_k_minus_one_disables_top_k() -> None:
    assert parse_completion({"prompt": "x", "top_k": -1}, MODEL).top_k == 0


def test_batch_of_one_prompt_is_unwrapped() -> None:
    assert parse_completion({"prompt": ["only"]}, MODEL).prompt == "only"
    assert parse_completion({"prompt": [[5, 6]]}, MODEL).prompt == [5, 6]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"prompt": "x", "logprobs": 2}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ],
)
def test_bad_completion_input_is_a_400_naming_the_parameter(body: dict, param: str) -> None:
    error = _refused(parse_completion, body)
    assert (error.status, error.param, error.error_type) == (400, param, "invalid_request_error")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_bad_chat_input_is_a_400_naming_the_parameter(body: dict, param: str) -> None:
    error = _refused(parse_chat, body)
    assert (error.status, error.param) == (400, param)


def test_another_model_is_a_404() -> None:
    error = _refused(parse_completion, {"model": "gpt-4", "prompt": "x"})
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")


def test_a_body_that_is_not_an_object_is_a_400() -> None:
    with pytest.raises(ApiError) as caught:
        parse_completion(["prompt"], MODEL)
    assert caught.value.status == 400


def test_a_body_nested_exactly_to_the_limit_loads_and_one_more_level_is_refused() -> None:
    def nested(depth: int) -> bytes:
        return b"[" * depth + b"]" * depth

    assert load_body(nested(MAX_JSON_DEPTH)) is not None
    with pytest.raises(ApiError) as caught:
        load_body(nested(MAX_JSON_DEPTH + 1))
    assert caught.value.param == "body" and str(MAX_JSON_DEPTH) in caught.value.message


def test_a_lone_surrogate_in_a_key_is_refused_as_the_body() -> None:
    with pytest.raises(ApiError) as caught:
        load_body(b'{"\\ud800": 1}')
    assert caught.value.param == "body" and "lone surrogate" in caught.value.message


def test_an_unknown_charset_is_a_400_naming_it() -> None:
    with pytest.raises(ApiError) as caught:
        load_body(b"{}", "no-such-charset")
    assert caught.value.status == 400 and "no-such-charset" in caught.value.message
