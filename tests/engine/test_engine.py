"""The engine runner on the tiny model: generation, continuous batching, replicas and block accounting."""

import pytest
import torch

from pcpstack.engine.config import ModelArgs
from pcpstack.engine.device import default_dtype, pick_device
from pcpstack.engine.engine import Engine
from pcpstack.engine.kv_cache import OutOfBlocksError
from pcpstack.engine.sampling import SamplingParams
from pcpstack.engine.weights import load_model


def test_cpu_machine_picks_cpu_and_fp32():
    assert pick_device().type == "cpu"
    assert default_dtype(torch.device("cpu")) == torch.float32
    assert default_dtype(torch.device("cuda")) == torch.bfloat16


def test_model_args_refuse_heads_not_divisible_by_kv_heads():
    with pytest.raises(ValueError, match="n_heads=4 must be a multiple of n_kv_heads=3"):
        ModelArgs(vocab_size=8, dim=8, n_layers=1, n_heads=4, n_kv_heads=3, head_dim=2, hidden_dim=8)


def test_tiny_model_reloads_with_same_id_and_weights(tiny):
    again = load_model("tiny", device="cpu")
    assert again.model_id == tiny.model_id and len(tiny.model_id) == 16
    torch.testing.assert_close(again.model.state_dict(), tiny.model.state_dict(), rtol=0, atol=0)


def test_tiny_tokenizer_round_trips_text(tiny):
    assert tiny.tokenizer.decode(tiny.tokenizer.encode("héllo <|im_end|>")) == "héllo <|im_end|>"


def test_generate_is_reproducible_with_a_seed(tiny_engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    first = tiny_engine.generate([1, 2, 3], params)
    assert tiny_engine.generate([1, 2, 3], params).token_ids == first.token_ids
    assert len(first.token_ids) == 12 and first.finish_reason == "length"


def test_generate_frees_its_blocks(tiny_engine):
    free = tiny_engine.allocator.num_free
    tiny_engine.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    assert tiny_engine.allocator.num_free == free and not tiny_engine.sequences


def test_decode_batch_can_change_between_steps(tiny_engine):
    prompts = {"a": [5, 6, 7], "b": [8, 9, 10, 11, 12, 13], "c": [14]}
    alone = {}
    for seq, ids in prompts.items():
        tiny_engine.prefill(("alone", seq), ids)
        alone[seq] = [tiny_engine.decode_step([("alone", seq)], [t])[0] for t in (20, 21, 22)]
    for seq, ids in prompts.items():
        tiny_engine.prefill(seq, ids)
    step1 = tiny_engine.decode_step(["a", "b"], [20, 20])
    step2 = tiny_engine.decode_step(["c", "a", "b"], [20, 21, 21])
    step3 = tiny_engine.decode_step(["b", "c"], [22, 21])
    torch.testing.assert_close(step1, torch.stack([alone["a"][0], alone["b"][0]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        step2, torch.stack([alone["c"][0], alone["a"][1], alone["b"][1]]), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(step3, torch.stack([alone["b"][2], alone["c"][1]]), atol=1e-5, rtol=0)


def test_adopted_replica_decodes_like_the_original(tiny_engine, tiny):
    tiny_engine.prefill("origin", list(range(30, 50)))
    replica = tiny_engine.export_sequence("origin")
    other = Engine(tiny, block_size=4, num_blocks=64)
    other.allocator.allocate(3)  # different block ids on the receiving side
    other.adopt_sequence("copy", replica, num_tokens=20)
    torch.testing.assert_close(other.decode_step(["copy"], [7]), tiny_engine.decode_step(["origin"], [7]))


def test_a_replica_adopted_in_pieces_equals_one_adopted_whole(tiny_engine, tiny):
    tiny_engine.prefill("origin", list(range(60, 83)))
    replica = tiny_engine.export_sequence("origin")
    whole, pieces = Engine(tiny, block_size=4, num_blocks=64), Engine(tiny, block_size=4, num_blocks=64)
    pieces.allocator.allocate(5)  # other block ids
    whole.adopt_sequence("s", replica, num_tokens=23)
    # piece edges inside a block and on one (tokens 0-6, 7-7, 8-22)
    pieces.adopt_sequence("s", [replica[:, :, :7], replica[:, :, 7:8], replica[:, :, 8:]], num_tokens=23)
    assert torch.equal(pieces.export_sequence("s"), whole.export_sequence("s"))
    with pytest.raises(ValueError, match="holds 22 tokens, not num_tokens=23"):
        pieces.adopt_sequence("t", [replica[:, :, :7], replica[:, :, 8:]], num_tokens=23)


def test_prefill_out_of_blocks_raises_clear_error(tiny):
    engine = Engine(tiny, block_size=4, num_blocks=2)
    with pytest.raises(OutOfBlocksError, match="need 3, 2 free"):
        engine.prefill("long", list(range(12)))


def test_decode_of_unknown_sequence_is_refused(tiny_engine):
    with pytest.raises(KeyError, match="prefill or adopt"):
        tiny_engine.decode_step(["ghost"], [1])


def test_prompt_longer_than_context_is_refused(tiny_engine):
    with pytest.raises(ValueError, match="exceeds the context length 4096"):
        tiny_engine.prefill("huge", [1] * 4097)
