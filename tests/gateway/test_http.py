"""The HTTP layer on a real socket without a stack: routes, the OpenAI error shape, 503 when decode is
unreachable, and the Prometheus exposition."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

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
