"""Decode results become OpenAI responses and stream chunks: text, finish reasons, usage, logprobs."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from pcpstack.gateway.openai_requests import parse_chat, parse_completion
from pcpstack.gateway.openai_responses import ResponseShaper, sse, token_logprobs
from pcpstack.v1 import common_pb2, decode_pb2

MODEL = "m"
SUMMARY = decode_pb2.GenerateSummary(
    finish_reason=decode_pb2.FINISH_REASON_LENGTH, prompt_tokens=5, completion_tokens=2
)


def _deltas() -> list[decode_pb2.TokenDelta]:
    # The first token has no logprob: prefill sampled it.
    return [
        decode_pb2.TokenDelta(token_ids=[10], text="Hel"),
        decode_pb2.TokenDelta(token_ids=[11], text="lo", logprobs=[-0.5]),
    ]


def test_first_token_logprob_is_none_and_the_rest_align() -> None:
    delta = decode_pb2.TokenDelta(token_ids=[1, 2, 3], text="abc", logprobs=[-1.0, -2.0])
    assert [t.logprob for t in token_logprobs(delta)] == [None, -1.0, -2.0]


def test_completion_response_has_text_finish_reason_and_usage() -> None:
    shaper = ResponseShaper(parse_completion({"prompt": "x"}, MODEL), "cmpl-1", 100)
    for delta in _deltas():
        shaper.add(delta)
    body = shaper.response([SUMMARY])
    assert body["object"] == "text_completion" and body["id"] == "cmpl-1" and body["model"] == MODEL
    assert body["choices"] == [{"index": 0, "text": "Hello", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_logprobs_carry_tokens_and_text_offsets() -> None:
    shaper = ResponseShaper(parse_completion({"prompt": "x", "logprobs": 0}, MODEL), "c", 0)
    for delta in _deltas():
        shaper.add(delta)
    logprobs = shaper.response([SUMMARY])["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["Hel", "lo"]
    assert logprobs["token_logprobs"] == [None, -0.5]
    assert logprobs["text_offset"] == [0, 3]


def test_chat_response_is_an_assistant_message_with_logprobs() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True}
    shaper = ResponseShaper(parse_chat(body, MODEL), "chatcmpl-1", 0)
    for delta in _deltas():
        shaper.add(delta)
    choice = shaper.response([SUMMARY])["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello"}
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == [None, -0.5]
    assert choice["logprobs"]["content"][1]["bytes"] == list(b"lo")


def test_chat_stream_opens_with_the_role_and_closes_with_finish_reason_then_usage() -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    shaper = ResponseShaper(parse_chat(body, MODEL), "chatcmpl-1", 0)
    chunks = [*shaper.opening_chunks(), *(shaper.delta_chunk(d) for d in _deltas())]
    summary = decode_pb2.GenerateSummary(finish_reason=decode_pb2.FINISH_REASON_STOP, prompt_tokens=1)
    chunks += shaper.finish_chunks(summary) + shaper.usage_chunks([summary])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "Hello"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 1
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completion_stream_skips_deltas_that_add_no_text() -> None:
    shaper = ResponseShaper(parse_completion({"prompt": "x", "stream": True}, MODEL), "c", 0)
    assert shaper.opening_chunks() == []
    assert shaper.delta_chunk(decode_pb2.TokenDelta(token_ids=[3], text="")) is None
    chunk = shaper.delta_chunk(decode_pb2.TokenDelta(token_ids=[3], text="a"))
    assert chunk["choices"][0]["text"] == "a" and "usage" not in chunk


def test_sse_frames_one_json_event() -> None:
    frame = sse({"a": 1})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[6:]) == {"a": 1}


def _alternatives_delta() -> decode_pb2.TokenDelta:
    """Two tokens, each with its logprob and two alternatives (the first token's included, as decode
    reports them with sampling.logprobs)."""
    entries = [
        common_pb2.TokenLogprobs(
            chosen=common_pb2.TokenLogprob(token_id=10, logprob=-0.1, text="Hel"),
            top=[
                common_pb2.TokenLogprob(token_id=10, logprob=-0.1, text="Hel"),
                common_pb2.TokenLogprob(token_id=12, logprob=-2.5, text="Hi"),
            ],
        ),
        common_pb2.TokenLogprobs(
            chosen=common_pb2.TokenLogprob(token_id=11, logprob=-0.7, text="lo"),
            top=[
                common_pb2.TokenLogprob(token_id=13, logprob=-0.6, text="p"),
                common_pb2.TokenLogprob(token_id=11, logprob=-0.7, text="lo"),
            ],
        ),
    ]
    return decode_pb2.TokenDelta(
        token_ids=[10, 11], text="Hello", logprobs=[-0.1, -0.7], token_logprobs=entries
    )


def test_chat_top_logprobs_validate_as_openai_types_with_the_first_token_included() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}
    shaper = ResponseShaper(parse_chat(body, MODEL), "chatcmpl-1", 0)
    shaper.add(_alternatives_delta())
    response = ChatCompletion.model_validate(shaper.response([SUMMARY]))
    content = response.choices[0].logprobs.content
    assert [t.logprob for t in content] == pytest.approx([-0.1, -0.7])
    assert [[a.token for a in t.top_logprobs] for t in content] == [["Hel", "Hi"], ["p", "lo"]]


def test_chat_logprob_bytes_are_the_tokens_own_bytes_when_decode_sends_them() -> None:
    # Two tokens of one character: each alone decodes to U+FFFD, only their bytes tell them apart.
    def token(token_id: int, logprob: float, raw: bytes) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(token_id=token_id, logprob=logprob, text="\ufffd", token_bytes=raw)

    entries = [
        common_pb2.TokenLogprobs(chosen=token(1, -0.1, b"\xe4\xb8"), top=[token(1, -0.1, b"\xe4\xb8")]),
        common_pb2.TokenLogprobs(chosen=token(2, -0.2, b"\x96"), top=[token(2, -0.2, b"\x96")]),
    ]
    delta = decode_pb2.TokenDelta(
        token_ids=[1, 2], text="\u4e16", logprobs=[-0.1, -0.2], token_logprobs=entries
    )
    body = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1}
    shaper = ResponseShaper(parse_chat(body, MODEL), "chatcmpl-1", 0)
    shaper.add(delta)
    content = ChatCompletion.model_validate(shaper.response([SUMMARY])).choices[0].logprobs.content
    assert [t.bytes for t in content] == [[0xE4, 0xB8], [0x96]]
    assert [t.top_logprobs[0].bytes for t in content] == [[0xE4, 0xB8], [0x96]]
    assert b"".join(bytes(t.bytes) for t in content).decode() == "\u4e16"


def test_completion_top_logprobs_map_each_token_to_its_alternatives() -> None:
    shaper = ResponseShaper(parse_completion({"prompt": "x", "logprobs": 2}, MODEL), "c", 0)
    shaper.add(_alternatives_delta())
    logprobs = Completion.model_validate(shaper.response([SUMMARY])).choices[0].logprobs
    assert logprobs.tokens == ["Hel", "lo"] and logprobs.text_offset == [0, 3]
    assert logprobs.token_logprobs == pytest.approx([-0.1, -0.7])
    assert logprobs.top_logprobs[1] == pytest.approx({"p": -0.6, "lo": -0.7})


def test_completion_top_logprobs_always_hold_the_sampled_token() -> None:
    # A sampled token outside the most likely one (temperature, logit_bias): OpenAI's top_logprobs still
    # hold it, so up to logprobs + 1 entries.
    entry = common_pb2.TokenLogprobs(
        chosen=common_pb2.TokenLogprob(token_id=11, logprob=-3.0, text="lo"),
        top=[common_pb2.TokenLogprob(token_id=13, logprob=-0.6, text="p")],
    )
    delta = decode_pb2.TokenDelta(token_ids=[11], text="lo", logprobs=[-3.0], token_logprobs=[entry])
    shaper = ResponseShaper(parse_completion({"prompt": "x", "logprobs": 1}, MODEL), "c", 0)
    shaper.add(delta)
    logprobs = Completion.model_validate(shaper.response([SUMMARY])).choices[0].logprobs
    assert logprobs.top_logprobs == [pytest.approx({"p": -0.6, "lo": -3.0})]


def test_n_choices_are_indexed_and_usage_counts_the_prompt_once() -> None:
    shaper = ResponseShaper(parse_completion({"prompt": "x", "n": 2}, MODEL), "c", 0)
    shaper.add(decode_pb2.TokenDelta(token_ids=[1], text="a"), 0)
    shaper.add(decode_pb2.TokenDelta(token_ids=[2], text="b"), 1)
    length, stop = decode_pb2.FINISH_REASON_LENGTH, decode_pb2.FINISH_REASON_STOP
    summaries = [
        decode_pb2.GenerateSummary(finish_reason=length, prompt_tokens=5, completion_tokens=1),
        decode_pb2.GenerateSummary(finish_reason=stop, prompt_tokens=5, completion_tokens=3),
    ]
    response = Completion.model_validate(shaper.response(summaries))
    choices = [(c.index, c.text, c.finish_reason) for c in response.choices]
    assert choices == [(0, "a", "length"), (1, "b", "stop")]
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (5, 4)


def test_a_stop_string_is_shown_only_when_include_stop_str_in_output() -> None:
    summary = decode_pb2.GenerateSummary(finish_reason=decode_pb2.FINISH_REASON_STOP, matched_stop="END")
    for include, text in ((True, "abcEND"), (False, "abc")):
        body = {"prompt": "x", "stop": ["END"], "include_stop_str_in_output": include, "stream": True}
        shaper = ResponseShaper(parse_completion(body, MODEL), "c", 0)
        delta = decode_pb2.TokenDelta(token_ids=[1], text="abc")
        chunks = [shaper.delta_chunk(delta), *shaper.finish_chunks(summary)]
        assert "".join(c["choices"][0]["text"] for c in chunks) == text


def test_the_stop_string_decode_held_back_is_found_in_the_text_of_its_tokens() -> None:
    summary = decode_pb2.GenerateSummary(finish_reason=decode_pb2.FINISH_REASON_STOP)
    body = {"prompt": "x", "stop": ["<END>", "END"], "include_stop_str_in_output": True}
    texts = {1: "ab", 2: "<E", 3: "ND>"}
    shaper = ResponseShaper(parse_completion(body, MODEL), "c", 0, lambda ids: "".join(texts[i] for i in ids))
    shaper.add(decode_pb2.TokenDelta(token_ids=[1], text="ab"))
    shaper.add(decode_pb2.TokenDelta(token_ids=[2, 3], text=""))
    assert shaper.response([summary])["choices"][0]["text"] == "ab<END>"


def test_with_special_tokens_kept_the_text_is_written_from_the_token_ids() -> None:
    texts = {1: "Hi", 2: "<|im_end|>"}
    shaper = ResponseShaper(
        parse_chat({"messages": [{"role": "user", "content": "x"}], "skip_special_tokens": False}, MODEL),
        "c",
        0,
        special_text=lambda: texts.__getitem__,
    )
    shaper.add(decode_pb2.TokenDelta(token_ids=[1, 2], text="Hi"))
    assert shaper.response([SUMMARY])["choices"][0]["message"]["content"] == "Hi<|im_end|>"
