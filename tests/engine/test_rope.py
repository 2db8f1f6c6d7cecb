"""RoPE scaling as GGUF files state it: a linear factor in the metadata, or llama3's per-frequency divisors as
a `rope_freqs` tensor (what llama.cpp's converter writes for Llama 3.1). Both must give the frequencies the
same checkpoint's config.json gives (checked against transformers in test_hf_folder.py)."""

import pytest
import torch

from pcpstack.engine.rope import RopeScaling

HEAD_DIM, THETA = 64, 500000.0


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
