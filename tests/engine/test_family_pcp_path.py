"""Every served family through the whole PCP=2 path equals transformers, from its HF folder and from its GGUF.

Small random models built with transformers' own config classes (plain Llama, Llama 3.x scaled RoPE, linear,
YaRN and dynamic NTK RoPE, Qwen2 with q/k/v biases, Mistral) are saved as HF folders and, where llama.cpp's
format has the feature, converted to F32 GGUF. One spawn of a real 2-process gloo group prefills a 37-token
prompt with every model in turn, in chunks of 16 tokens split by DualChunkSwap (so each chunk puts tokens on
both ranks), each rank ending with the complete KV replica. A decode engine here then adopts the replica of
the rank the request id selects, as a decode worker does, and generates 16 greedy tokens. The first token's
logits and every decode step's are within 1e-4 of those of a fresh transformers generation, and the 16
tokens are its greedy ones. The dynamic model's max_position_embeddings (32) is below the prompt's length,
so its frequencies are the whole prompt's on both ranks and in every chunk, then change at every decode
step.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pcpstack.engine.engine import Engine
from pcpstack.engine.kv_cache import blocks_needed
from pcpstack.engine.weights import load_model
from pcpstack.prefill.context_parallel import chunk_bounds
from pcpstack.prefill.replica import replica_owner
from pcpstack.prefill.split import DualChunkSplit
from tests.engine.test_gguf_families import LLAMA3, SMALL, hf_folder_to_gguf
from tests.engine.test_hf_folder import ROPE_SCALINGS
from tests.helpers import hf_generation
from tests.prefill.cp_harness import BLOCK_SIZE, prefill_models, run_group

transformers = pytest.importorskip("transformers")

PCP = 2
TOL = 1e-4
PROMPT_TOKENS = 37
CHUNK_TOKENS = 16
GREEDY_TOKENS = 16
REQUEST_ID = "family-parity"
LINEAR = {**ROPE_SCALINGS["linear"], "rope_theta": 10000.0}
YARN = {**ROPE_SCALINGS["yarn"], "rope_theta": 10000.0}
# Beyond 32 positions the frequencies follow the sequence's length; the wider init (transformers' is 0.02)
# makes logits tell the lengths apart by far more than TOL.
DYNAMIC = {
    "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    "max_position_embeddings": 32,
    "initializer_range": 0.1,
}
# config class, GGUF architecture (None: llama.cpp's format has no such model), config extras.
CASES = {
    "llama": ("LlamaConfig", "llama", {"rope_theta": 500000.0}),
    "llama3-rope": ("LlamaConfig", "llama", {"rope_parameters": LLAMA3}),
    "linear-rope": ("LlamaConfig", "llama", {"rope_parameters": LINEAR}),
    # llama.cpp's GGUF declares YaRN with keys this engine refuses (the HF folder is the served form).
    "yarn-rope": ("LlamaConfig", None, {"rope_parameters": YARN}),
    # llama.cpp's GGUF has no dynamic scaling type: such a model is served from its HF folder only.
    "dynamic-rope": ("LlamaConfig", None, DYNAMIC),
    "qwen2-biases": ("Qwen2Config", "qwen2", {}),
    # Mistral converts to llama.cpp's `llama` architecture: its GGUF is the Llama case.
    "mistral": ("MistralConfig", None, {"sliding_window": None}),
}


def _decode_from_replica(
    path: Path, replica: torch.Tensor, first: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits [GREEDY_TOKENS - 1, vocab] of each decode step, from the adopted
    replica of a PCP prefill whose first-token logits are `first`."""
    engine = Engine(
        load_model(path, device="cpu", dtype=torch.float32),
        block_size=BLOCK_SIZE,
        num_blocks=blocks_needed(PROMPT_TOKENS + GREEDY_TOKENS, BLOCK_SIZE),
    )
    engine.adopt_sequence(REQUEST_ID, replica, PROMPT_TOKENS)
    tokens, steps = [int(first.argmax())], []
    with torch.inference_mode():
        while len(tokens) < GREEDY_TOKENS:
            steps.append(engine.decode_step([REQUEST_ID], [tokens[-1]])[0])
            tokens.append(int(steps[-1].argmax()))
    return tokens, torch.stack(steps)


def _save_family_model(case: str, folder: Path) -> tuple[torch.nn.Module, list[Path]]:
    """transformers' random model of a case (fixed seed) and where it is saved under folder: its HF folder,
    then its GGUF when llama.cpp's format has the case."""
    config_class, arch, extra = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SMALL, **extra})
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(folder / case)
    if arch is None:
        return reference, [folder / case]
    hf_folder_to_gguf(folder / case, folder / f"{case}.gguf", arch)
    return reference, [folder / case, folder / f"{case}.gguf"]


def _prompt() -> list[int]:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, SMALL["vocab_size"], (PROMPT_TOKENS,), generator=generator).tolist()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """This process's torch threads at 1 for the test, restored after: these models are too small to share
    out, and a second thread spinning beside other busy processes made each decode step 50x slower here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_every_family_through_pcp2_prefill_and_decode_equals_transformers(tmp_path, one_thread) -> None:
    references, paths = {}, []
    for case in CASES:
        references[case], forms = _save_family_model(case, tmp_path)
        paths.extend((case, path) for path in forms)
    ids = _prompt()

    ranks = run_group(PCP, prefill_models, [str(path) for _, path in paths], ids, CHUNK_TOKENS)

    owner = replica_owner(REQUEST_ID, PCP)
    last_chunk = chunk_bounds(PROMPT_TOKENS, CHUNK_TOKENS)[-1]
    first_owner = DualChunkSplit(len(last_chunk), PCP).last_position_owner()
    for i, (case, path) in enumerate(paths):
        reference, where = references[case], f"{case} from {path.name}"
        first, replica = ranks[first_owner][i][0], ranks[owner][i][1]
        assert first is not None and ranks[1 - first_owner][i][0] is None, where
        assert torch.equal(ranks[0][i][1], ranks[1][i][1]), f"{where}: the ranks' replicas differ"
        tokens, steps = _decode_from_replica(path, replica, first)
        # A copy that has run nothing: dynamic RoPE keeps the longest length a transformers model has seen.
        expected_tokens, expected = hf_generation(copy.deepcopy(reference), ids, GREEDY_TOKENS)
        prefill_err = (first - expected[0]).abs().max().item()
        assert prefill_err <= TOL, f"{where}: first-token logits differ by {prefill_err}"
        decode_err = (steps - expected[1:]).abs().max().item()
        assert decode_err <= TOL, f"{where}: decode logits differ by {decode_err}"
        assert tokens == expected_tokens, f"{where}: greedy tokens differ"
