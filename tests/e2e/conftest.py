"""Fixtures for end-to-end tests: whole local stacks of real processes, and HF transformers as reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import RunningStack, start_stack


@pytest.fixture(scope="session")
def hf_reference():
    """greedy(prompt_ids, n) -> n token ids from HF transformers on the same GGUF (eos ignored)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pcpstack.engine.weights import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()

    def greedy(prompt_ids: list[int], n: int) -> list[int]:
        # A plain loop: generate(min_new_tokens=n) would forbid EOS; ignore_eos only goes on past it.
        tokens: list[int] = []
        with torch.inference_mode():
            out = model(torch.tensor([prompt_ids]), use_cache=True)
            for _ in range(n):
                tokens.append(int(out.logits[0, -1].argmax()))
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        return tokens

    return greedy


@pytest.fixture(scope="module")
def smollm_stack_pcp2(tmp_path_factory) -> Iterator[RunningStack]:
    stack = start_stack(tmp_path_factory.mktemp("stack-pcp2"), pcp=2)
    yield stack
    stack.stop()
