"""Decode.Generate results -> OpenAI responses: whole answers, server-sent-event chunks, usage, logprobs.

A request with n samples has n choices; choice i is Generate call i, and its deltas and summary are fed here
with its index. Usage counts the prompt once and the completion tokens of every choice.

Log-probabilities come from TokenDelta.token_logprobs, one entry per generated token, the first included,
each with its alternatives. A decode worker that fills only TokenDelta.logprobs reports none for the first
token (prefill sampled it): the first token's logprob is then null. A token's text is its text decoded
alone when decode gives it, else the text its delta added.

The shapes are pydantic models of OpenAI's responses and chunks (CompletionBody, ChatCompletionBody,
ChatCompletionChunk and their parts); the shaper builds them and hands out their JSON-ready dumps.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_serializer

from pcpstack.gateway.openai_requests import ParsedRequest
from pcpstack.v1 import decode_pb2

FINISH_REASONS = {
    decode_pb2.FINISH_REASON_LENGTH: "length",
    decode_pb2.FINISH_REASON_STOP: "stop",
    decode_pb2.FINISH_REASON_CANCELLED: "abort",  # vLLM's name; OpenAI has none
}
SSE_DONE = b"data: [DONE]\n\n"


# --- the response shapes (OpenAI's, as the `openai` package reads them) ------------------------------------


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Shape):
    """OpenAI's breakdown of the prompt tokens."""

    cached_tokens: int  # whose K/V came from the prefix cache instead of a forward


class Usage(_Shape):
    """Token counts of a whole request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Shape):
    """/v1/completions logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class TopLogprob(_Shape):
    """An alternative to a chat token."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(_Shape):
    """A chat token's logprob and its alternatives."""

    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Shape):
    """/v1/chat/completions logprobs."""

    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionChoice(_Shape):
    """A /v1/completions choice, whole or streamed."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class AssistantMessage(_Shape):
    """The answer of a chat choice."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Shape):
    """A whole /v1/chat/completions choice."""

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatDelta(_Shape):
    """What a chat chunk adds; a field that is None is left out ({} in the chunk carrying finish_reason)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _given_fields(self) -> dict[str, str]:
        given = (("role", self.role), ("content", self.content))
        return {name: value for name, value in given if value is not None}


class ChatChunkChoice(_Shape):
    """A streamed /v1/chat/completions choice."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class CompletionBody(_Shape):
    """A /v1/completions response or stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionBody(_Shape):
    """A whole /v1/chat/completions response."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatCompletionChunk(_Shape):
    """A /v1/chat/completions stream chunk."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's text and log-probability (None when decode gave none), and its alternatives."""

    text: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()
    # Their own bytes, the token's then each alternative's (decode's token_bytes: a piece of a multi-byte
    # character where the text shows U+FFFD); empty from a worker that sends none: the text's UTF-8 then.
    raw: bytes = b""
    top_raw: tuple[bytes, ...] = ()

    def alternatives(self) -> list[tuple[str, float, bytes]]:
        """(text, logprob, bytes) of each alternative."""
        raws = self.top_raw or (b"",) * len(self.top)
        pairs = zip(self.top, raws, strict=True)
        return [(text, value, raw or text.encode()) for (text, value), raw in pairs]


def token_logprobs(delta: decode_pb2.TokenDelta) -> list[TokenLogprob]:
    """The delta's tokens with their logprobs and alternatives."""
    if delta.token_logprobs:
        return [
            TokenLogprob(
                entry.chosen.text,
                entry.chosen.logprob,
                tuple((t.text, t.logprob) for t in entry.top),
                entry.chosen.token_bytes,
                tuple(t.token_bytes for t in entry.top),
            )
            for entry in delta.token_logprobs
        ]
    # Only the flat list: it aligns with the last tokens (the first token, sampled in prefill, has none).
    ids, values = list(delta.token_ids), list(delta.logprobs)
    missing = len(ids) - len(values)
    return [
        TokenLogprob(delta.text if i == 0 else "", values[i - missing] if i >= missing else None)
        for i in range(len(ids))
    ]


