"""OpenAI request bodies become the right GenerateRequest with OpenAI's defaults; bad input is a 400 naming
the parameter."""

from __future__ import annotations

import pytest

from pcpstack.gateway.errors import ApiError
from pcpstack.gateway.openai_requests import (
    CHAT_DEFAULT_MAX_TOKENS,
    COMPLETION_DEFAULT_MAX_TOKENS,
    MAX_JSON_DEPTH,
    MAX_PROMPT_CHARS,
    load_body,
    parse_chat,
    parse_completion,
)
from pcpstack.gateway.openai_responses import usage
from pcpstack.v1 import decode_pb2

MODEL = "SmolLM2-135M-Instruct"
USER = [{"role": "user", "content": "x"}]


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
    # A default, so decode may cut it to the room the prompt leaves in the context; one the client gives, not.
    assert request.fit_max_tokens
    assert not parse_chat({**body, "max_tokens": 5}, MODEL).to_generate_request("r").fit_max_tokens
    assert not parse_chat({**body, "max_completion_tokens": 5}, MODEL).to_generate_request("r").fit_max_tokens
    assert parse_completion({"prompt": "x"}, MODEL).to_generate_request("r").fit_max_tokens
    assert (
        not parse_completion({"prompt": "x", "max_tokens": 3}, MODEL).to_generate_request("r").fit_max_tokens
    )
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
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "n": 129}, "n"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [["a"]]}, "prompt"),
        ({"prompt": [[[1]]]}, "prompt"),
        ({"prompt": [[1, "a"]]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "echo": 0}, "echo"),
        ({"prompt": "x", "best_of": True}, "best_of"),
        ({"prompt": "x", "best_of": 1.0}, "best_of"),
        ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"word": 1}}, "logit_bias"),
        ({"prompt": "x", "skip_special_tokens": False, "stop": "."}, "skip_special_tokens"),
        ({"prompt": "x", "suffix": "tail"}, "suffix"),
        ({"prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
        ({"prompt": "x", "no_such_parameter": 1}, "no_such_parameter"),
        ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
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
        ({"messages": USER, "temperature": 1e308}, "temperature"),
        ({"messages": USER, "repetition_penalty": 1e39}, "repetition_penalty"),
        ({"messages": USER, "top_p": 1e-46}, "top_p"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages"),
        ({"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages"),
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


def test_penalties_bias_min_p_and_min_tokens_reach_the_wire() -> None:
    body = {
        "prompt": "x",
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.3,
        "logit_bias": {"7": -100, "9": 2.5},
        "min_p": 0.1,
        "min_tokens": 3,
    }
    sampling = parse_completion(body, MODEL).to_generate_request("r").sampling
    assert sampling.presence_penalty == 0.5 and sampling.frequency_penalty == -0.25
    assert sampling.repetition_penalty == pytest.approx(1.3)
    assert dict(sampling.logit_bias) == {7: -100.0, 9: 2.5}
    assert sampling.min_p == pytest.approx(0.1) and sampling.min_tokens == 3


def test_logprob_alternatives_are_asked_of_decode() -> None:
    completion = parse_completion({"prompt": "x", "logprobs": 3}, MODEL).to_generate_request("r")
    assert completion.logprobs and completion.sampling.logprobs == 3
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}
    chat = parse_chat(body, MODEL).to_generate_request("r")
    assert chat.logprobs and chat.sampling.logprobs == 2
    plain = parse_completion({"prompt": "x"}, MODEL).to_generate_request("r")
    assert not plain.logprobs and not plain.sampling.HasField("logprobs")


def test_sample_i_of_a_seeded_request_uses_seed_plus_i() -> None:
    parsed = parse_completion({"prompt": "x", "n": 3, "seed": 41}, MODEL)
    assert parsed.n == 3
    assert [parsed.to_generate_request("r", i).sampling.seed for i in range(3)] == [41, 42, 43]
    unseeded = parse_completion({"prompt": "x", "n": 2}, MODEL).to_generate_request("r", 1)
    assert not unseeded.sampling.HasField("seed")


def test_unsupported_parameters_holding_their_unused_value_are_accepted() -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "user": "someone",
    }
    assert parse_chat(body, MODEL).prompt == [{"role": "user", "content": "x"}]
    assert parse_completion({"prompt": "x", "echo": False, "best_of": 1}, MODEL).prompt == "x"


def test_a_refused_parameter_is_named_in_the_message() -> None:
    error = _refused(parse_chat, {"messages": [{"role": "user", "content": "x"}], "tools": [{"a": 1}]})
    assert error.message.startswith("tools=") and "not supported" in error.message
    error = _refused(parse_completion, {"prompt": "x", "frobnicate": True})
    assert "frobnicate" in error.message
    error = _refused(parse_completion, {"prompt": "x", "stop_token_ids": [1, -2]})
    assert error.param == "stop_token_ids" and "stop_token_ids[1]=-2" in error.message


def test_cache_salt_reaches_the_request_and_cached_tokens_come_back_in_the_usage() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "cache_salt": "tenant-a"}
    assert parse_chat(body, MODEL).to_generate_request("r").cache_salt == "tenant-a"
    assert parse_chat({**body, "cache_salt": None}, MODEL).to_generate_request("r").cache_salt == ""
    summary = decode_pb2.GenerateSummary(prompt_tokens=300, completion_tokens=2, cached_prompt_tokens=256)
    assert usage([summary]).prompt_tokens_details.cached_tokens == 256


def test_a_default_max_tokens_is_raised_to_min_tokens() -> None:
    chat = parse_chat({"messages": USER, "min_tokens": 300}, MODEL).to_generate_request("r")
    assert (chat.sampling.max_tokens, chat.sampling.min_tokens) == (300, 300) and chat.fit_max_tokens
    completion = parse_completion({"prompt": "x", "min_tokens": 20}, MODEL)
    assert completion.max_tokens == 20 and not completion.max_tokens_given
    # A max_tokens the client gives is theirs: decode refuses it if it is below min_tokens.
    assert parse_completion({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, MODEL).max_tokens == 5


def test_an_echoed_bad_value_is_clipped_to_a_short_prefix() -> None:
    error = _refused(parse_completion, {"prompt": "a", "max_tokens": "a" * 10_000_000})
    assert error.param == "max_tokens" and len(error.message) < 300
    assert "(10000002 characters)" in error.message and "valid integer" in error.message
    error = _refused(parse_completion, {"prompt": "a", "tools": ["t" * 1_000_000]})
    assert error.param == "tools" and len(error.message) < 300


@pytest.mark.parametrize(
    ("parse", "body", "words"),
    [
        (parse_completion, {"prompt": [-1]}, "prompt[0]=-1: input should be greater than or equal to 0"),
        (parse_completion, {"prompt": [1, 2**32]}, "prompt[1]=4294967296: input should be less than"),
        (
            parse_chat,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}]},
            "messages[0].content[0].extra is not supported",
        ),
        (
            parse_chat,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text=5: input should be a valid string",
        ),
    ],
)
def test_a_union_error_states_the_rule_of_the_branch_the_value_took(parse, body: dict, words: str) -> None:
    error = _refused(parse, body)
    assert error.status == 400 and words in error.message


