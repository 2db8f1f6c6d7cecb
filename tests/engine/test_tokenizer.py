"""Tokenizer pieces that do not need a reference: incremental detokenization and chat templates."""

import pytest

from pcpstack.engine.tokenizer import IncrementalDecoder, Tokenizer


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
