"""The KV store killed (SIGKILL) with requests in flight, then restarted on its address.

Requests whose prefill was held in flight when the store died fail cleanly (UNAVAILABLE, before their
deadline); a stream whose KV was already loaded finishes; once the store is back, requests succeed with
the same answers as before, and nothing stays pinned.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import grpc
import pytest

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
    wait_prefill_idle,
    wait_prefill_in_flight,
    wait_store_unpinned,
    wait_until,
)

pytestmark = pytest.mark.slow

PROMPTS = [[(11 * i + k) % 256 for i in range(40 + 10 * k)] for k in range(3)]
DEADLINE_S = 30.0


@pytest.fixture
def stack(tmp_path) -> Iterator[RunningStack]:
    running = start_tuned_stack(tmp_path, pcp=2)
    yield running
    running.stop()


def test_kvstore_killed_fails_in_flight_requests_cleanly_and_later_ones_succeed(stack) -> None:
    expected = [stack.run(generate(stack.decode, p)).token_ids for p in PROMPTS]
    ranks = rank_pids(service(stack, "prefill-0"))
    streaming = in_thread(generate(stack.decode, PROMPTS[0], max_tokens=1500, timeout=DEADLINE_S))
    time.sleep(0.5)  # its KV is loaded: prefill and fetch take milliseconds on the tiny model
    wait_prefill_idle(stack)
    signal_all(ranks, signal.SIGSTOP)
    in_flight = [in_thread(generate(stack.decode, p, timeout=DEADLINE_S)) for p in PROMPTS]
    try:
        wait_prefill_in_flight(stack)
        victim = kill_service(stack, "kvstore")
    finally:
        signal_all(ranks, signal.SIGCONT)

    for future in in_flight:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            future.result(timeout=DEADLINE_S + 15)
        # UNAVAILABLE, not DEADLINE_EXCEEDED: they failed before their deadline
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        # the set's failure first, not "no ready prefill set" (it was ready; it failed)
        assert info.value.details().startswith("set "), info.value.details()
        assert "no other ready set to retry on" in info.value.details()
    assert len(streaming.result(timeout=DEADLINE_S + 15).token_ids) == 1500

    restart_service(stack, victim)

    def answers() -> bool:
        try:
            return stack.run(generate(stack.decode, PROMPTS[0], timeout=10)).token_ids == expected[0]
        except grpc.aio.AioRpcError:
            return False

    wait_until("a request to succeed after the store restarted", answers, timeout=60, interval=0.5)
    assert [stack.run(generate(stack.decode, p)).token_ids for p in PROMPTS] == expected
    wait_store_unpinned(stack)
