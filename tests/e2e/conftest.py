"""Fixtures for end-to-end tests: whole local stacks of real processes, and HF transformers as reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import RunningStack, hf_greedy, start_stack


@pytest.fixture(scope="session")
def hf_reference():
    """greedy(prompt_ids, n) -> n token ids from HF transformers on the same GGUF (eos ignored)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pcpstack.engine.weights import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return hf_greedy(model.eval())


@pytest.fixture(scope="module")
def smollm_stack_pcp2(tmp_path_factory) -> Iterator[RunningStack]:
    stack = start_stack(tmp_path_factory.mktemp("stack-pcp2"), pcp=2)
    yield stack
    stack.stop()
