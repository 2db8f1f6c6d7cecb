"""RoPE scaling as GGUF files state it: a linear factor in the metadata, or llama3's per-frequency divisors as
a `rope_freqs` tensor (what llama.cpp's converter writes for Llama 3.1). Both must give the frequencies the
same checkpoint's config.json gives (checked against transformers in test_hf_folder.py).

Dynamic NTK scaling (config.json only: GGUF has no such type): its frequencies at each length equal
transformers', and sequences of different lengths prefilled in one batched forward and decoded together, the
frequencies changing under them at every step, equal a fresh transformers generation of each alone; decode
split over DCP=2 ranks (each counting only its own keys) equals the single engine."""

import copy

import pytest
import torch

from pcpstack.engine.engine import Engine
from pcpstack.engine.rope import RopeScaling
from pcpstack.engine.tp_engine import TensorParallelEngine
from pcpstack.engine.weights import load_model
from pcpstack.prefill.batch import BatchSplit, prefill_batch
from tests.helpers import hf_generation, small_hf_llama

HEAD_DIM, THETA = 64, 500000.0
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


def freqs(scaling: RopeScaling) -> torch.Tensor:
    return scaling.inv_frequencies(HEAD_DIM, THETA)


def test_gguf_linear_factor_gives_the_config_json_frequencies():
    from_gguf = RopeScaling.from_gguf(
        {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, "llama", None
    )
    from_hf = RopeScaling.from_hf({"rope_scaling": {"rope_type": "linear", "factor": 4.0}})
    torch.testing.assert_close(freqs(from_gguf), freqs(from_hf))
    assert not torch.equal(freqs(from_gguf), freqs(RopeScaling()))


def test_gguf_rope_freqs_divisors_give_the_llama3_frequencies():
    llama3 = RopeScaling.from_hf(
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        }
    )
    plain = freqs(RopeScaling())
    divisors = plain / freqs(llama3)
    assert divisors.min() == pytest.approx(1.0) and divisors.max() == pytest.approx(8.0)
    from_gguf = RopeScaling.from_gguf({}, "llama", divisors)
    torch.testing.assert_close(freqs(from_gguf), freqs(llama3))


def test_unsupported_scalings_are_refused_by_name():
    with pytest.raises(ValueError, match=r"rope\.scaling\.type='yarn' is not supported"):
        RopeScaling.from_gguf({"llama.rope.scaling.type": "yarn"}, "llama", None)
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported"):
        RopeScaling.from_hf({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(ValueError, match="rope_freqs has 3 values; head_dim=64 needs 32"):
        freqs(RopeScaling.from_gguf({}, "llama", torch.ones(3)))


def test_dynamic_frequencies_equal_transformers_at_each_length():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters

    context = 4096
    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=context,
        rope_parameters={**DYNAMIC, "rope_theta": THETA},
    )
    scaling = RopeScaling.from_hf(config.to_dict())
    assert scaling.kind == "dynamic" and scaling.served_context(context) == 2 * context
    lengths = [1, context, context + 1, 5000, 3 * context + 7]
    ours = scaling.frequencies_by_length(
        torch.tensor(lengths), scaling.inv_frequencies(HEAD_DIM, THETA), HEAD_DIM, THETA
    )
    for row, length in zip(ours, lengths, strict=True):
        # transformers' forward passes the length as a tensor: float32 arithmetic, as ours.
        expected, _ = _compute_dynamic_ntk_parameters(config, seq_len=torch.tensor(length))
        torch.testing.assert_close(row, expected, rtol=1e-6, atol=0, msg=f"length {length}")
    assert torch.equal(ours[0], ours[1]) and not torch.allclose(ours[1], ours[2], rtol=1e-6, atol=0)


def test_dynamic_rope_batch_of_two_lengths_equals_fresh_transformers_generation_of_each(tmp_path):
    pytest.importorskip("transformers")
    # max_position_embeddings 32: the 40-token prompt starts beyond it, the 20-token one crosses it while
    # decoding. A wider init than transformers' 0.02 makes RoPE errors show in the logits (see below).
    reference = small_hf_llama(tmp_path, context=32, rope_parameters=DYNAMIC, initializer_range=0.1)
    lengths, steps = (40, 20), 16
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]
    expected = [hf_generation(copy.deepcopy(reference), ids, steps) for ids in prompts]
    # The check can fail: rotating every token by the final length (one forward) gives other logits.
    tokens, logits = expected[0]
    with torch.inference_mode():
        one_forward = reference(torch.tensor([prompts[0] + tokens[:-1]])).logits[0, lengths[0] - 1 :]
    assert (one_forward - logits).abs().max() > 1e-2

    model = load_model(tmp_path, device="cpu", dtype=torch.float32)
    assert model.args.max_seq_len == 64  # factor x max_position_embeddings
    engine = Engine(model, block_size=16, num_blocks=8)
    states = [engine.reserve(i, n) for i, n in enumerate(lengths)]
    split = BatchSplit(lengths, 1)
    with torch.inference_mode():
        rows = [prefill_batch(engine, states, [torch.tensor(p) for p in prompts], split, 0, None)]
        while len(rows) < steps:
            rows.append(engine.decode_step([0, 1], [int(row.argmax()) for row in rows[-1]]))
    for i, (tokens, logits) in enumerate(expected):
        ours = torch.stack([row[i] for row in rows])
        torch.testing.assert_close(ours, logits, atol=1e-5, rtol=0, msg=f"sequence of {lengths[i]}")
        assert ours.argmax(-1).tolist() == tokens


def test_dynamic_rope_dcp2_decode_equals_the_single_engine(tmp_path):
    """A DCP rank's step counts only its own keys: the frequencies must still follow the whole length."""
    pytest.importorskip("transformers")
    # One K/V head over TP=2: DCP=2 splits its tokens between the two ranks.
    small_hf_llama(tmp_path, heads=2, kv_heads=1, context=32, rope_parameters=DYNAMIC, initializer_range=0.1)
    reference = Engine(load_model(tmp_path, device="cpu", dtype=torch.float32), block_size=4, num_blocks=32)
    lengths = {"below": 20, "beyond": 40}
    generator = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    dcp = TensorParallelEngine.start(
        tmp_path, 2, dtype=torch.float32, block_size=4, num_blocks=32, timeout_s=60.0, threads=1, dcp_size=2
    )
    try:
        tokens = {}
        for name, n in lengths.items():
            ids = torch.randint(0, 256, (n,), generator=generator).tolist()
            tokens[name] = int(reference.prefill(name, ids).argmax())
            dcp.adopt_sequence(name, reference.export_sequence(name), n)
        for step in range(16):
            names = list(tokens)
            expected = reference.decode_step(names, [tokens[n] for n in names])
            got = dcp.decode_step(names, [tokens[n] for n in names])
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=f"step {step}")
            tokens = dict(zip(names, expected.argmax(-1).tolist(), strict=True))
    finally:
        dcp.close()
        torch.set_num_threads(threads)
