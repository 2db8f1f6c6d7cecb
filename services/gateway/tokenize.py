"""/tokenize and /detokenize as vLLM serves them, with the tokenizer of the model decode serves.

The gateway reads only the tokenizer of the model (a GGUF's metadata, a Hugging Face folder's
tokenizer.json), never its weights (but the tiny test model's few KB), and only when the first such request
comes. The tokenizer's work runs in a worker thread, off the event loop that answers every other request, and
text longer than the context times the longest token's bytes, which cannot fit, is refused before it is
tokenized.
Text and chat messages are tokenized exactly as decode tokenizes a prompt (services/decode/pipeline.py):
plain text with the model's BOS token when it asks for one, chat rendered with the template and encoded
without adding special tokens, so `count` equals the `prompt_tokens` a completion of that prompt reports.

Request shapes (vLLM's):
  {"prompt": str, "add_special_tokens": true, "return_token_strs": false}
  {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false, "return_token_strs": false}
  {"tokens": [int, ...]} to /detokenize
Answers: {"count", "max_model_len", "tokens", "token_strs"} and {"prompt"}.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from pcpstack.gateway.errors import ApiError, bad_request, quoted
from pcpstack.gateway.openai_requests import (
    ChatMessage,
    StrictModel,
    TokenId,
    check_prompt_chars,
    validate,
)

TINY = "tiny"


class TokenizeTextRequest(StrictModel):
    """vLLM's TokenizeCompletionRequest."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(StrictModel):
    """vLLM's TokenizeChatRequest (without tools and template overrides, which are refused)."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    """vLLM's DetokenizeRequest."""

    model: str | None = None
    tokens: list[TokenId]


