"""The HTTP layer on a real socket without a stack: routes, the OpenAI error shape, 503 when decode is
unreachable, and the Prometheus exposition."""

from __future__ import annotations

import asyncio
import logging

import pytest
from aiohttp.test_utils import TestClient, TestServer
from yarl import URL

from pcpstack.common.ports import free_port
from pcpstack.gateway.server import GatewaySettings, create_app
from pcpstack.gateway.upstream import DecodePool

MODEL = "SmolLM2-135M-Instruct"


def _with_client(check) -> None:
    """Runs check(client) against a gateway whose only decode worker address has nobody listening."""

    async def main() -> None:
        pool = DecodePool([f"127.0.0.1:{free_port()}"])
        app = create_app(pool, GatewaySettings(MODEL, request_timeout_s=5.0))
        async with TestClient(TestServer(app)) as client:
            await check(client)

    asyncio.run(main())


def test_models_lists_the_served_model() -> None:
    async def check(client: TestClient) -> None:
        answer = await client.get("/v1/models")
        assert answer.status == 200
        assert [m["id"] for m in (await answer.json())["data"]] == [MODEL]
        assert (await client.get(f"/v1/models/{MODEL}")).status == 200
        assert (await client.get("/v1/models/other")).status == 404

    _with_client(check)


def test_bad_input_is_a_400_in_the_openai_shape() -> None:
    async def check(client: TestClient) -> None:
        answer = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0})
        assert answer.status == 400
        error = (await answer.json())["error"]
        assert (
            error["param"] == "n" and error["type"] == "invalid_request_error" and "n=0" in error["message"]
        )
        answer = await client.post("/v1/chat/completions", data=b"{not json")
        assert answer.status == 400 and (await answer.json())["error"]["param"] == "body"

    _with_client(check)


def test_unreachable_decode_worker_is_a_503_and_unhealthy() -> None:
    async def check(client: TestClient) -> None:
        answer = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert answer.status == 503
        error = (await answer.json())["error"]
        assert error["type"] == "service_unavailable" and "decode worker at" in error["message"]
        assert (await client.get("/health")).status == 503

    _with_client(check)


def test_metrics_count_requests_by_endpoint_and_status() -> None:
    async def check(client: TestClient) -> None:
        await client.post("/v1/completions", data=b"{not json")
        answer = await client.get("/metrics")
        assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/plain")
        text = await answer.text()
        assert 'pcpstack:gateway_requests_total{endpoint="/v1/completions",status="400"} 1.0' in text
        assert (
            'pcpstack:gateway_errors_total{endpoint="/v1/completions",type="invalid_request_error"} 1.0'
            in text
        )
        assert "pcpstack:gateway_request_duration_seconds_bucket" in text

    _with_client(check)


def test_unknown_route_is_an_openai_shaped_404() -> None:
    async def check(client: TestClient) -> None:
        answer = await client.post("/v1/embeddings", json={})
        assert answer.status == 404 and "error" in await answer.json()

    _with_client(check)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_body_that_is_not_the_gzip_it_claims_is_a_400_naming_the_body(caplog, path: str) -> None:
    async def check(client: TestClient) -> None:
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        answer = await client.post(path, data=b'{"prompt": "not gzip"}', headers=headers)
        assert answer.status == 400
        error = (await answer.json())["error"]
        assert error["param"] == "body" and "could not decode the request body" in error["message"]
        assert "'gzip'" in error["message"]

    with caplog.at_level(logging.ERROR):
        _with_client(check)
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("GET", "/tokenize", 405, "POST"),
        ("POST", "/health", 405, "GET,HEAD"),
        ("POST", "//v1/completions", 404, None),
        ("GET", "/no/such/route", 404, None),
    ],
)
def test_an_error_outside_v1_comes_in_the_openai_shape(method: str, path: str, status: int, allow) -> None:
    async def check(client: TestClient) -> None:
        # Built with the path as it is: "//v1/..." must not be read as a host.
        url = URL.build(scheme="http", host=client.host, port=client.port, path=path, encoded=True)
        answer = await client.session.request(method, url, json={})
        assert answer.status == status and answer.content_type == "application/json"
        error = (await answer.json())["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        assert answer.headers.get("Allow") == allow

    _with_client(check)


def test_a_body_over_the_size_limit_is_an_openai_shaped_413_outside_v1_too() -> None:
    async def check(client: TestClient) -> None:
        too_large = b" " * (64 * 1024 * 1024 + 1)
        answer = await client.post("/tokenize", data=too_large, headers={"Content-Type": "application/json"})
        assert answer.status == 413 and answer.content_type == "application/json"
        assert "Maximum request body size" in (await answer.json())["error"]["message"]

    _with_client(check)


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    ],
    ids=["chunk-size", "content-length"],
)
def test_malformed_http_is_a_400_logged_in_one_info_line_not_an_error_with_a_traceback(caplog, head) -> None:
    async def check(client: TestClient) -> None:
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(head)
        await writer.drain()
        assert (await asyncio.wait_for(reader.read(64), 5)).startswith(b"HTTP/1.0 400")
        writer.close()

    with caplog.at_level(logging.INFO):
        _with_client(check)
    server = [record for record in caplog.records if record.name == "aiohttp.server"]
    assert [(record.levelno, record.exc_info) for record in server] == [(logging.INFO, None)]
    assert server[0].getMessage().startswith("malformed HTTP request refused with 400: Invalid character")
