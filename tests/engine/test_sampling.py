"""Sampling parameters, per-request seeded sampling and stop conditions."""

import pytest
import torch

from pcpstack.engine.sampling import SamplingParams, StopChecker, make_generator, sample, sample_batch
from pcpstack.engine.tokenizer import Tokenizer

LOGITS = torch.tensor([1.0, 3.0, 2.5, 0.5, 2.9])


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("max_tokens", 0, ">= 1"),
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), "finite"),
        ("top_k", -1, ">= 0"),
        ("top_p", 0.0, r"\(0, 1\]"),
        ("seed", -5, "2\\*\\*63"),
        ("stop", [""], "non-empty"),
    ],
)
def test_validate_names_the_field_and_rule(field, value, rule):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.*{rule}"):
        SamplingParams(**{field: value}).validate()


def test_greedy_takes_the_argmax():
    assert sample(LOGITS, SamplingParams(temperature=0), make_generator(0)) == 1


def test_top_k_1_is_greedy_at_any_temperature():
    params = SamplingParams(temperature=5.0, top_k=1)
    assert {sample(LOGITS, params, make_generator(s)) for s in range(30)} == {1}


def test_top_p_keeps_only_the_smallest_set_reaching_p():
    probs = LOGITS.softmax(-1)  # token 1 ~0.35, token 4 ~0.32, token 2 ~0.29
    params = SamplingParams(temperature=1.0, top_p=float(probs[1] + probs[4]) - 0.01)
    assert {sample(LOGITS, params, make_generator(s)) for s in range(200)} == {1, 4}


def test_seeded_request_is_independent_of_batch_mates():
    params = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=1.0, seed=99)]
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    alone = sample(logits[0], params[0], make_generator(11))
    assert sample_batch(logits, params, [make_generator(11), make_generator(99)])[0] == alone
    swapped = sample_batch(logits.flip(0), params[::-1], [make_generator(99), make_generator(11)])
    assert swapped[1] == alone


def test_same_seed_reproduces_a_sequence_of_draws():
    params = SamplingParams(temperature=1.5, seed=3)
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    generator = make_generator(3)
    first = [sample(logits, params, generator) for _ in range(20)]
    generator = make_generator(3)
    assert [sample(logits, params, generator) for _ in range(20)] == first
    assert len(set(first)) > 1


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    return Tokenizer.byte_level(320, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])


def _run(checker: StopChecker, tokenizer: Tokenizer, text: str) -> list[str]:
    deltas = []
    for token in tokenizer.encode(text):
        deltas.append(checker.push(token))
        if checker.finish_reason:
            break
    return deltas


def test_stop_string_across_token_boundaries_cuts_text_before_it(byte_tokenizer):
    checker = StopChecker(SamplingParams(max_tokens=100, stop=["END"]), [256], byte_tokenizer)
    deltas = _run(checker, byte_tokenizer, "abc ENdx ENDtail")
    assert checker.finish_reason == "stop"
    assert "".join(deltas) == checker.text == "abc ENdx "


def test_text_that_may_start_a_stop_string_is_held_back(byte_tokenizer):
    checker = StopChecker(SamplingParams(max_tokens=100, stop=["END"]), [256], byte_tokenizer)
    assert _run(checker, byte_tokenizer, "xyE") == ["x", "y", ""]


def test_eos_stops_unless_ignored(byte_tokenizer):
    stopped = StopChecker(SamplingParams(max_tokens=5), [256], byte_tokenizer)
    stopped.push(65)
    stopped.push(256)
    assert stopped.finish_reason == "stop" and stopped.token_ids == [65] and stopped.text == "A"
    ignored = StopChecker(SamplingParams(max_tokens=5, ignore_eos=True), [256], byte_tokenizer)
    ignored.push(256)
    assert ignored.finish_reason is None


def test_stop_token_id_stops(byte_tokenizer):
    checker = StopChecker(SamplingParams(max_tokens=5, stop_token_ids=[66]), [256], byte_tokenizer)
    checker.push(65)
    checker.push(66)
    assert checker.finish_reason == "stop" and checker.text == "A"


def test_max_tokens_finishes_with_length(byte_tokenizer):
    checker = StopChecker(SamplingParams(max_tokens=3), [256], byte_tokenizer)
    assert _run(checker, byte_tokenizer, "abcdef") == ["a", "b", "c"]
    assert checker.finish_reason == "length"


def test_stop_strings_without_tokenizer_are_refused():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        StopChecker(SamplingParams(stop=["x"]), [0], None)


@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-7])
def test_a_positive_temperature_too_small_to_divide_by_is_greedy(temperature):
    params = SamplingParams(temperature=temperature).validate()
    assert {sample(LOGITS, params, make_generator(s)) for s in range(10)} == {1}


@pytest.mark.parametrize("top_p", [5e-324, 1e-300])
def test_a_tiny_top_p_keeps_the_best_token(top_p):
    params = SamplingParams(temperature=1.0, top_p=top_p).validate()
    assert {sample(LOGITS, params, make_generator(s)) for s in range(10)} == {1}


def test_a_huge_temperature_and_top_k_still_sample_a_valid_token():
    params = SamplingParams(temperature=1e308, top_k=2**62).validate()
    assert all(0 <= sample(LOGITS, params, make_generator(s)) < 5 for s in range(20))


def test_non_finite_logits_never_raise_and_nan_is_never_drawn():
    logits = torch.tensor([float("nan"), float("inf"), 2.0, -float("inf")])
    params = SamplingParams(temperature=0.5, top_p=0.5)
    assert {sample(logits, params, make_generator(s)) for s in range(10)} == {1}
    every_nan = torch.full((4,), float("nan"))
    assert 0 <= sample(every_nan, SamplingParams(temperature=1.0), make_generator(0)) < 4


def test_params_read_back_exactly_from_their_encoding():
    params = SamplingParams(5, 0.3, 7, 0.8, 12, ["a", "ü"], [3, 4], True)
    assert SamplingParams.from_bytes(params.to_bytes()) == (params, len(params.to_bytes()))