@pytest.mark.parametrize("key", ["\u00b2", "\uff11", "-1", "1.5", "1" * 11])
def test_a_logit_bias_key_that_is_not_ascii_digits_is_refused_by_the_rule(key: str) -> None:
    error = _refused(parse_completion, {"prompt": "x", "logit_bias": {key: 1}})
    assert error.param == "logit_bias" and "must be token ids" in error.message


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (parse_completion, {"prompt": "a" * (MAX_PROMPT_CHARS + 1)}, "prompt"),
        (parse_completion, {"prompt": ["a" * (MAX_PROMPT_CHARS + 1)]}, "prompt"),
        (
            parse_chat,
            {
                "messages": [
                    {"role": "system", "content": "a" * (MAX_PROMPT_CHARS // 2)},
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a" * (MAX_PROMPT_CHARS // 2 + 1)}],
                    },
                ]
            },
            "messages",
        ),
    ],
)
def test_prompt_text_longer_than_any_context_holds_is_refused(parse, body: dict, param: str) -> None:
    error = _refused(parse, body)
    assert (error.status, error.param) == (400, param)
    assert f"at most {MAX_PROMPT_CHARS}" in error.message and str(MAX_PROMPT_CHARS + 1) in error.message
    fits = {"prompt": "a" * MAX_PROMPT_CHARS} if parse is parse_completion else {"messages": USER}
    assert parse(fits, MODEL).stream is False
