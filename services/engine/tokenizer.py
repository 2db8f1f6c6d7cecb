"""Tokenizer built with the `tokenizers` library from GGUF metadata or a Hugging Face tokenizer.json, the chat
template rendered with jinja2, and an incremental detokenizer for streaming."""

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HfTokenizer

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

# llama.cpp's pre-tokenizer splits for byte-level BPE vocabularies, by `tokenizer.ggml.pre`; unknown ones use
# GPT-2's split. SmolLM splits every digit apart before the GPT-2 split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character, the alphabet of byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


@lru_cache(maxsize=1)
def _bytes_of_alphabet() -> dict[str, int]:
    """bytes_to_unicode turned around: each character of the byte-level alphabet -> its byte."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre == "smollm":
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    return pre_tokenizers.Sequence(steps)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


# Texts longer than this are encoded without holding the GIL (a megabyte takes about a second), so that a
# service tokenizing one on a thread keeps its event loop running.
RELEASE_GIL_CHARS = 4096


class Tokenizer:
    """Text <-> token ids, special tokens, and the model's chat template."""

    def __init__(
        self,
        backend: HfTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos_token: bool,
        chat_template: str | None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        """Ids of the added tokens (specials): their text is theirs, not the byte-level alphabet's."""
        return frozenset(self.backend.get_added_tokens_decoder())

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """The most bytes one token stands for: a text of more than n times this many characters (a
        character is at least a byte) is more than n tokens, which services use to refuse a text too long
        for the context before they tokenize it."""
        return max((len(self.token_bytes(token)) for token in range(self.vocab_size)), default=1) or 1

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_text(self, token_id: int | None) -> str | None:
        """The surface form of a token id (e.g. "<|im_end|>"), None for None."""
        return None if token_id is None else self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for on its own: for a byte-level vocabulary, its piece of a multi-byte
        character too (where decoding it alone gives U+FFFD); otherwise its text decoded alone, in UTF-8."""
        surface = self.backend.id_to_token(token_id)
        if surface is None:
            return b""
        if isinstance(self.backend.decoder, decoders.ByteLevel) and token_id not in self._added_ids:
            byte_of = _bytes_of_alphabet()
            if all(char in byte_of for char in surface):
                return bytes(byte_of[char] for char in surface)
        return self.decode([token_id]).encode()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are kept whole. `add_special_tokens` adds
        the BOS token when the model asks for one."""
        if len(text) > RELEASE_GIL_CHARS:
            # the same ids; encode_batch lets go of the GIL while it works, encode holds it throughout
            ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = lambda value, indent=None: json.dumps(
                value, ensure_ascii=False, indent=indent
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token_text(self.bos_token_id) or "",
            eos_token=self.token_text(self.eos_token_ids[0] if self.eos_token_ids else None) or "",
            **extra,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        """Build from GGUF `tokenizer.ggml.*` fields (byte-level BPE, `tokenizer.ggml.model == "gpt2"`)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"tokenizer.ggml.model={kind!r} is not supported; only 'gpt2' (byte-level BPE) is"
            )
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        backend = HfTokenizer(
            models.BPE(
                vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False
            )
        )
        backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        alphabet = set(bytes_to_unicode().values())
        # Control tokens stay whole and special; one spelled outside the byte alphabet is a llama.cpp slip.
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, kind_ in zip(tokens, types, strict=True)
                if kind_ == _CONTROL and set(t) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, kind_ in zip(tokens, types, strict=True)
                if kind_ == _USER_DEFINED
            ]
        )
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eot = meta.get("tokenizer.ggml.eot_token_id")
        return cls(
            backend,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[i for i in dict.fromkeys((eos, eot)) if i is not None],
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_folder(cls, folder: Path, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        """Build from a Hugging Face folder's tokenizer.json and tokenizer_config.json."""
        backend = HfTokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_path = folder / "chat_template.jinja"
        template = template_path.read_text() if template_path.exists() else config.get("chat_template")

        def token_id(entry: Any) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return None if text is None else backend.token_to_id(text)

        eos = list(eos_token_ids) or [i for i in [token_id(config.get("eos_token"))] if i is not None]
        return cls(
            backend,
            bos_token_id=token_id(config.get("bos_token")),
            eos_token_ids=eos,
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=template,
        )

    @classmethod
    def byte_level(cls, vocab_size: int, special_tokens: Sequence[str]) -> "Tokenizer":
        """A merge-free byte tokenizer (ids 0-255 are bytes, then `special_tokens`) for the tiny model."""
        alphabet = bytes_to_unicode()
        vocab = {alphabet[b]: b for b in range(256)}
        backend = HfTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
        if 256 + len(special_tokens) > vocab_size:
            raise ValueError(
                f"vocab_size={vocab_size} cannot hold 256 bytes and {len(special_tokens)} specials"
            )
        template = (
            "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
            "+ '<|im_end|>\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
        )
        has_chatml = {"<|im_start|>", "<|im_end|>"} <= set(special_tokens)
        return cls(
            backend,
            bos_token_id=None,
            eos_token_ids=[256],
            add_bos_token=False,
            chat_template=template if has_chatml else None,
        )


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas, holding back bytes of an incomplete UTF-8 character."""

    # Decoding restarts this many tokens back so that merged multi-token spellings come out right.
    _CONTEXT = 6

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        text = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self._prefix_offset = max(self._read_offset - self._CONTEXT, 0)
        self._read_offset = len(self._ids)
        return text[len(prefix) :]
