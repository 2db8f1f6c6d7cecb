"""The gateway's HTTP security: an API key, CORS, and TLS.

API key: with a key configured, every request must carry `Authorization: Bearer <key>`, else it gets a 401
in the OpenAI error shape (code "invalid_api_key"), as OpenAI and vLLM answer. Open without a key, so that
probes and scrapers need no secret: /health, /metrics and /version (nothing in them is the model's), and
CORS preflights (a browser never sends credentials on those).

CORS: a request whose Origin is among the allowed origins ("*" allows any) gets
Access-Control-Allow-Origin on its answer, and its preflight (OPTIONS with Access-Control-Request-Method)
is answered 204 with the methods and headers the API uses. With no origin allowed (the default) browsers on
other origins are refused by their own same-origin rule.
"""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiohttp import web

from pcpstack.gateway.errors import ApiError

# Paths answered without the API key.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
_ALLOWED_METHODS = "GET, POST, OPTIONS"
_ALLOWED_HEADERS = "Authorization, Content-Type, X-Request-Id, traceparent, tracestate"
_EXPOSED_HEADERS = "X-Request-Id, X-Trace-Id"
_PREFLIGHT_MAX_AGE_S = "600"


@dataclass(frozen=True)
class HttpSecurity:
    """What the gateway enforces: the API key ("" for none) and the allowed CORS origins."""

    api_key: str = ""
    cors_origins: tuple[str, ...] = ()

    def install(self, app: web.Application) -> None:
        """Adds the CORS preflight and API key middlewares (after those already there, so a refusal is
        counted like any answer) and the CORS headers of every answer, streamed ones included."""
        app.middlewares.extend([_preflight(self.cors_origins), _auth(self.api_key)])

        async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
            response.headers.update(_cors_headers(request, self.cors_origins))

        app.on_response_prepare.append(add_cors_headers)


def unauthorized(message: str) -> ApiError:
    """The 401 OpenAI clients raise AuthenticationError for."""
    return ApiError(401, message, error_type="invalid_request_error", code="invalid_api_key")


def _auth(api_key: str) -> Callable:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler: Callable) -> web.StreamResponse:
        if not api_key or request.path in OPEN_PATHS or request.method == "OPTIONS":
            return await handler(request)
        given = request.headers.get("Authorization", "")
        # compare_digest: how long a comparison takes tells nothing about how much of the key was right.
        if not hmac.compare_digest(given.encode(), expected):
            error = unauthorized(
                "a valid API key is required: send the header 'Authorization: Bearer <key>'"
                if not given
                else "the API key in the Authorization header is not valid"
            )
            return web.json_response(error.body(), status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check_api_key


def _cors_headers(request: web.Request, origins: Sequence[str]) -> dict[str, str]:
    """The CORS headers of an answer to `request`: none unless its Origin is allowed."""
    origin = request.headers.get("Origin")
    if origin is None or not ("*" in origins or origin in origins):
        return {}
    return {
        "Access-Control-Allow-Origin": "*" if "*" in origins else origin,
        "Access-Control-Expose-Headers": _EXPOSED_HEADERS,
        "Vary": "Origin",
    }


def _preflight(origins: Sequence[str]) -> Callable:
    @web.middleware
    async def answer_preflight(request: web.Request, handler: Callable) -> web.StreamResponse:
        """A CORS preflight from an allowed origin is answered here, before routing or the API key."""
        if (
            request.method != "OPTIONS"
            or "Access-Control-Request-Method" not in request.headers
            or not _cors_headers(request, origins)
        ):
            return await handler(request)
        headers = {
            "Access-Control-Allow-Methods": _ALLOWED_METHODS,
            "Access-Control-Allow-Headers": _ALLOWED_HEADERS,
            "Access-Control-Max-Age": _PREFLIGHT_MAX_AGE_S,
        }
        return web.Response(status=204, headers=headers)

    return answer_preflight


def server_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The TLS context of an HTTPS gateway (TLS 1.2 at least); raises OSError or ssl.SSLError for files that
    cannot be read or do not match."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context
