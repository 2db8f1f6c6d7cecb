"""Decode with tensor parallelism (engine.tp_engine) in real processes over a real gloo group equals the plain
single-rank Engine.

The same replicas (made by single-rank prefill) are adopted by both engines, and both run the same schedule of
decode steps while sequences of different lengths join and leave the batch; the logits agree within 1e-4 at
every step. SmolLM2 at TP=3 (9 query / 3 K/V heads) splits the K/V heads; the tiny model at TP=4 (2 K/V heads)
replicates them. A follower killed with SIGKILL makes the next step raise Unavailable instead of hanging.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import torch

from pcpstack.common.errors import Unavailable
from pcpstack.engine.device import accelerator_count
from pcpstack.engine.engine import Engine
from pcpstack.engine.host_group import HostGroup
from pcpstack.engine.tp_engine import TensorParallelEngine

TOL = 1e-4
BLOCK_SIZE = 16
NUM_BLOCKS = 64
STEPS = 32
# Prompt length of each sequence, the step it joins the batch at, and the step it leaves at (None: stays).
SCHEDULE = {"a": (5, 0, None), "b": (40, 0, 20), "c": (17, 8, None)}


def device_kind_or_skip(kind: str, ranks: int) -> str:
    """`kind` when it can run `ranks` ranks here, else a skip that says why."""
    if kind != "cpu" and accelerator_count(kind) < ranks:
        reason = f"{kind}: {ranks} ranks need {ranks} devices, {accelerator_count(kind)} present"
        print(f"skipped: {reason}")
        pytest.skip(reason)
    return kind


def start_tp(model: str | None, tp: int, kind: str, timeout_s: float = 60.0) -> TensorParallelEngine:
    """A float32 TP engine, one torch thread per rank (the ranks share this machine's cores)."""
    return TensorParallelEngine.start(
        model,
        tp,
        device_kind=kind,
        dtype=torch.float32,
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        timeout_s=timeout_s,
        threads=1,
    )


def replicas(reference: Engine) -> dict[str, tuple[torch.Tensor, int]]:
    """Each scheduled sequence's replica from single-rank prefill, and its first token (greedy)."""
    made = {}
    for name, (length, _, _) in SCHEDULE.items():
        tokens = torch.randint(0, 200, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        logits = reference.prefill(f"prefill-{name}", tokens)
        made[name] = (reference.export_sequence(f"prefill-{name}").cpu(), int(logits.argmax()))
        reference.free(f"prefill-{name}")
    return made


def assert_same_decode(reference: Engine, tp_engine: TensorParallelEngine) -> None:
    made = replicas(reference)
    tokens: dict[str, int] = {}
    for step in range(STEPS):
        for name, (length, joins, leaves) in SCHEDULE.items():
            if step == joins:
                kv, first = made[name]
                reference.adopt_sequence(name, kv, length)
                tp_engine.adopt_sequence(name, kv, length)
                tokens[name] = first
            if step == leaves:
                reference.free(name)
                tp_engine.free(name)
                del tokens[name]
        names = list(tokens)
        expected = reference.decode_step(names, [tokens[n] for n in names])
        got = tp_engine.decode_step(names, [tokens[n] for n in names]).cpu()
        err = (got - expected).abs().max().item()
        assert err <= TOL, f"step {step}, batch {names}: logits differ by {err}"
        tokens = {n: int(t) for n, t in zip(names, expected.argmax(-1).tolist(), strict=True)}
    for name in tokens:
        tp_engine.free(name)


@pytest.fixture
def closing() -> Iterator[list[TensorParallelEngine]]:
    """TP engines to close after the test; the TP engine sets this process's torch threads, restored here."""
    threads = torch.get_num_threads()
    engines: list[TensorParallelEngine] = []
    yield engines
    for engine in engines:
        engine.close()
    torch.set_num_threads(threads)


# On accelerators only: on this CPU-only CI the same split of SmolLM2 runs through the whole path in
# tests/e2e/test_tp_path.py (greedy equal to HF transformers' over 32 steps), and the logits check with
# sequences joining and leaving runs on the tiny model below; three SmolLM2 ranks on two cores cost most of a
# minute of the suite's 25.
@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_smollm2_tp3_decode_equals_the_single_engine_as_sequences_join_and_leave(kind, smollm, closing):
    kind = device_kind_or_skip(kind, 3)
    # The reference on the CPU in float32 whatever the TP ranks run on: it is the exact answer.
    reference = Engine(smollm, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    tp_engine = start_tp(None, 3, kind)
    closing.append(tp_engine)
    assert tp_engine.layout == reference.layout, "the TP engine reports the whole model's KV layout"
    assert_same_decode(reference, tp_engine)


def test_tiny_tp4_with_replicated_kv_heads_equals_the_single_engine(tiny, closing) -> None:
    reference = Engine(tiny, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    tp_engine = start_tp("tiny", 4, "cpu")
    closing.append(tp_engine)
    assert tp_engine.layout.fingerprint() == reference.layout.fingerprint()
    assert_same_decode(reference, tp_engine)
    # closing unmaps the leader's shared-memory collectives (the followers' go with their processes)
    group = tp_engine._leader.loaded.shard.group
    assert isinstance(group, HostGroup) and not group._segment.closed
    tp_engine.close()
    assert group._segment.closed


def test_killed_follower_makes_the_next_step_raise_unavailable(tiny, closing) -> None:
    reference = Engine(tiny, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    tp_engine = start_tp("tiny", 2, "cpu", timeout_s=5.0)
    closing.append(tp_engine)
    tokens = list(range(1, 9))
    reference.prefill("x", tokens)
    kv = reference.export_sequence("x").cpu()
    tp_engine.adopt_sequence("x", kv, len(tokens))
    tp_engine.decode_step(["x"], [3])
    os.kill(tp_engine.follower_pids[0], signal.SIGKILL)
    with pytest.raises(Unavailable, match="tensor-parallel group failed"):
        tp_engine.decode_step(["x"], [4])
    with pytest.raises(Unavailable):
        tp_engine.decode_step(["x"], [5])
    tp_engine.free("x")
