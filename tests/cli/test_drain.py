"""A decode worker told SIGTERM drains: it leaves routing, refuses new requests with UNAVAILABLE, lets the
streams it runs finish, then exits (a real stack of processes, tiny model)."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from pcpstack.common.channel import open_channel
from pcpstack.common.errors import Unavailable
from pcpstack.common.startup import DrainGate
from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.v1 import registry_pb2, registry_pb2_grpc
from tests.helpers import start_stack

# Long enough that the stream is still running when the signal lands right after its first token.
STREAM_TOKENS = 3000


async def _decode_workers_routed(registry: str) -> int:
    async with open_channel(registry, default_deadline=5) as channel:
        stub = registry_pb2_grpc.RegistryServiceStub(channel)
        return len((await stub.Resolve(registry_pb2.ResolveRequest())).decode)


async def _wait_for_log(path, text: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{text!r} never appeared in {path}"
        await asyncio.sleep(0.05)


@pytest.mark.slow
def test_a_stream_started_before_sigterm_completes_while_new_requests_are_refused(tmp_path) -> None:
    # A drain long enough for the whole stream on a loaded machine (the local stack's default is 10 s).
    stack = start_stack(tmp_path, pcp=1, model="tiny", decode_drain_s=120)
    decode = next(s for s in stack.stack.services if s.name == "decode-0")
    try:

        async def scenario() -> tuple[list[int], int, grpc.StatusCode, str, int]:
            client = DecodeClient(stack.decode)
            try:
                request = build_request("drain", max_tokens=STREAM_TOKENS, ignore_eos=True)
                stream = client.stream(request, timeout=300)
                tokens: list[int] = []
                summary = None
                async for message in stream:
                    if message.HasField("delta"):
                        if not tokens:
                            decode.process.send_signal(signal.SIGTERM)
                            await _wait_for_log(decode.log_path, "draining: waiting")
                            routed = await _decode_workers_routed(stack.stack.registry_address)
                            try:
                                await client.generate(build_request("late", max_tokens=2), timeout=30)
                                refused, detail = grpc.StatusCode.OK, ""
                            except grpc.aio.AioRpcError as error:
                                refused, detail = error.code(), error.details() or ""
                        tokens.extend(message.delta.token_ids)
                    else:
                        summary = message.summary
                assert summary is not None
                return tokens, summary.completion_tokens, refused, detail, routed
            finally:
                await client.close()

        assert stack.run(_decode_workers_routed(stack.stack.registry_address)) == 1
        tokens, completion_tokens, refused, detail, routed = stack.run(scenario())
        assert len(tokens) == completion_tokens == STREAM_TOKENS
        assert routed == 0  # deregistered while its stream still ran
        assert refused == grpc.StatusCode.UNAVAILABLE and "draining" in detail
        assert decode.process.wait(timeout=60) == 0
        log = decode.log_path.read_text()
        assert "for 1 running stream(s)" in log and "drained: every running stream finished" in log
    finally:
        stack.stop()


def test_the_drain_gate_refuses_new_requests_once_closed_and_waits_for_running_ones() -> None:
    async def scenario() -> None:
        gate = DrainGate()
        release = asyncio.Event()

        async def request() -> None:
            with gate.admit():
                await release.wait()

        running = asyncio.ensure_future(request())
        await asyncio.sleep(0)
        assert gate.running == 1
        gate.close()
        with pytest.raises(Unavailable, match="draining"), gate.admit():
            pass
        assert gate.running == 1 and not await gate.wait_idle(0.01)  # still running: not idle
        release.set()
        assert await gate.wait_idle(10) and gate.running == 0
        await running

    asyncio.run(scenario())
