"""Sampling parameters, per-request seeded sampling and stop conditions."""

import math

import pytest
import torch

from pcpstack.common.errors import InvalidArgument
from pcpstack.engine.prompt import check_sampling
from pcpstack.engine.sampling import (
    SamplingParams,
    StopChecker,
    TokenHistory,
    generator_after_first_token,
    make_generator,
    process_logits,
    raw_logprobs,
    sample,
    sample_batch,
    sampling_from_wire,
    sampling_to_wire,
    stop_token_set,
    token_logprobs,
)
from pcpstack.engine.tokenizer import Tokenizer
from pcpstack.v1 import common_pb2

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


@pytest.mark.parametrize(
    "logits", [torch.randn(301), torch.full((301,), -math.inf)], ids=["drawn", "none-left"]
)
def test_decode_continues_the_random_stream_of_the_first_token(logits):
    """Every sampled token takes one draw, even with nothing left to draw from, so decode's generator
    (generator_after_first_token) continues exactly where the first token's left off."""
    params = SamplingParams(temperature=1.0, seed=17)
    first = make_generator(params.seed)
    sample(logits, params, first)
    assert torch.equal(generator_after_first_token(params, logits.numel()).get_state(), first.get_state())
    # Greedy requests draw nothing; unseeded ones share no stream to continue.
    greedy = SamplingParams(temperature=0.0, seed=17)
    assert torch.equal(generator_after_first_token(greedy, 301).get_state(), make_generator(17).get_state())


def test_stop_string_across_token_boundaries_cuts_text_before_it(byte_tokenizer):
    checker = StopChecker(SamplingParams(max_tokens=100, stop=["END"]), [256], byte_tokenizer)
    deltas = _run(checker, byte_tokenizer, "abc ENdx ENDtail")
    assert checker.finish_reason == "stop"
    assert "".join(deltas) == checker.text == "abc ENdx "
    assert checker.matched_stop == "END"


def test_the_earliest_of_several_stop_strings_is_the_one_matched(byte_tokenizer):
    checker = StopChecker(SamplingParams(max_tokens=100, stop=["zz", "b", "bc"]), [256], byte_tokenizer)
    _run(checker, byte_tokenizer, "abczz")
    assert (checker.text, checker.matched_stop) == ("a", "b")


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
    assert checker.matched_stop == byte_tokenizer.token_text(66)


def test_a_length_finish_matches_no_stop(byte_tokenizer):
    checker = StopChecker(SamplingParams(max_tokens=2, stop=["END"]), [256], byte_tokenizer)
    _run(checker, byte_tokenizer, "abc")
    assert (checker.finish_reason, checker.matched_stop) == ("length", "")


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


# --- issue 20: penalties, logit_bias, min_p, min_tokens, logprobs -------------------------------------------

VOCAB = 50


def _random_logits(seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _reference_openai_penalties(logits, output, presence, frequency):
    """OpenAI's documented formula, token by token in plain Python."""
    expected = logits.clone()
    for token in set(output):
        expected[token] -= frequency * output.count(token) + presence
    return expected


@pytest.mark.parametrize(("presence", "frequency"), [(0.7, 0.0), (0.0, 0.4), (-1.5, 2.0), (2.0, -2.0)])
def test_presence_and_frequency_penalties_follow_openai_over_generated_tokens_only(presence, frequency):
    logits = _random_logits(1)
    prompt, output = [7, 7, 8, 9], [3, 3, 3, 5, 8, 3]
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency).validate()
    got = process_logits(logits, params, TokenHistory(prompt, output, ()))
    expected = _reference_openai_penalties(logits, output, presence, frequency)
    torch.testing.assert_close(got, expected)
    assert got[7] == logits[7] and got[9] == logits[9]  # prompt-only tokens are untouched


def test_repetition_penalty_counts_each_prompt_and_output_token_once():
    logits = torch.tensor([2.0, -2.0, 3.0, -1.0, 0.5])
    params = SamplingParams(repetition_penalty=2.0)
    got = process_logits(logits, params, TokenHistory([0, 0, 1], [1, 3], ()))
    torch.testing.assert_close(got, torch.tensor([1.0, -4.0, 3.0, -2.0, 0.5]))


def test_logit_bias_adds_and_at_the_extremes_bans_or_forces_a_token():
    logits = _random_logits(2)
    bias = {4: 2.5, 10: -3.0}
    got = process_logits(logits, SamplingParams(logit_bias=bias), TokenHistory())
    expected = logits.clone()
    expected[4] += 2.5
    expected[10] -= 3.0
    torch.testing.assert_close(got, expected)
    best = int(logits.argmax())
    banned = SamplingParams(temperature=0, logit_bias={best: -100.0})
    assert sample(logits, banned, make_generator(0)) == int(logits.topk(2).indices[1])
    forced = SamplingParams(temperature=1.0, logit_bias={int(logits.argmin()): 100.0})
    assert {sample(logits, forced, make_generator(s)) for s in range(20)} == {int(logits.argmin())}


