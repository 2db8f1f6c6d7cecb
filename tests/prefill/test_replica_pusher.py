"""The rank's KV pusher against a real KV store process: a refused push raises the store's error at once
(no pointless retry) and leaves no task pending in the pusher's loop (one would be destroyed pending). And
the size of the standby a rank readies between forwards."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Iterator

import pytest

from pcpstack.cli.launch import spawn_and_wait_listening
from pcpstack.common.errors import AlreadyExists, ResourceExhausted
from pcpstack.kvstore import client as client_module
from pcpstack.kvstore.errors import StoreStalled
from pcpstack.prefill.rank import ReplicaPusher, repeating_push

FINGERPRINT = "f" * 64
CAPACITY = 64 * 1024


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[str]:
    process, address = spawn_and_wait_listening("kvstore", ["--port", "0", "--capacity-bytes", str(CAPACITY)])
    yield address
    process.terminate()
    process.wait(timeout=30)


def pending_tasks(pusher: ReplicaPusher) -> list[asyncio.Task]:
    return [task for task in asyncio.all_tasks(pusher._loop) if not task.done()]


@pytest.mark.parametrize(
    ("key", "size", "kind"),
    [("twice/ffff", 1024, AlreadyExists), ("too-big/ffff", 2 * CAPACITY, ResourceExhausted)],
)
def test_a_refused_push_raises_the_store_error_and_leaves_no_pending_task(
    store, caplog, key, size, kind
) -> None:
    pusher = ReplicaPusher()
    if kind is AlreadyExists:
        assert pusher.push(store, key, FINGERPRINT, memoryview(bytearray(size)), 0)
    with caplog.at_level(logging.WARNING), pytest.raises(kind):
        pusher.push(store, key, FINGERPRINT, memoryview(bytearray(size)), 0)
    assert pending_tasks(pusher) == []
    gc.collect()
    assert "Task was destroyed" not in caplog.text
    assert "retrying on a new channel" not in caplog.text


def test_a_push_to_a_frozen_store_fails_stalled_without_a_retry_on_a_new_channel(caplog, monkeypatch) -> None:
    """A store stopped (SIGSTOP) answers nothing on any channel: the push fails once its stall bound passes,
    not again after a second one on a fresh channel (the retry is for a store that restarted)."""
    monkeypatch.setattr(client_module, "STALL_S", 1.0)
    process, address = spawn_and_wait_listening("kvstore", ["--port", "0"])
    pusher = ReplicaPusher()
    try:
        assert pusher.push(address, "before/ffff", FINGERPRINT, memoryview(bytearray(1024)), 0)
        process.send_signal(signal.SIGSTOP)
        with caplog.at_level(logging.WARNING), pytest.raises(StoreStalled, match="did not answer within 1 s"):
            pusher.push(address, "frozen/ffff", FINGERPRINT, memoryview(bytearray(1024)), 0)
        assert "retrying on a new channel" not in caplog.text
        assert pending_tasks(pusher) == []
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)


def test_the_standby_readied_between_forwards_holds_either_repeating_size() -> None:
    """keep_standby's choice: after pushes of two sizes within a standby's slack (shm.MAX_REUSE_SLACK) to one
    store, a standby of the larger, which holds either, whichever came last; none for sizes further apart,
    two stores, or a forward that would push nothing."""
    store, other = "127.0.0.1:1", "127.0.0.1:2"
    assert repeating_push((store, 1000), (store, 1200)) == (store, 1200)
    assert repeating_push((store, 1200), (store, 1000)) == (store, 1200)  # the smaller last
    assert repeating_push((store, 1000), (store, 1000)) == (store, 1000)
    assert repeating_push((store, 1000), (store, 1300)) is None  # 30 % apart
    assert repeating_push((store, 1000), (other, 1000)) is None
    assert repeating_push(None, (store, 1000)) is None
    assert repeating_push((store, 0), (store, 0)) is None
