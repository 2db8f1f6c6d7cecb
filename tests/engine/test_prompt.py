"""The one prompt check (engine.prompt): each rule refuses with InvalidArgument naming field and rule."""

from __future__ import annotations

import pytest

from pcpstack.common.errors import InvalidArgument
from pcpstack.engine.prompt import PromptLimits, check_prompt, check_sampling, check_token_ids
from pcpstack.v1 import common_pb2

LIMITS = PromptLimits(vocab_size=100, max_seq_len=10)


def test_valid_prompt_comes_back_as_ids_and_typed_sampling() -> None:
    ids, params = check_prompt((1, 2, 99), common_pb2.SamplingParams(max_tokens=7, top_k=5), LIMITS)
    assert ids == [1, 2, 99]
    assert (params.max_tokens, params.top_k, params.top_p) == (7, 5, 1.0)


@pytest.mark.parametrize(
    ("ids", "max_tokens", "message"),
    [
        ([], 1, "prompt.ids: the prompt is empty"),
        ([3, 100], 1, "prompt.ids[1]=100 is not below the vocabulary size 100"),
        ([1] * 11, 1, "prompt.ids: 11 tokens exceed the model context of 10 tokens"),
        ([1] * 6, 5, "sampling.max_tokens=5 with 6 prompt tokens exceeds the model context of 10 tokens"),
    ],
)
def test_each_rule_names_the_field(ids: list[int], max_tokens: int, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_token_ids(ids, LIMITS, field="prompt.ids", max_tokens=max_tokens)
    assert message in str(info.value)


def test_prefill_checks_the_prompt_alone_against_the_context() -> None:
    # Prefill samples one token: a prompt that fills the context is fine there, not for decode's max_tokens.
    wire = common_pb2.SamplingParams(max_tokens=5)
    assert len(check_prompt([1] * 10, wire, LIMITS, generates=False)[0]) == 10
    with pytest.raises(InvalidArgument) as info:
        check_prompt([1] * 10, wire, LIMITS)
    assert "sampling.max_tokens=5" in str(info.value)


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        (common_pb2.SamplingParams(max_tokens=0), "sampling.max_tokens=0"),
        (common_pb2.SamplingParams(max_tokens=1, temperature=-1), "sampling.temperature=-1"),
        (common_pb2.SamplingParams(max_tokens=1, top_p=1.5), "sampling.top_p=1.5"),
    ],
)
def test_bad_sampling_is_invalid_argument_naming_the_field(wire, field: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_sampling(wire)
    assert field in str(info.value)


def test_unset_max_tokens_takes_the_default_when_one_is_given() -> None:
    assert check_sampling(common_pb2.SamplingParams(), default_max_tokens=1).max_tokens == 1
