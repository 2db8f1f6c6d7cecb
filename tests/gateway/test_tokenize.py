"""/tokenize and /detokenize's core, with the tiny model's tokenizer: ids the model has past the tokenizer's
vocabulary, the worker thread that keeps the event loop free, and the bound on text length."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pcpstack.engine.config import ModelArgs
from pcpstack.engine.tokenizer import Tokenizer
from pcpstack.engine.weights import describe_model
from pcpstack.gateway.errors import ApiError
from pcpstack.gateway.tokenize import Tokenization, load_tokenizer

TINY = ModelArgs.tiny()
# The most text /tokenize takes for the tiny model: its context times its longest token's bytes.
MAX_TEXT = TINY.max_seq_len * load_tokenizer("tiny").tokenizer.longest_token_bytes


@pytest.fixture(scope="module")
def tokenization() -> Tokenization:
    return Tokenization("tiny", "tiny")


def _refused(call) -> ApiError:
    with pytest.raises(ApiError) as caught:
        asyncio.run(call)
    return caught.value


def test_detokenize_takes_every_id_the_model_has(tokenization: Tokenization) -> None:
    # The tiny model has 320 ids, its byte tokenizer 259: ids between have no text, as when generated.
    assert asyncio.run(tokenization.detokenize({"tokens": [65, 300, TINY.vocab_size - 1, 66]})) == {
        "prompt": "AB"
    }
    error = _refused(tokenization.detokenize({"tokens": [65, TINY.vocab_size]}))
    assert error.param == "tokens" and f"vocabulary size {TINY.vocab_size}" in error.message


def test_tokenize_encodes_in_a_worker_thread(tokenization: Tokenization, monkeypatch) -> None:
    threads = []
    encode = Tokenizer.encode

    def recording_encode(self, *args, **kwargs):
        threads.append(threading.current_thread())
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode", recording_encode)
    assert asyncio.run(tokenization.tokenize({"prompt": "ab"}))["tokens"] == [97, 98]
    assert asyncio.run(tokenization.tokenize({"messages": [{"role": "user", "content": "ab"}]}))["count"] > 2
    assert len(threads) == 2 and threading.main_thread() not in threads


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a" * (MAX_TEXT + 1)}, "prompt"),
        ({"messages": [{"role": "user", "content": "a" * (MAX_TEXT // 2 + 1)}] * 2}, "messages"),
    ],
)
def test_tokenize_refuses_text_longer_than_the_context_could_hold(tokenization, body: dict, param) -> None:
    error = _refused(tokenization.tokenize(body))
    assert (error.status, error.param) == (400, param)
    assert f"at most {MAX_TEXT}" in error.message


def test_the_longest_text_allowed_is_tokenized(tokenization: Tokenization) -> None:
    assert asyncio.run(tokenization.tokenize({"prompt": "a" * MAX_TEXT}))["count"] == MAX_TEXT


def test_a_gguf_models_vocabulary_and_context_are_the_engines() -> None:
    loaded, described = load_tokenizer(""), describe_model(None).args
    assert (loaded.vocab_size, loaded.max_model_len) == (described.vocab_size, described.max_seq_len)
