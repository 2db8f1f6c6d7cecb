"""A real gateway process given input that is legal on the wire but not a usable request: a lone UTF-16
surrogate, a bad X-Request-Id, JSON nested deep enough to exhaust the parser's stack. Each is a 400 in the
OpenAI error shape naming the problem; none is a 500, and the gateway logs no unexpected error."""

from __future__ import annotations

import http.client
import json

import pytest

from pcpstack.common.ids import MAX_REQUEST_ID_CHARS
from pcpstack.gateway.openai_requests import MAX_JSON_DEPTH

MODEL = "SmolLM2-135M-Instruct"


def _post(url: str, path: str, body: bytes, headers: dict[str, bytes] | None = None) -> tuple[int, dict]:
    """POSTs raw bytes (headers as raw bytes too, so non-ASCII values go out as given)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.putrequest("POST", path)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        connection.endheaders(body)
        answer = connection.getresponse()
        return answer.status, json.loads(answer.read())
    finally:
        connection.close()


def _exchange(
    url: str, method: str, path: str, body: bytes, headers: dict[str, str]
) -> http.client.HTTPResponse:
    """One request; the response with its body read into `.json`."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request(method, path, body, {"Content-Type": "application/json", **headers})
        answer = connection.getresponse()
        answer.json = json.loads(answer.read())  # type: ignore[attr-defined]
        return answer
    finally:
        connection.close()


def _assert_400(status: int, answer: dict, param: str, words: str) -> None:
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def _assert_no_unexpected_error(gateway) -> None:
    assert "unexpected error" not in gateway.log_path.read_text()


def test_a_lone_surrogate_in_the_prompt_is_a_400_naming_the_prompt(gateway_alone) -> None:
    body = b'{"model": "%s", "prompt": "abc\\ud800"}' % MODEL.encode()
    status, answer = _post(gateway_alone.url, "/v1/completions", body)
    _assert_400(status, answer, "prompt", "lone surrogate '\\ud800'")
    _assert_no_unexpected_error(gateway_alone)


def test_a_lone_surrogate_in_a_chat_message_is_a_400_naming_messages(gateway_alone) -> None:
    body = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfffx"}]}]}'
    status, answer = _post(gateway_alone.url, "/v1/chat/completions", body)
    _assert_400(status, answer, "messages", "lone surrogate '\\udfff'")
    _assert_no_unexpected_error(gateway_alone)


def test_a_surrogate_pair_is_an_ordinary_character(gateway_alone) -> None:
    # The pair is one emoji; the request passes the gateway's checks and fails only on the absent worker.
    body = b'{"prompt": "smile \\ud83d\\ude00"}'
    status, answer = _post(gateway_alone.url, "/v1/completions", body)
    assert status == 503 and answer["error"]["type"] == "service_unavailable"


@pytest.mark.parametrize(
    ("request_id", "words"),
    [
        ("caf\u00e9".encode(), "only printable ASCII"),
        (b"\xff\xfe", "only printable ASCII"),
        (b"two words", "only printable ASCII"),
        (b"x" * (MAX_REQUEST_ID_CHARS + 1), f"at most {MAX_REQUEST_ID_CHARS}"),
    ],
)
def test_a_bad_request_id_is_a_400_naming_the_header(gateway_alone, request_id: bytes, words: str) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hello"}).encode()
    status, answer = _post(gateway_alone.url, "/v1/completions", body, {"X-Request-Id": request_id})
    _assert_400(status, answer, "X-Request-Id", words)
    assert answer["error"]["message"].startswith("X-Request-Id")
    _assert_no_unexpected_error(gateway_alone)


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
def test_deeply_nested_json_is_a_400_naming_the_limit(gateway_alone, depth: int) -> None:
    body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    status, answer = _post(gateway_alone.url, "/v1/completions", body)
    _assert_400(status, answer, "body", f"more than {MAX_JSON_DEPTH} levels deep")
    _assert_no_unexpected_error(gateway_alone)


@pytest.mark.parametrize("number", [b"NaN", b"1e999", b"9" * 5000])
def test_numbers_python_reads_but_json_does_not_mean_are_a_400(gateway_alone, number: bytes) -> None:
    body = b'{"prompt": "hi", "temperature": ' + number + b"}"
    status, answer = _post(gateway_alone.url, "/v1/completions", body)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
    assert answer["error"]["param"] in ("temperature", "body")
    _assert_no_unexpected_error(gateway_alone)


@pytest.mark.parametrize("prompt", [[["a"]], [["a", "b"]], [[[1]]], [[1, "a"]], [[True]]])
def test_a_prompt_nested_past_a_batch_of_one_is_a_400_naming_the_prompt(gateway_alone, prompt) -> None:
    body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
    status, answer = _post(gateway_alone.url, "/v1/completions", body)
    _assert_400(status, answer, "prompt", "token ids")
    _assert_no_unexpected_error(gateway_alone)


def test_a_refused_body_still_carries_the_callers_request_id(gateway_alone) -> None:
    answer = _exchange(
        gateway_alone.url, "POST", "/v1/completions", b'{"prompt": 5}', {"X-Request-Id": "id-42"}
    )
    assert answer.status == 400 and answer.json["error"]["param"] == "prompt"
    assert answer.getheader("X-Request-Id") == "id-42"


@pytest.mark.parametrize(
    ("method", "path", "allowed"), [("GET", "/v1/completions", "POST"), ("POST", "/v1/models", "GET")]
)
def test_a_wrong_method_is_a_405_that_names_the_allowed_ones(gateway_alone, method, path, allowed) -> None:
    answer = _exchange(gateway_alone.url, method, path, b"{}" if method == "POST" else b"", {})
    assert answer.status == 405
    assert allowed in answer.getheader("Allow", "")
    assert f"{method} {path} takes" in answer.json["error"]["message"]
