"""Errors in the OpenAI shape, and the mapping from the decode service's gRPC status to an HTTP status.

OpenAI clients read `{"error": {"message", "type", "param", "code"}}` and branch on the HTTP status, so every
failure the gateway returns, its own or a decode worker's, is turned into this one shape here.
"""

from __future__ import annotations

import re

import grpc

# gRPC status of a decode call -> (HTTP status, OpenAI error type).
_HTTP_OF_RPC: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "resource_exhausted"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
# The decode service names the field first ("sampling.temperature=-1.0 must be ..."); its OpenAI parameter:
_PARAM_OF_FIELD = {
    "chat": "messages",
    "text": "prompt",
    "token_ids": "prompt",
    "prompt": "prompt",
    "model": "model",
}
_FIELD = re.compile(r"[A-Za-z_][\w.]*")
# An error message quotes at most this much of a bad value: enough to recognise it, never a 10 MB echo.
QUOTED_CHARS = 100


class ApiError(Exception):
    """A failure to report to the HTTP client: status, message, and the OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        error_type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type
        self.code = code

    def body(self) -> dict:
        """The JSON body OpenAI clients parse."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(param: str, message: str) -> ApiError:
    """A 400 about one request parameter; the message should say the value and the rule."""
    return ApiError(400, message, param=param)


def clipped(text: str) -> str:
    """text for an error message: cut to QUOTED_CHARS characters, with its full length said."""
    if len(text) <= QUOTED_CHARS:
        return text
    return f"{text[:QUOTED_CHARS]}… ({len(text)} characters)"


def quoted(value: object) -> str:
    """repr(value) for an error message, clipped."""
    return clipped(repr(value))


def service_unavailable(message: str) -> ApiError:
    """A 503: nothing can serve the request right now; the client may retry."""
    return ApiError(503, message, error_type="service_unavailable", code="service_unavailable")


def error_from_rpc(code: grpc.StatusCode, details: str) -> ApiError:
    """The ApiError for a failed Generate call, with the OpenAI parameter its message names (if any).

    RESOURCE_EXHAUSTED is a 429 (busy: try again later), except when its message begins with a request
    field ("prompt of 900 tokens exceeds this prefill set's KV capacity of 512 tokens"): that request is
    larger than this deployment holds at any time, and OpenAI clients retry a 429 on their own, so it is a
    400 naming the field, with OpenAI's code for it (context_length_exceeded)."""
    status, error_type = _HTTP_OF_RPC.get(code, (500, "server_error"))
    message = details or code.name
    param = param_of(message)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and param is not None:
        return ApiError(400, message, param=param, code="context_length_exceeded")
    return ApiError(
        status,
        message,
        param=param if status == 400 else None,
        error_type=error_type,
        code=code.name.lower(),
    )


def param_of(message: str) -> str | None:
    """The OpenAI parameter a decode error message names ("sampling.top_k=..." -> "top_k"), else None."""
    match = _FIELD.match(message)
    if match is None:
        return None
    parts = match.group().split(".")
    if parts[0] == "sampling" and len(parts) > 1:
        return parts[1]
    return _PARAM_OF_FIELD.get(parts[0])
