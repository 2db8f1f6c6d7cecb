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
