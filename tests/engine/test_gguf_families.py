"""GGUF files of each served family, converted here from transformers' own random models with the `gguf`
package's writer the way llama.cpp's converter lays them out, load and run exactly as transformers runs the
originals: Llama (q/k rows permuted for llama.cpp's interleaved RoPE), Llama 3.x scaled RoPE (as llama.cpp
writes it: per-frequency divisors in `rope_freqs.weight`), and Qwen2 (q/k/v biases, not permuted). Prefill
logits within 1e-4 of transformers', equal to the same model loaded from its HF folder, and 16 greedy
tokens equal. (Mistral checkpoints convert to the `llama` architecture in llama.cpp, so their GGUF is the
Llama case; SmolLM2's real GGUF runs through the whole PCP path in tests/e2e.)
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pcpstack.engine.engine import Engine
from pcpstack.engine.rope import RopeScaling
from pcpstack.engine.weights import load_model
from tests.engine.conftest import engine_logits, hf_logits
from tests.engine.test_hf_folder import SMALL as HF_SMALL
from tests.helpers import hf_greedy

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402  (after the skip: transformers brings it)

SMALL = {**HF_SMALL, "tie_word_embeddings": False}  # an untied LM head: `output.weight` is written too
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}
CASES = {
    "llama": ("LlamaConfig", "llama", {"rope_theta": 500000.0}),
    "llama3-rope": ("LlamaConfig", "llama", {"rope_parameters": LLAMA3}),
    "qwen2-biases": ("Qwen2Config", "qwen2", {}),
}


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half row order to llama.cpp's interleaved pairs (what its converter's `permute` does)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def hf_folder_to_gguf(folder: Path, path: Path, arch: str) -> None:
    """Writes the HF folder's model as an F32 GGUF of `arch` (llama or qwen2), with a byte-level tokenizer of
    the model's vocabulary size (these tests feed token ids, never text). RoPE scaling as llama.cpp writes
    it: llama3 as `rope_freqs.weight`, linear as its type and factor (yarn is not converted)."""
    config = json.loads((folder / "config.json").read_text())
    state = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_tokenizer_model("gpt2")
    # Distinct one-character tokens, and one merge (a BPE vocabulary has some) making the last token.
    tokens = [chr(c) for c in range(0x100, 0x100 + config["vocab_size"] - 1)]
    tokens.append(tokens[0] + tokens[1])
    writer.add_token_list(tokens)
    writer.add_token_types([1] * config["vocab_size"])
    writer.add_token_merges([f"{tokens[0]} {tokens[1]}"])
    writer.add_eos_token_id(config["vocab_size"] - 1)
    if rope.get("rope_type") == "llama3":
        # llama.cpp writes Llama 3's scaling as the divisor of each frequency.
        theta = rope["rope_theta"]
        base = RopeScaling().inv_frequencies(head_dim, theta)
        scaled = RopeScaling.from_hf(config).inv_frequencies(head_dim, theta)
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    elif rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    permute = arch == "llama"

    def put(name: str, tensor: torch.Tensor) -> None:
        writer.add_tensor(name, tensor.contiguous().numpy().astype(np.float32))

    put("token_embd.weight", state["model.embed_tokens.weight"])
    put("output_norm.weight", state["model.norm.weight"])
    put("output.weight", state["lm_head.weight"])
    for i in range(config["num_hidden_layers"]):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs, n in (
            ("attn_q", "q_proj", heads),
            ("attn_k", "k_proj", kv_heads),
            ("attn_v", "v_proj", 0),
        ):
            for kind in ("weight", "bias"):
                tensor = state.get(f"{hf}self_attn.{theirs}.{kind}")
                if tensor is not None:
                    put(f"{blk}{ours}.{kind}", _permute(tensor, n) if permute and n else tensor)
        put(f"{blk}attn_output.weight", state[f"{hf}self_attn.o_proj.weight"])
        put(f"{blk}attn_norm.weight", state[f"{hf}input_layernorm.weight"])
        put(f"{blk}ffn_norm.weight", state[f"{hf}post_attention_layernorm.weight"])
        put(f"{blk}ffn_gate.weight", state[f"{hf}mlp.gate_proj.weight"])
        put(f"{blk}ffn_up.weight", state[f"{hf}mlp.up_proj.weight"])
        put(f"{blk}ffn_down.weight", state[f"{hf}mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        tokens = [int(engine.prefill("greedy", prompt).argmax())]
        while len(tokens) < n:
            tokens.append(int(engine.decode_step(["greedy"], [tokens[-1]])[0].argmax()))
    engine.free("greedy")
    return tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_converted_from_transformers_runs_as_transformers_does(tmp_path, case) -> None:
    config_class, arch, extra = CASES[case]
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_class)(**SMALL, **extra)
    ).eval()
    folder, path = tmp_path / "hf", tmp_path / "model.gguf"
    reference.save_pretrained(folder)
    hf_folder_to_gguf(folder, path, arch)
    from_gguf = load_model(path, device="cpu", dtype=torch.float32)
    from_folder = load_model(folder, device="cpu", dtype=torch.float32)
    assert from_gguf.args.attention_bias == (arch == "qwen2")
    # 120 tokens: past the 64-token original context of the Llama 3 scaling, so every band is used.
    ids = torch.randint(0, 512, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    gguf_engine = Engine(from_gguf, num_blocks=16)
    ours = engine_logits(gguf_engine, ids)
    torch.testing.assert_close(ours, hf_logits(reference, ids), atol=1e-4, rtol=0)
    torch.testing.assert_close(
        ours, engine_logits(Engine(from_folder, num_blocks=16), ids), atol=1e-5, rtol=0
    )
    assert _greedy(gguf_engine, ids, 16) == hf_greedy(reference)(ids, 16)
