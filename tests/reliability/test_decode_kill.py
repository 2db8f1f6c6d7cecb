"""A decode worker killed (SIGKILL) mid-stream, and one killed while it holds an unreleased KV replica.

The client gets an error, not a hang; nothing stays pinned in the store. Decode releases a replica as soon
as it has loaded it, so to leave one behind for the store's lease the worker is frozen (SIGSTOP) while its
prefill is held in flight, the prefill then finishes and pins its replica, and the frozen worker is killed:
the store reclaims the replica when its lease (3 s here, `--kv-lease-ms` of the prefill node) runs out.
A worker restarted on its address serves again.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import grpc
import pytest

from pcpstack.decode.client import DecodeClient, build_request
from tests.helpers import RunningStack
from tests.reliability.support import (
    generate,
    in_thread,
    kill_service,
    rank_pids,
    restart_service,
    service,
    signal_all,
    start_tuned_stack,
    store_stat,
    wait_prefill_idle,
    wait_prefill_in_flight,
    wait_store_unpinned,
    wait_until,
)

pytestmark = pytest.mark.slow

PROMPT = [(5 * i + 1) % 256 for i in range(64)]
KV_LEASE_MS = 3000


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[RunningStack]:
    running = start_tuned_stack(
        tmp_path_factory.mktemp("decode-kill"),
        {"prefill-": ["--kv-lease-ms", str(KV_LEASE_MS)]},
        pcp=2,
    )
    yield running
    running.stop()


def restart_decode(stack: RunningStack, victim) -> None:
    restart_service(stack, victim)
    wait_until(
        "the restarted decode worker to answer",
        lambda: _answers(stack),
        timeout=60,
        interval=0.5,
    )


def _answers(stack: RunningStack) -> bool:
    try:
        return len(stack.run(generate(stack.decode, PROMPT, timeout=10)).token_ids) == 8
    except Exception:
        return False


def test_decode_killed_mid_stream_gives_the_client_an_error_and_leaves_nothing_pinned(stack) -> None:
    async def stream_until_killed() -> tuple[int, grpc.StatusCode]:
        client = DecodeClient(stack.decode)
        received = 0
        try:
            call = client.stream(build_request(PROMPT, max_tokens=3000, ignore_eos=True), timeout=60)
            async for message in call:
                received += len(message.delta.token_ids)
                if received == 3:
                    kill_service(stack, "decode-0")
        except grpc.aio.AioRpcError as exc:
            return received, exc.code()
        finally:
            await client.close()
        return received, grpc.StatusCode.OK

    victim = service(stack, "decode-0")
    received, code = stack.run(stream_until_killed())
    assert 3 <= received < 3000
    assert code == grpc.StatusCode.UNAVAILABLE
    assert victim.process.returncode == -signal.SIGKILL
    wait_store_unpinned(stack)
    restart_decode(stack, victim)


def test_decode_killed_holding_a_replica_leaves_it_to_the_store_lease(stack) -> None:
    before = stack.run(store_stat(stack.stack.kvstore_address))
    ranks = rank_pids(service(stack, "prefill-0"))
    decode = service(stack, "decode-0")
    wait_prefill_idle(stack)
    signal_all(ranks, signal.SIGSTOP)
    answer = in_thread(generate(stack.decode, PROMPT, timeout=30))
    try:
        wait_prefill_in_flight(stack)
        signal_all([decode.process.pid], signal.SIGSTOP)
    finally:
        signal_all(ranks, signal.SIGCONT)

    def pinned_or_expired() -> bool:
        # A poll slower than the lease (a loaded machine) may miss the pin itself, never its expiry.
        stat = stack.run(store_stat(stack.stack.kvstore_address))
        return stat.pinned_bytes > 0 or stat.lease_expiries > before.lease_expiries

    wait_until(
        "the prefill to pin its replica in the store",
        pinned_or_expired,
        timeout=60,  # the resumed ranks finish the forward and push: slow on a loaded machine
    )
    kill_service(stack, "decode-0")

    with pytest.raises(grpc.aio.AioRpcError) as info:
        answer.result(timeout=40)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    after = wait_store_unpinned(stack, timeout=KV_LEASE_MS / 1000 + 10)
    assert after.lease_expiries == before.lease_expiries + 1
    restart_decode(stack, decode)
    wait_store_unpinned(stack)
