"""Decode with tensor parallelism behind real peers, and replicas stored as several shards.

A real `pcpstack serve decode` worker with tensor_parallel_size=2 (the tiny model's 2 K/V heads, one per rank)
joins the session's tiny-model stack (registry, KV store, a PCP=2 prefill set): its greedy answers equal the
plain engine's, it registers as a worker of 2 devices, and on SIGTERM it stops its follower rank with it. When
its follower is killed, a request fails UNAVAILABLE (not a hang) and the worker deregisters and exits 1.
The pipeline reads a replica stored as one store object per K/V head range (what a TP prefill set writes)
and puts it together exactly, releasing every object once; shards that do not cover each head exactly once
fail the request with DATA_LOSS and are released all the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch

from pcpstack.cli.launch import spawn_and_wait_listening
from pcpstack.common.errors import DataLoss
from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.decode.pipeline import GeneratePipeline
from pcpstack.engine.device import accelerator_count, pick_device
from pcpstack.engine.engine import Engine
from pcpstack.engine.parallel import shard_fingerprint
from pcpstack.kvstore.client import KvStoreClient, make_key
from pcpstack.v1 import common_pb2
from tests.decode.support import BLOCK_SIZE, greedy, prompt
from tests.helpers import RunningStack, child_pids, pinned_bytes
from tests.reliability.support import list_nodes

TP = 2


def skip_without_devices(tp: int = TP) -> None:
    """The stack and the reference run on what is present; a worker of TP ranks needs one device each."""
    kind = pick_device().type
    present = accelerator_count(kind)
    if kind != "cpu" and present < tp:
        reason = f"{kind}: a decode worker of {tp} TP ranks needs {tp} devices, {present} present"
        print(f"skipped: {reason}")
        pytest.skip(reason)


@contextmanager
def running_tp_worker(
    stack: RunningStack, *extra: str, tp: int = TP
) -> Iterator[tuple[str, subprocess.Popen]]:
    """(address, process) of a decode worker with tensor_parallel_size=tp (2) registered with the stack."""
    skip_without_devices(tp)
    args = ["--registry", stack.stack.registry_address, "--model", "tiny", "--threads", "1"]
    args += ["--set", f"tensor_parallel_size={tp}", "--set", f"block_size={BLOCK_SIZE}"]
    args += ["--log-level", "WARNING", *extra]
    process, address = spawn_and_wait_listening("decode", args)
    try:
        yield address, process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


@pytest.fixture(scope="module")
def tp_worker(stack: RunningStack) -> Iterator[tuple[str, int]]:
    """(address, pid) of a TP worker for the module."""
    with running_tp_worker(stack) as (address, process):
        yield address, process.pid


def follower_ranks(pid: int) -> list[int]:
    """The follower ranks of a TP worker (not multiprocessing's resource tracker, its other child)."""
    return [p for p in child_pids(pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


async def greedy_answer(address: str, ids: list[int], max_tokens: int) -> list[int]:
    client = DecodeClient(address)
    try:
        request = build_request(ids, max_tokens=max_tokens, ignore_eos=True)
        answer = await client.generate(request, timeout=120)
    finally:
        await client.close()
    return answer.token_ids


@pytest.mark.slow
def test_tp2_worker_answers_greedy_like_the_engine_alone_and_registers_two_devices(
    stack, tp_worker, reference
) -> None:
    address, _ = tp_worker
    ids = list(prompt(37, seed=7))
    assert stack.run(greedy_answer(address, ids, 16)) == reference.generate(ids, greedy(16)).token_ids
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0
    assert [n.device_count for n in list_nodes(stack) if n.address == address] == [TP]


@pytest.mark.slow
def test_sigterm_stops_the_tp_worker_and_its_follower_rank(tp_worker) -> None:
    _, pid = tp_worker
    followers = follower_ranks(pid)
    assert len(followers) == TP - 1, "the TP worker runs its follower rank as a child process"
    os.kill(pid, signal.SIGTERM)
    os.waitpid(pid, 0)
    assert not [p for p in followers if running(p)], "a follower outlived its worker"


@pytest.mark.slow
def test_killed_follower_rank_fails_the_request_unavailable_and_the_worker_leaves_routing(stack) -> None:
    with running_tp_worker(stack, "--collective-timeout", "5") as (address, process):
        os.kill(follower_ranks(process.pid)[0], signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            stack.run(greedy_answer(address, list(prompt(20, seed=3)), 8))
        # A worker that can only fail stops: it deregisters and exits 1 for its supervisor to restart.
        assert process.wait(60) == 1
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
    assert "tensor-parallel group failed" in failed.value.details()
    nodes = list_nodes(stack)
    assert nodes and address not in [n.address for n in nodes]
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0


def running(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def store_shards(
    stack: RunningStack, kv: torch.Tensor, fingerprint: str, heads: list[range], name: str
) -> common_pb2.KvHandle:
    """Writes one store object per head range of `kv` (as a TP prefill set does) and returns the handle."""
    num_kv_heads = kv.shape[3]

    async def put() -> common_pb2.KvHandle:
        handle = common_pb2.KvHandle(
            fingerprint=fingerprint, num_tokens=kv.shape[2], store_address=stack.stack.kvstore_address
        )
        async with KvStoreClient(stack.stack.kvstore_address) as store:
            for part in heads:
                shard_fp = shard_fingerprint(fingerprint, part, num_kv_heads)
                key = make_key(f"{name}.kv{part.start}-{part.stop}", shard_fp)
                data = kv[:, :, :, part.start : part.stop].contiguous().view(torch.uint8).numpy()
                stored = await store.put(key, shard_fp, data)
                handle.shards.append(
                    common_pb2.KvShard(
                        key=key,
                        capability=stored.capability,
                        kv_head_start=part.start,
                        kv_head_end=part.stop,
                        total_bytes=data.nbytes,
                        fingerprint=shard_fp,
                    )
                )
        handle.key, handle.capability = handle.shards[0].key, handle.shards[0].capability
        handle.total_bytes = sum(s.total_bytes for s in handle.shards)
        return handle

    return stack.run(put())


def replica(reference: Engine, n: int) -> torch.Tensor:
    reference.prefill("replica", list(prompt(n, seed=n)))
    try:
        return reference.export_sequence("replica").cpu()
    finally:
        reference.free("replica")


def test_replica_in_two_head_shards_is_put_together_exactly_and_each_released(
    stack, pipeline: GeneratePipeline, reference
) -> None:
    kv = replica(reference, 21)
    handle = store_shards(stack, kv, pipeline.settings.kv_fingerprint, [range(1, 2), range(0, 1)], "two")
    fetched = stack.run(pipeline._fetch_kv(handle))
    stack.run(pipeline._release(handle))
    assert torch.equal(fetched, kv)
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0


def test_shards_that_miss_a_head_fail_with_data_loss_and_are_released(
    stack, pipeline: GeneratePipeline, reference
) -> None:
    kv = replica(reference, 9)
    # Head 0 twice, head 1 never.
    handle = store_shards(stack, kv, pipeline.settings.kv_fingerprint, [range(0, 1)], "gap")
    handle.shards.append(handle.shards[0])
    with pytest.raises(DataLoss, match="each exactly once"):
        stack.run(pipeline._fetch_kv(handle))
    stack.run(pipeline._release(handle))
    assert stack.run(pinned_bytes(stack.stack.kvstore_address)) == 0
