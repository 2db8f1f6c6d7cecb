"""A model described from its header alone (what start-up checks and KV fingerprints need) is the model
load_model builds: the same architecture and model id, for the embedded GGUF, tiny and an HF folder."""

import pytest
import torch

from pcpstack.engine.weights import describe_model, load_model

transformers = pytest.importorskip("transformers")


def test_the_embedded_gguf_is_described_as_it_loads(smollm):
    described = describe_model(None)
    assert described.args == smollm.full_args
    assert described.model_id == smollm.model_id


def test_tiny_and_a_hugging_face_folder_are_described_as_they_load(tmp_path):
    config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for model in ("tiny", str(tmp_path)):
        loaded = load_model(model, device="cpu", dtype=torch.float32)
        described = describe_model(model)
        assert (described.args, described.model_id) == (loaded.full_args, loaded.model_id), model