def test_min_p_draws_only_tokens_at_least_min_p_times_the_best():
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0, 1.0])
    probs = logits.softmax(-1)
    min_p = float(probs[4] / probs[0]) + 1e-3  # token 4 is just below the threshold, 1 well above
    params = SamplingParams(temperature=1.0, min_p=min_p).validate()
    assert {sample(logits, params, make_generator(s)) for s in range(300)} == {0, 1}
    # min_p applies after temperature: a high temperature flattens probs so token 4 passes again.
    hot = SamplingParams(temperature=10.0, min_p=min_p).validate()
    assert 4 in {sample(logits, hot, make_generator(s)) for s in range(300)}


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([0.0, 5.0, 4.0, 3.0])  # 1 is the EOS, 2 a stop token id: both beat token 3
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]).validate()
    stops = stop_token_set(params, [1])
    assert sample(logits, params, make_generator(0), TokenHistory([0], [3], stops)) == 3
    assert sample(logits, params, make_generator(0), TokenHistory([0], [3, 3], stops)) == 1


def test_min_tokens_keeps_stop_strings_from_ending_early(byte_tokenizer):
    params = SamplingParams(max_tokens=100, stop=["ab"], min_tokens=3)
    checker = StopChecker(params, [256], byte_tokenizer)
    deltas = _run(checker, byte_tokenizer, "abcab tail")
    assert checker.finish_reason == "stop" and "".join(deltas) == checker.text == "abc"


def test_greedy_without_options_takes_the_bare_argmax_path():
    params = SamplingParams(temperature=0)
    assert not params.processes_logits
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    assert sample_batch(logits, [params] * 3, [make_generator(0)] * 3) == logits.argmax(-1).tolist()


def test_penalised_batch_rows_use_only_their_own_history():
    logits = _random_logits(3).repeat(2, 1)
    best = int(logits[0].argmax())
    params = [SamplingParams(temperature=0, frequency_penalty=2.0), SamplingParams(temperature=0)]
    histories = [TokenHistory((), [best] * 10, ()), TokenHistory((), [best] * 10, ())]
    tokens = sample_batch(logits, params, [make_generator(0)] * 2, histories)
    assert tokens[0] != best and tokens[1] == best


def test_token_logprobs_are_the_raw_log_softmax_with_the_top_n_most_likely_first():
    logits = torch.tensor([1.0, 3.0, 3.0, 0.5, 2.0])
    result = token_logprobs(raw_logprobs(logits), 3, top=3)
    reference = torch.log_softmax(logits.double(), -1)
    assert result.token_id == 3 and result.logprob == pytest.approx(float(reference[3]), abs=1e-6)
    assert [t for t, _ in result.top] == [1, 2, 4]  # the tie 1/2 in id order
    assert [lp for _, lp in result.top] == pytest.approx([float(reference[t]) for t in (1, 2, 4)], abs=1e-6)
    assert token_logprobs(raw_logprobs(logits), 0, top=0).top == ()


@pytest.mark.parametrize(
    ("options", "rule"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty=2\.5 must be in \[-2, 2\]"),
        ({"frequency_penalty": -3.0}, r"frequency_penalty=-3\.0 must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty=0\.0 must be finite and > 0"),
        ({"min_p": 1.5}, r"min_p=1\.5 must be in \[0, 1\]"),
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens=5 must be in \[0, max_tokens\]"),
        ({"logprobs": 21}, r"logprobs=21 must be in \[0, 20\]"),
        ({"logit_bias": {3: 100.5}}, r"logit_bias\[3\]=100\.5: .*biases in \[-100, 100\]"),
        ({"logit_bias": {-1: 1.0}}, r"logit_bias\[-1\]=1\.0: ids must be in \[0, vocabulary size"),
    ],
)
def test_new_fields_are_validated_naming_the_field_and_rule(options, rule):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{rule}"):
        SamplingParams(**options).validate()


def test_logit_bias_ids_outside_the_vocabulary_are_refused_at_the_edge():
    wire = common_pb2.SamplingParams(max_tokens=4, logit_bias={VOCAB: 1.0})
    with pytest.raises(InvalidArgument, match=rf"sampling\.logit_bias\[{VOCAB}\]=1\.0: .*size {VOCAB}\)"):
        check_sampling(wire, vocab_size=VOCAB)
    assert check_sampling(wire, vocab_size=VOCAB + 1).logit_bias == {VOCAB: 1.0}


def test_stop_token_ids_outside_the_vocabulary_are_refused_at_the_edge():
    # A stop on an id the model can never sample would be accepted and never happen.
    wire = common_pb2.SamplingParams(max_tokens=4, stop_token_ids=[3, VOCAB])
    with pytest.raises(
        InvalidArgument, match=rf"sampling\.stop_token_ids=\[3, {VOCAB}\] must hold ids in \[0, {VOCAB}\)"
    ):
        check_sampling(wire, vocab_size=VOCAB)
    assert check_sampling(wire, vocab_size=VOCAB + 1).stop_token_ids == [3, VOCAB]


def test_every_field_reads_back_from_its_encoding_and_from_the_wire():
    params = SamplingParams(
        5, 0.5, 7, 0.75, 12, ["a"], [3], True, 0.5, -0.25, 1.25, {4: -100.0, 9: 2.5}, 0.125, 2, 5
    ).validate()
    assert SamplingParams.from_bytes(params.to_bytes()) == (params, len(params.to_bytes()))
    assert sampling_from_wire(sampling_to_wire(params, common_pb2.SamplingParams())) == params
    unset = sampling_from_wire(common_pb2.SamplingParams(max_tokens=1))
    assert (unset.repetition_penalty, unset.logprobs, unset.processes_logits) == (1.0, None, False)
