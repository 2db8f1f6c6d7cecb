"""Tokenizer pieces that do not need a reference: incremental detokenization, chat templates, and long texts
encoded without holding the GIL."""

import threading
import time

import pytest

from pcpstack.engine.tokenizer import RELEASE_GIL_CHARS, IncrementalDecoder, Tokenizer


@pytest.fixture(scope="module")
def byte_tokenizer() -> Tokenizer:
    return Tokenizer.byte_level(320, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])


def test_incremental_decoder_holds_back_incomplete_utf8(byte_tokenizer):
    decoder = IncrementalDecoder(byte_tokenizer)
    deltas = [decoder.push(b) for b in "a漢🙂".encode()]
    assert deltas == ["a", "", "", "漢", "", "", "", "🙂"]


@pytest.mark.slow
def test_incremental_decoder_concatenates_to_full_decode(smollm):
    text = "Streaming text: naïve café, 漢字, emoji 🙂🚀 and   spaces.\nDone."
    ids = smollm.tokenizer.encode(text)
    decoder = IncrementalDecoder(smollm.tokenizer)
    assert "".join(decoder.push(t) for t in ids) == smollm.tokenizer.decode(ids) == text


def test_chat_template_adds_generation_prompt(byte_tokenizer):
    rendered = byte_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_special_tokens_in_text_stay_whole(byte_tokenizer):
    assert byte_tokenizer.encode("<|im_end|>") == [258]


def test_a_tokens_own_bytes_are_the_piece_of_a_character_it_carries(byte_tokenizer):
    pieces = [byte_tokenizer.token_bytes(b) for b in "a漢".encode()]
    assert pieces == [b"a", b"\xe6", b"\xbc", b"\xa2"]
    assert byte_tokenizer.decode([0xE6]) == "\ufffd"  # what the text alone can show
    assert byte_tokenizer.token_bytes(258) == b"<|im_end|>"


@pytest.mark.slow
def test_the_bytes_of_a_byte_level_vocabularys_tokens_join_into_the_text(smollm):
    text = "naïve → 世界 🙂"
    ids = smollm.tokenizer.encode(text)
    assert "\ufffd" in "".join(smollm.tokenizer.decode([i]) for i in ids)  # tokens split characters
    assert b"".join(smollm.tokenizer.token_bytes(i) for i in ids) == text.encode()
    im_end = smollm.tokenizer.encode("<|im_end|>")
    assert [smollm.tokenizer.token_bytes(i) for i in im_end] == [b"<|im_end|>"]


def test_a_long_text_is_encoded_to_the_same_ids_while_other_threads_run(smollm):
    """Past RELEASE_GIL_CHARS the tokenizer lets go of the GIL while it encodes (a service tokenizes a long
    prompt on a thread; its event loop must keep running meanwhile); the ids are the same as held."""
    tokenizer = smollm.tokenizer
    text = "The quick brown fox jumps over the lazy dog; <|im_end|> 12345 ünïcödé\n" * 12_000
    assert len(text) > RELEASE_GIL_CHARS
    held = tokenizer.backend.encode(text, add_special_tokens=False).ids
    ticks, done = [], threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        started = time.perf_counter()
        assert tokenizer.encode(text, add_special_tokens=False) == held
        took = time.perf_counter() - started
    finally:
        done.set()
        ticker.join()
    during = [t for t in ticks if started <= t <= started + took]
    # the ticker runs about every millisecond; holding the GIL, it would not run at all for the whole encode
    assert took > 0.05 and len(during) > took / 0.01, (took, len(during))
