"""The tensor-parallel foundation without processes: the set's rank layout, each TP rank's share of the heads
and intermediate dimension, the refusals of splits that do not divide, the sliced weights, the single-rank
model's untouched path, and the per-rank device choice."""

from __future__ import annotations

import pytest
import torch

from pcpstack.engine.config import ModelArgs
from pcpstack.engine.device import accelerator_count, device_for_rank
from pcpstack.engine.parallel import (
    SINGLE_RANK,
    ParallelLayout,
    TensorParallelShard,
    distributed_backend,
    kv_fetch_plan,
    stored_kv_shards,
    tensor_parallel_sum,
)
from pcpstack.engine.weights import LoadedModel, load_model, shard_state

SMOLLM2_SHAPE = dict(n_heads=9, n_kv_heads=3, head_dim=64, dim=576, hidden_dim=1536)


def args_with(**overrides: int) -> ModelArgs:
    base = dict(vocab_size=32, n_layers=1, **SMOLLM2_SHAPE)
    base.update(overrides)
    return ModelArgs(**base)


def shard(rank: int, size: int) -> TensorParallelShard:
    # Head ranges and refusals need no process group.
    return TensorParallelShard(rank, size)


def test_global_rank_is_pcp_rank_times_tp_size_plus_tp_rank() -> None:
    layout = ParallelLayout(tp_size=3, pcp_size=2)
    assert layout.world_size == 6
    assert [layout.global_rank(p, t) for p in range(2) for t in range(3)] == list(range(6))
    assert [layout.coordinates(g) for g in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_tp_groups_are_consecutive_and_pcp_groups_strided() -> None:
    layout = ParallelLayout(tp_size=3, pcp_size=2)
    assert [layout.tp_group_ranks(p) for p in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert [layout.pcp_group_ranks(t) for t in range(3)] == [[0, 3], [1, 4], [2, 5]]


def test_layout_refuses_ranks_outside_it() -> None:
    layout = ParallelLayout(tp_size=2, pcp_size=2)
    with pytest.raises(ValueError, match="outside"):
        layout.global_rank(2, 0)
    with pytest.raises(ValueError, match="outside"):
        layout.coordinates(4)
    with pytest.raises(ValueError, match="tp_size=0"):
        ParallelLayout(tp_size=0, pcp_size=1)


def test_tp3_gives_each_rank_three_query_heads_one_kv_head_and_a_third_of_the_mlp() -> None:
    args = args_with()
    for rank in range(3):
        s = shard(rank, 3)
        assert s.head_range(args) == range(3 * rank, 3 * rank + 3)
        assert s.kv_head_range(args) == range(rank, rank + 1)
        assert s.hidden_range(args) == range(512 * rank, 512 * rank + 512)
        local = s.local_args(args)
        assert (local.n_heads, local.n_kv_heads, local.hidden_dim, local.dim) == (3, 1, 512, 576)


def test_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    args = args_with(n_heads=4, n_kv_heads=2, head_dim=16, dim=64, hidden_dim=128)
    # Query head h reads K/V head h // 2: ranks 0, 1 hold heads 0, 1 (K/V head 0); ranks 2, 3 hold K/V head 1.
    assert [shard(r, 4).kv_head_range(args) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    assert [shard(r, 4).head_range(args) for r in range(4)] == [range(r, r + 1) for r in range(4)]


def test_num_heads_not_divisible_by_tp_is_refused_naming_both_numbers() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide .*num_attention_heads=9"):
        shard(0, 2).local_args(args_with())


def test_kv_heads_neither_dividing_nor_divided_by_tp_are_refused() -> None:
    args = args_with(n_heads=12, n_kv_heads=3, head_dim=16, dim=64, hidden_dim=128)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .*num_key_value_heads=3"):
        shard(0, 4).local_args(args)


def test_intermediate_size_not_divisible_by_tp_is_split_in_near_equal_slices_covering_it_once() -> None:
    # SmolLM2 at TP=9 (its decode with DCP=3): 1536 columns in slices of 170 and 171.
    args = args_with(hidden_dim=1536)
    slices = [shard(rank, 9).hidden_range(args) for rank in range(9)]
    assert [c for s in slices for c in s] == list(range(1536))
    assert {len(s) for s in slices} == {170, 171}
    assert shard(8, 9).local_args(args).hidden_dim == len(slices[8])


def test_loading_a_multi_rank_shard_without_its_group_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=2: a TP shard needs its TP process group"):
        load_model("tiny", device="cpu", shard=TensorParallelShard(0, 2))


def test_a_rank_outside_its_tp_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rank=2 must lie in \[0, size=2\)"):
        TensorParallelShard(2, 2)


def test_tp_shards_of_the_fused_weights_reassemble_the_whole_weights(tiny: LoadedModel) -> None:
    args = tiny.args
    state = tiny.model.state_dict()
    shards = [shard_state(state, args, shard(r, 2)) for r in range(2)]
    hd, q_dim, kv_dim = args.head_dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    for i in range(args.n_layers):
        wqkv = state[f"layers.{i}.attention.wqkv.weight"]
        parts = [s[f"layers.{i}.attention.wqkv.weight"] for s in shards]
        local_q, local_kv = q_dim // 2, kv_dim // 2
        assert torch.equal(torch.cat([p[:local_q] for p in parts]), wqkv[:q_dim])
        assert torch.equal(torch.cat([p[local_q : local_q + local_kv] for p in parts]), wqkv[q_dim:-kv_dim])
        assert torch.equal(torch.cat([p[local_q + local_kv :] for p in parts]), wqkv[-kv_dim:])
        wo = torch.cat([s[f"layers.{i}.attention.wo.weight"] for s in shards], dim=1)
        assert torch.equal(wo, state[f"layers.{i}.attention.wo.weight"])
        w2 = torch.cat([s[f"layers.{i}.feed_forward.w2.weight"] for s in shards], dim=1)
        assert torch.equal(w2, state[f"layers.{i}.feed_forward.w2.weight"])
        assert parts[0].shape == (local_q + 2 * local_kv, args.dim) and hd * 2 == local_q
    for name in ("tok_embeddings.weight", "norm.weight", "layers.0.attention_norm.weight"):
        assert all(torch.equal(s[name], state[name]) for s in shards), f"{name} is not replicated"


def test_single_rank_model_has_no_tp_group_and_keeps_its_decode_blocks() -> None:
    loaded = load_model(None, device="cpu", dtype=torch.float32)
    assert loaded.shard == SINGLE_RANK and loaded.args == loaded.full_args
    layers = loaded.model.layers
    assert all(layer.attention.tp_group is None and layer.feed_forward.tp_group is None for layer in layers)
    # The quantized C decode kernels still serve every projection of the single-rank model.
    assert all(layer.attention.wqkv.blocks is not None for layer in loaded.model.layers)


def test_tensor_parallel_sum_without_a_group_returns_its_input_itself() -> None:
    partial = torch.randn(3, 4)
    assert tensor_parallel_sum(partial, None) is partial


def test_each_device_kind_uses_its_collective_backend() -> None:
    kinds = [distributed_backend(k) for k in ("cpu", "cuda:1", "npu:0")]
    assert kinds == ["gloo", "nccl", "hccl"]
    assert distributed_backend(torch.device("cpu")) == "gloo"


def test_cpu_ranks_all_run_on_the_cpu() -> None:
    assert {device_for_rank(i, "cpu") for i in range(4)} == {torch.device("cpu")}


def test_a_local_rank_beyond_the_visible_gpus_is_refused_with_the_numbers() -> None:
    present = accelerator_count("cuda")
    expected = rf"local rank {present} needs cuda device {present}, .* sees {present}"
    with pytest.raises(ValueError, match=expected):
        device_for_rank(present, "cuda")


def test_local_ranks_take_consecutive_visible_gpus() -> None:
    present = accelerator_count("cuda")
    if present < 2:
        reason = f"cuda: 2 visible GPUs needed, {present} present"
        print(f"skipped: {reason}")
        pytest.skip(reason)
    assert [device_for_rank(i, "cuda") for i in range(2)] == [torch.device("cuda", i) for i in range(2)]


def test_a_tp_group_stores_each_kv_head_once_even_when_replicated() -> None:
    smollm2 = args_with()
    assert stored_kv_shards(smollm2, 3) == [(0, range(0, 1)), (1, range(1, 2)), (2, range(2, 3))]
    assert stored_kv_shards(smollm2, 1) == [(0, range(0, 3))]
    # tiny at TP=4: ranks 0, 1 both hold K/V head 0 and ranks 2, 3 head 1; ranks 0 and 2 store them.
    tiny_shape = args_with(n_heads=4, n_kv_heads=2, head_dim=16, dim=64, hidden_dim=128)
    assert stored_kv_shards(tiny_shape, 4) == [(0, range(0, 1)), (2, range(1, 2))]


def test_decode_ranks_fetch_only_their_heads_from_a_replica_of_another_tp() -> None:
    args = args_with()
    # Prefill TP=3 into decode TP=1: the one decode rank reads every stored shard.
    assert kv_fetch_plan(args, 3, shard(0, 1)) == [(0, range(0, 1)), (1, range(1, 2)), (2, range(2, 3))]
    # Prefill TP=1 into decode TP=3: each decode rank reads its own head out of the single shard.
    for r in range(3):
        assert kv_fetch_plan(args, 1, shard(r, 3)) == [(0, range(r, r + 1))]
    # Same TP on both sides: rank r reads exactly stored shard r.
    for r in range(3):
        assert kv_fetch_plan(args, 3, shard(r, 3)) == [(r, range(r, r + 1))]


def test_a_fetch_plan_for_a_decode_tp_the_model_cannot_split_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide"):
        kv_fetch_plan(args_with(), 3, shard(0, 2))