def usage(summaries: Sequence[decode_pb2.GenerateSummary]) -> Usage:
    """OpenAI usage counts: the prompt once, the completions of every choice."""
    prompt = summaries[0].prompt_tokens if summaries else 0
    completion = sum(s.completion_tokens for s in summaries)
    # The first sample's prefill is the prompt's; the others (n > 1) may hit the cache it filled.
    cached = summaries[0].cached_prompt_tokens if summaries else 0
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def sse(payload: dict) -> bytes:
    """One server-sent event carrying a JSON payload."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class _Choice:
    """What one choice gathered: text pieces, logprobs, and the text offset completions logprobs need."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offset: int = 0
    # The choice's own detokenizer, when the gateway writes its text (skip_special_tokens=false).
    push_token: Callable[[int], str] | None = None


@dataclass
class ResponseShaper:
    """Shapes one request's answer, its n choices, for its endpoint.

    `detokenize` (token ids -> text) finds the stop string that ended a choice when decode does not name it
    and include_stop_str_in_output asks to show it: decode holds a stop string back but streams its tokens,
    so the text of all the tokens goes on past the answer with the stop string. `special_text` makes a
    detokenizer (token id -> the text it completes) that keeps special tokens; with it the gateway writes
    each choice's text from its token ids instead of taking decode's (skip_special_tokens=false)."""

    request: ParsedRequest
    response_id: str
    created: int
    detokenize: Callable[[list[int]], str] | None = None
    special_text: Callable[[], Callable[[int], str]] | None = None
    _choices: dict[int, _Choice] = field(default_factory=dict)

    def _choice(self, index: int) -> _Choice:
        return self._choices.setdefault(index, _Choice())

    # --- whole answers --------------------------------------------------------------------------------------

    def add(self, delta: decode_pb2.TokenDelta, index: int = 0) -> None:
        """Gathers a delta of choice `index` for `response`."""
        choice = self._choice(index)
        choice.text.append(self._text_of(choice, delta))
        choice.token_ids.extend(delta.token_ids)
        if self.request.logprobs:
            choice.logprobs.extend(token_logprobs(delta))

    def response(self, summaries: Sequence[decode_pb2.GenerateSummary]) -> dict:
        """The non-streamed response body: summaries[i] ends choice i."""
        choices: list[ChatChoice] | list[CompletionChoice] = []
        for index, summary in enumerate(summaries):
            gathered = self._choice(index)
            text = "".join(gathered.text) + self._stop_shown(summary, gathered)
            logprobs = self._logprobs_object(gathered, gathered.logprobs) if self.request.logprobs else None
            finish = FINISH_REASONS.get(summary.finish_reason)
            if self.request.chat:
                message = AssistantMessage(content=text)
                choices.append(
                    ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=finish)
                )
            else:
                choices.append(
                    CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)
                )
        body = self._envelope(choices=choices, usage=usage(summaries))
        return body.model_dump()

    # --- streamed answers -----------------------------------------------------------------------------------

    def opening_chunks(self) -> list[dict]:
        """Chunks sent before any token: chat announces the assistant role of each choice, as OpenAI does."""
        if not self.request.chat:
            return []
        return [self._chunk(index, "", None, None, role=True) for index in range(self.request.n)]

    def delta_chunk(self, delta: decode_pb2.TokenDelta, index: int = 0) -> dict | None:
        """The chunk for a delta of choice `index`, or None when it adds nothing the client would see."""
        choice = self._choice(index)
        text = self._text_of(choice, delta)
        choice.text.append(text)
        choice.token_ids.extend(delta.token_ids)
        tokens = token_logprobs(delta) if self.request.logprobs else []
        if not text and not tokens:
            return None
        logprobs = self._logprobs_object(choice, tokens) if self.request.logprobs else None
        return self._chunk(index, text, logprobs, None)

    def finish_chunks(self, summary: decode_pb2.GenerateSummary, index: int = 0) -> list[dict]:
        """The chunks ending choice `index`: the stop string when it is to be shown, then finish_reason."""
        chunks = []
        stop = self._stop_shown(summary, self._choice(index))
        if stop:
            chunks.append(self._chunk(index, stop, None, None))
        chunks.append(self._chunk(index, None, None, FINISH_REASONS.get(summary.finish_reason)))
        return chunks

    def usage_chunks(self, summaries: Sequence[decode_pb2.GenerateSummary]) -> list[dict]:
        """The usage chunk, sent last, when stream_options.include_usage."""
        if not self.request.include_usage:
            return []
        return [self._envelope(chunk=True, choices=[], usage=usage(summaries)).model_dump()]

    # --- pieces ---------------------------------------------------------------------------------------------

    def _text_of(self, choice: _Choice, delta: decode_pb2.TokenDelta) -> str:
        """The text a delta adds: decode's, or the gateway's own with special tokens kept."""
        if self.special_text is None:
            return delta.text
        if choice.push_token is None:
            choice.push_token = self.special_text()
        return "".join(choice.push_token(token) for token in delta.token_ids)

    def _stop_shown(self, summary: decode_pb2.GenerateSummary, choice: _Choice) -> str:
        """The stop string that ended the choice when include_stop_str_in_output asks to show it; "" for
        a stop token id, which adds no text, as in vLLM."""
        if (
            not self.request.include_stop_str_in_output
            or summary.finish_reason != decode_pb2.FINISH_REASON_STOP
        ):
            return ""
        if summary.matched_stop in self.request.stop:
            return summary.matched_stop
        if self.detokenize is None:
            return ""
        past_the_answer = self.detokenize(choice.token_ids)[len("".join(choice.text)) :]
        return next((s for s in self.request.stop if past_the_answer.startswith(s)), "")

    def _envelope(
        self, *, chunk: bool = False, choices: list, usage: Usage | None = None
    ) -> ChatCompletionBody | ChatCompletionChunk | CompletionBody:
        common = {"id": self.response_id, "created": self.created, "model": self.request.model}
        if not self.request.chat:
            # OpenAI streams completions under the same object name as whole ones.
            return CompletionBody(**common, choices=choices, usage=usage)
        if chunk:
            return ChatCompletionChunk(**common, choices=choices, usage=usage)
        return ChatCompletionBody(**common, choices=choices, usage=usage)

    def _chunk(
        self,
        index: int,
        text: str | None,
        logprobs: ChatLogprobs | CompletionLogprobs | None,
        finish_reason: str | None,
        role: bool = False,
    ) -> dict:
        choice: ChatChunkChoice | CompletionChoice
        if self.request.chat:
            delta = ChatDelta(role="assistant" if role else None, content=text)
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        else:
            choice = CompletionChoice(
                index=index, text=text or "", logprobs=logprobs, finish_reason=finish_reason
            )
        # usage is a key of every chunk only when the last chunk will carry it (OpenAI's stream_options).
        exclude = None if self.request.include_usage else {"usage"}
        return self._envelope(chunk=True, choices=[choice]).model_dump(exclude=exclude)

    def _logprobs_object(
        self, choice: _Choice, tokens: list[TokenLogprob]
    ) -> ChatLogprobs | CompletionLogprobs:
        if self.request.chat:
            return ChatLogprobs(
                content=[
                    ChatTokenLogprob(
                        token=t.text,
                        logprob=t.logprob,
                        bytes=list(t.raw or t.text.encode()),
                        top_logprobs=[
                            TopLogprob(token=text, logprob=value, bytes=list(raw))
                            for text, value, raw in t.alternatives()
                        ],
                    )
                    for t in tokens
                ]
            )
        offsets = []
        for t in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(t.text)
        return CompletionLogprobs(
            tokens=[t.text for t in tokens],
            token_logprobs=[t.logprob for t in tokens],
            # As OpenAI's: the sampled token is always among them (so up to logprobs + 1 entries).
            top_logprobs=[{**dict(t.top), t.text: t.logprob} for t in tokens]
            if self.request.top_logprobs
            else None,
            text_offset=offsets,
        )
