"""A gateway with TLS material serves HTTPS with its certificate, which clients verify against the CA."""

from __future__ import annotations

import ssl
import time
import urllib.error
import urllib.request

import httpx2
import openai

from pcpstack.cli.certs import write_certs
from pcpstack.common.ports import free_port
from tests.gateway.conftest import GatewayProcess, child_environment


def test_the_gateway_serves_https_with_its_certificate_and_refuses_plain_http(tmp_path) -> None:
    write_certs(tmp_path / "certs", names=["gateway"])
    certs = tmp_path / "certs"
    tls = ["--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "gateway.pem")]
    tls += ["--tls-key", str(certs / "gateway-key.pem")]
    process = GatewayProcess(
        ["--decode", f"127.0.0.1:{free_port()}", "--model-name", "tiny", *tls],
        tmp_path / "gateway.log",
        child_environment(),
    )
    https_url = process.url.replace("http://", "https://")
    trust = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    client = openai.OpenAI(
        base_url=f"{https_url}/v1", api_key="unused", max_retries=0, http_client=httpx2.Client(verify=trust)
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.process.poll() is None, process.log_path.read_text()[-3000:]
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the gateway did not serve HTTPS within 60 s"
                time.sleep(0.3)
        assert [m.id for m in models] == ["tiny"]
        try:
            with urllib.request.urlopen(f"{process.url}/v1/models", timeout=5) as answer:
                plain_status = answer.status
        except (urllib.error.URLError, ConnectionError) as exc:
            plain_status = getattr(exc, "code", None)
        assert plain_status != 200
    finally:
        process.stop()
