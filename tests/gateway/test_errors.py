"""Decode's gRPC failures map to the HTTP status and OpenAI error shape clients expect."""

from __future__ import annotations

import grpc
import pytest

from pcpstack.gateway.errors import error_from_rpc, param_of


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_rpc_status_maps_to_http_status(code: grpc.StatusCode, status: int) -> None:
    assert error_from_rpc(code, "x").status == status


@pytest.mark.parametrize(
    "message",
    [
        "prompt of 900 tokens exceeds this prefill set's KV capacity of 512 tokens (--kv-cache-tokens; ...)",
        "prompt of 100 tokens plus max_tokens=50 need 2 KV blocks of 128 tokens; this decode worker's "
        "cache has 1",
    ],
)
def test_a_request_too_large_for_the_deployment_is_a_400_not_a_retryable_429(message: str) -> None:
    error = error_from_rpc(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
    assert (error.status, error.param, error.code) == (400, "prompt", "context_length_exceeded")
    # A busy service's refusal names no request field: the client may retry it.
    busy = error_from_rpc(
        grpc.StatusCode.RESOURCE_EXHAUSTED, "put of key 'r1' needs 5 bytes but only 2 are free"
    )
    assert (busy.status, busy.param) == (429, None)


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ("sampling.temperature=-1.0 must be finite and >= 0", "temperature"),
        (
            "sampling.max_tokens=900 with 10 prompt tokens exceeds the model context of 512 tokens",
            "max_tokens",
        ),
        ("chat.messages.role='tool' is not one of system, user, assistant", "messages"),
        ("token_ids.ids[3]=99999 is not below the vocabulary size 49152", "prompt"),
        ("no ready prefill set serves this model and KV layout", None),
    ],
)
def test_the_parameter_is_read_from_decodes_message(message: str, param: str | None) -> None:
    assert param_of(message) == param


def test_error_body_has_the_openai_shape() -> None:
    body = error_from_rpc(grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_k=-3 must be >= 0").body()
    assert body == {
        "error": {
            "message": "sampling.top_k=-3 must be >= 0",
            "type": "invalid_request_error",
            "param": "top_k",
            "code": "invalid_argument",
        }
    }
