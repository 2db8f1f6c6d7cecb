"""Loading a Hugging Face model folder (config.json + *.safetensors): Llama, Qwen2 (q/k/v biases) and Mistral
configs, checked against transformers on small random models; tokenizer.json and the chat template too."""

import pytest
import torch

from pcpstack.common.errors import InvalidArgument
from pcpstack.engine.engine import Engine
from pcpstack.engine.prompt import PromptLimits, check_token_ids
from pcpstack.engine.tokenizer import Tokenizer
from pcpstack.engine.weights import load_model
from tests.engine.conftest import engine_logits, hf_logits

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


@pytest.mark.parametrize(
    ("config_class", "extra"),
    [
        ("LlamaConfig", {"tie_word_embeddings": False, "rope_theta": 500000.0}),
        ("Qwen2Config", {"tie_word_embeddings": True}),
        ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": None}),
    ],
)
def test_hf_folder_logits_match_transformers(tmp_path, config_class, extra):
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**SMALL, **extra)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32)
    if config_class == "Qwen2Config":
        assert loaded.args.attention_bias
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = engine_logits(Engine(loaded, num_blocks=16), ids)
    torch.testing.assert_close(ours, hf_logits(reference, ids), atol=1e-5, rtol=0)


# Context extension as Llama 3.1/3.2, linear interpolation and YaRN checkpoints declare it. The original
# context (64) is shorter than the prompt (120 tokens), so every branch of each scheme is exercised.
ROPE_SCALINGS = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "linear": {"rope_type": "linear", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("kind", sorted(ROPE_SCALINGS))
def test_scaled_rope_logits_match_transformers(tmp_path, kind):
    torch.manual_seed(0)
    rope = {**ROPE_SCALINGS[kind], "rope_theta": 10000.0}
    config = transformers.LlamaConfig(**SMALL, rope_parameters=rope)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, device="cpu", dtype=torch.float32)
    assert loaded.args.rope_scaling is not None and loaded.args.rope_scaling.kind == kind
    ids = torch.randint(0, 512, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = engine_logits(Engine(loaded, num_blocks=16), ids)
    torch.testing.assert_close(ours, hf_logits(reference, ids), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_tokenizer_json_folder_encodes_like_transformers(tmp_path, hf_tokenizer):
    hf_tokenizer.save_pretrained(tmp_path)
    ours = Tokenizer.from_hf_folder(tmp_path, eos_token_ids=[2])
    text = "<|im_start|>user\nNumbers 12345, café 🙂<|im_end|>\n"
    assert ours.encode(text) == hf_tokenizer(text).input_ids
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_mistral_sliding_window_caps_the_context_and_a_longer_prompt_is_refused_naming_it(tmp_path):
    # Attention past the window is not implemented (issue #23 allows refusing instead): the context is capped
    # at the window, within which sliding-window attention equals full attention.
    config = transformers.MistralConfig(**SMALL, tie_word_embeddings=False, sliding_window=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    args = load_model(tmp_path, device="cpu").args
    assert (args.sliding_window, args.max_seq_len) == (64, 64)
    limits = PromptLimits(args.vocab_size, args.max_seq_len, args.sliding_window)
    assert len(check_token_ids(list(range(60)), limits, max_tokens=4)) == 60
    with pytest.raises(
        InvalidArgument, match="exceed the model context of 64 tokens \\(its sliding attention"
    ):
        check_token_ids(list(range(65)), limits)
    with pytest.raises(InvalidArgument, match=r"sampling\.max_tokens=8 .* sliding attention window"):
        check_token_ids(list(range(60)), limits, max_tokens=8)
