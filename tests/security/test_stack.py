"""A whole local stack (real processes, tiny model) with mutual TLS and the token on serves Generate, and
refuses a caller without the token."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from pcpstack.common import security
from pcpstack.decode.client import DecodeClient, build_request
from tests.helpers import start_stack
from tests.security.conftest import TOKEN


async def _generate(address: str) -> list[int]:
    client = DecodeClient(address)
    try:
        request = build_request("hello secure world", max_tokens=4, ignore_eos=True)
        return (await client.generate(request, timeout=120)).token_ids
    finally:
        await client.close()


@pytest.mark.slow
def test_a_stack_with_tls_and_a_token_serves_generate(certs: Path, tmp_path: Path, monkeypatch) -> None:
    env = {
        security.CA_ENV: str(certs / "ca.pem"),
        security.CERT_ENV: str(certs / "server.pem"),
        security.KEY_ENV: str(certs / "server-key.pem"),
        security.TOKEN_ENV: TOKEN,
    }
    stack = start_stack(tmp_path, pcp=2, model="tiny", extra_env=env)
    try:
        # This test process is a client too: it takes the same settings from its environment.
        for name, value in {**env, security.CERT_ENV: str(certs / "client.pem")}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv(security.KEY_ENV, str(certs / "client-key.pem"))
        assert len(stack.run(_generate(stack.decode))) == 4
        monkeypatch.delenv(security.TOKEN_ENV)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            stack.run(_generate(stack.decode))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stack.stop()
