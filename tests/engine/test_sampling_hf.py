"""The repetition penalty against Hugging Face transformers' RepetitionPenaltyLogitsProcessor on SmolLM2's
real logits, and greedy generation with it against `generate(repetition_penalty=...)`."""

import pytest
import torch

from pcpstack.engine.sampling import SamplingParams, TokenHistory, process_logits
from tests.engine.conftest import hf_logits

pytestmark = pytest.mark.slow

PROMPT = "The cat sat on the mat. The cat sat on the mat. The cat"


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_hf_processor_on_real_logits(smollm, hf_model, penalty):
    transformers = pytest.importorskip("transformers")
    ids = smollm.tokenizer.encode(PROMPT)
    prompt, output = ids[:-4], ids[-4:]  # the last tokens play the generated ones: both count in HF
    logits = hf_logits(hf_model, ids)[-1]
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)
    expected = processor(torch.tensor([ids]), logits[None].clone())
    params = SamplingParams(repetition_penalty=penalty).validate()
    got = process_logits(logits, params, TokenHistory(prompt, output, ()))
    torch.testing.assert_close(got, expected[0], atol=0, rtol=0)
    assert not torch.equal(got, logits)


def test_greedy_with_repetition_penalty_matches_hf_generate(smollm, smollm_engine, hf_model):
    ids = smollm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.5, ignore_eos=True)
    result = smollm_engine.generate(ids, params)
    with torch.inference_mode():
        ref = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, repetition_penalty=1.5
        )
    assert result.token_ids == ref[0, len(ids) :].tolist()
    plain = smollm_engine.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert plain.token_ids != result.token_ids  # the penalty changes this answer, so the check has teeth