class TokenizeResponse(StrictModel):
    """vLLM's TokenizeResponse."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(StrictModel):
    """vLLM's DetokenizeResponse."""

    prompt: str


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer, the model's context length and the model's vocabulary size (which may exceed the
    tokenizer's: ids past the tokenizer's have no text, but the model takes and samples them)."""

    tokenizer: Any  # pcpstack.engine.tokenizer.Tokenizer
    max_model_len: int
    vocab_size: int


def load_tokenizer(source: str) -> LoadedTokenizer:
    """The tokenizer of `source`: "tiny", "" (the embedded default model), a .gguf file (metadata only), or a
    Hugging Face folder; FileNotFoundError when the embedded model is not installed."""
    from pcpstack.engine.config import ModelArgs
    from pcpstack.engine.gguf_file import read_gguf
    from pcpstack.engine.tokenizer import Tokenizer
    from pcpstack.engine.weights import default_model_path

    if source == TINY:
        # The tiny model is random weights of a few KB: loading it whole is the one way to get the exact
        # tokenizer the engine gives it.
        from pcpstack.engine.weights import load_model

        loaded = load_model(TINY, device="cpu")
        return LoadedTokenizer(loaded.tokenizer, loaded.args.max_seq_len, loaded.args.vocab_size)
    path = Path(source) if source else default_model_path()
    if path.is_dir():
        config = json.loads((path / "config.json").read_text())
        eos = config.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        tokenizer = Tokenizer.from_hf_folder(path, eos_ids)
        return LoadedTokenizer(
            tokenizer,
            int(config.get("max_position_embeddings", ModelArgs.max_seq_len)),
            int(config.get("vocab_size") or tokenizer.vocab_size),
        )
    gguf = read_gguf(path)
    meta, arch = gguf.meta, gguf.meta["general.architecture"]
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    context = meta.get(f"{arch}.context_length")
    # The rows of the embedding, as the engine counts the model's vocabulary.
    embedding = next((t for t in gguf.tensors if t.name == "token_embd.weight"), None)
    width = meta.get(f"{arch}.embedding_length")
    return LoadedTokenizer(
        tokenizer,
        int(context) if context else ModelArgs.max_seq_len,
        embedding.n_elements // width if embedding is not None and width else tokenizer.vocab_size,
    )


class Tokenization:
    """The /tokenize and /detokenize work of one gateway; the tokenizer is loaded on first use."""

    def __init__(self, source: str | None, served_model: str) -> None:
        """`source` names the model whose tokenizer to use ("" the embedded default); None: these endpoints
        answer 501."""
        self._source = source
        self._served_model = served_model
        self._loaded: LoadedTokenizer | None = None
        self._lock = asyncio.Lock()

    async def _tokenizer(self) -> LoadedTokenizer:
        if self._source is None:
            raise ApiError(
                501,
                "this gateway has no tokenizer: start it with --tokenizer MODEL (the model decode serves)",
                error_type="not_implemented",
                code="not_implemented",
            )
        async with self._lock:
            if self._loaded is None:
                try:
                    self._loaded = await asyncio.to_thread(load_tokenizer, self._source)
                except FileNotFoundError as exc:
                    raise ApiError(
                        501, f"this gateway has no tokenizer: {exc}", error_type="not_implemented"
                    ) from None
        return self._loaded

    async def detokenizer(self, needed_by: str) -> Callable[[list[int]], str]:
        """Token ids -> text as decode writes it (special tokens skipped); a 400 naming `needed_by` when
        this gateway has no tokenizer."""
        tokenizer = await self._needed_tokenizer(needed_by)
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)

    async def _needed_tokenizer(self, needed_by: str) -> Any:
        try:
            return (await self._tokenizer()).tokenizer
        except ApiError as exc:
            message = f"{needed_by} needs the gateway's tokenizer: {exc.message}"
            raise bad_request(needed_by, message) from None

    async def special_text(self, needed_by: str) -> Callable[[], Callable[[int], str]]:
        """A maker of incremental detokenizers that keep special tokens (token id -> the text it completes);
        a 400 naming `needed_by` when this gateway has no tokenizer."""
        from pcpstack.engine.tokenizer import IncrementalDecoder

        tokenizer = await self._needed_tokenizer(needed_by)
        return lambda: IncrementalDecoder(tokenizer, skip_special_tokens=False).push

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._served_model:
            raise ApiError(
                404,
                f"model={quoted(model)} does not exist here; this server serves {self._served_model!r}",
                param="model",
                code="model_not_found",
            )

    async def tokenize(self, body: Any) -> dict:
        """The answer to a /tokenize body (text or chat)."""
        request: TokenizeTextRequest | TokenizeChatRequest
        if isinstance(body, dict) and "messages" in body:
            request = validate(TokenizeChatRequest, body)
        else:
            request = validate(TokenizeTextRequest, body)
        self._check_model(request.model)
        loaded = await self._tokenizer()
        # no text of more characters fits the context: refused as decode refuses it, before tokenizing
        limit = loaded.max_model_len * await asyncio.to_thread(lambda: loaded.tokenizer.longest_token_bytes)
        if isinstance(request, TokenizeChatRequest):
            chars = sum(len(message.text()) for message in request.messages)
            check_prompt_chars("messages", chars, limit)
        else:
            check_prompt_chars("prompt", len(request.prompt), limit)
        answer = await asyncio.to_thread(_tokenize, loaded, request)
        return answer.model_dump()

    async def detokenize(self, body: Any) -> dict:
        """The answer to a /detokenize body; ids the model has but the tokenizer does not come out as decode
        writes them when generated (the tokenizer gives them no text)."""
        request = validate(DetokenizeRequest, body)
        self._check_model(request.model)
        loaded = await self._tokenizer()
        bad = next((t for t in request.tokens if t >= loaded.vocab_size), None)
        if bad is not None:
            raise bad_request(
                "tokens", f"token id {bad} is not below the vocabulary size {loaded.vocab_size}"
            )
        text = await asyncio.to_thread(loaded.tokenizer.decode, request.tokens)
        return DetokenizeResponse(prompt=text).model_dump()


def _tokenize(
    loaded: LoadedTokenizer, request: TokenizeTextRequest | TokenizeChatRequest
) -> TokenizeResponse:
    """The tokens of a /tokenize request (the work a worker thread does)."""
    tokenizer = loaded.tokenizer
    if isinstance(request, TokenizeChatRequest):
        messages = [message.as_prompt() for message in request.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt
            )
        except ValueError as exc:
            raise bad_request("messages", str(exc)) from None
    else:
        text = request.prompt
    tokens = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    strs = [tokenizer.token_text(t) for t in tokens] if request.return_token_strs else None
    return TokenizeResponse(
        count=len(tokens), max_model_len=loaded.max_model_len, tokens=tokens, token_strs=strs
    )
