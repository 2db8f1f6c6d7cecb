"""Fixtures for end-to-end tests: whole local stacks of real processes, and HF transformers as reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import RunningStack, hf_greedy, hf_smollm2, start_stack


@pytest.fixture(scope="session")
def hf_reference():
    """greedy(prompt_ids, n) -> n token ids from HF transformers on the same GGUF (eos ignored)."""
    return hf_greedy(hf_smollm2())


@pytest.fixture(scope="module")
def smollm_stack_pcp2(tmp_path_factory) -> Iterator[RunningStack]:
    stack = start_stack(tmp_path_factory.mktemp("stack-pcp2"), pcp=2)
    yield stack
    stack.stop()
