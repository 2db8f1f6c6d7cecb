"""Shared fixtures for the engine tests: the embedded SmolLM2 in this engine and in Hugging Face transformers
(each loaded once per session; the transformers copy is the e2e tests' too), and the tiny random model."""

import pytest
import torch

from pcpstack.engine.engine import Engine
from pcpstack.engine.weights import LoadedModel, default_model_path, load_model
from tests.helpers import hf_smollm2


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model(None, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm_engine(smollm: LoadedModel) -> Engine:
    return Engine(smollm, block_size=16, num_blocks=1024)


@pytest.fixture(scope="session")
def hf_model():
    pytest.importorskip("transformers")
    return hf_smollm2()


@pytest.fixture(scope="session")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny", device="cpu", dtype=torch.float32)


@pytest.fixture
def tiny_engine(tiny: LoadedModel) -> Engine:
    return Engine(tiny, block_size=4, num_blocks=256)


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """Reference logits [n, vocab] of every position from Hugging Face transformers."""
    with torch.inference_mode():
        return hf_model(torch.tensor([token_ids])).logits[0]


def engine_logits(engine: Engine, token_ids: list[int]) -> torch.Tensor:
    """Logits [n, vocab] of every position from a one-shot prefill in this engine (KV freed after)."""
    seq_id = object()
    state = engine.reserve(seq_id, len(token_ids))
    try:
        with torch.inference_mode():
            return engine.forward_tokens(state, token_ids, start=0, all_logits=True)
    finally:
        engine.free(seq_id)
