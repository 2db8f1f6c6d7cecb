"""Decode.Generate results -> OpenAI responses: whole answers, server-sent-event chunks, usage, logprobs.

Log-probabilities: decode reports one per generated token except the first, which prefill samples without
one, so the first token's logprob is null. A token's text is the text its delta added; text held back while
a stop string or a multi-byte character is incomplete shows up with the token that releases it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pcpstack.gateway.openai_requests import ParsedRequest
from pcpstack.v1 import decode_pb2

FINISH_REASONS = {
    decode_pb2.FINISH_REASON_LENGTH: "length",
    decode_pb2.FINISH_REASON_STOP: "stop",
    decode_pb2.FINISH_REASON_CANCELLED: "abort",  # vLLM's name; OpenAI has none
}
SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's text and log-probability (None for the first token)."""

    text: str
    logprob: float | None


def token_logprobs(delta: decode_pb2.TokenDelta) -> list[TokenLogprob]:
    """The delta's tokens with their logprobs; logprobs align with the last tokens (the first has none)."""
    ids, values = list(delta.token_ids), list(delta.logprobs)
    missing = len(ids) - len(values)
    return [
        TokenLogprob(delta.text if i == 0 else "", values[i - missing] if i >= missing else None)
        for i in range(len(ids))
    ]


def usage(summary: decode_pb2.GenerateSummary) -> dict[str, int]:
    """OpenAI usage counts."""
    return {
        "prompt_tokens": summary.prompt_tokens,
        "completion_tokens": summary.completion_tokens,
        "total_tokens": summary.prompt_tokens + summary.completion_tokens,
    }


def sse(payload: dict) -> bytes:
    """One server-sent event carrying a JSON payload."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class ResponseShaper:
    """Shapes one request's answer for its endpoint; keeps the text offset that completions logprobs need."""

    request: ParsedRequest
    response_id: str
    created: int
    text_offset: int = 0
    _text: list[str] = field(default_factory=list)
    _logprobs: list[TokenLogprob] = field(default_factory=list)

    # --- whole answers --------------------------------------------------------------------------------------

    def add(self, delta: decode_pb2.TokenDelta) -> None:
        """Gathers a delta for `response`."""
        self._text.append(delta.text)
        if self.request.logprobs:
            self._logprobs.extend(token_logprobs(delta))

    def response(self, summary: decode_pb2.GenerateSummary) -> dict:
        """The non-streamed response body from the gathered deltas."""
        text = "".join(self._text)
        logprobs = self._logprobs_object(self._logprobs) if self.request.logprobs else None
        finish = FINISH_REASONS.get(summary.finish_reason)
        if self.request.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {**self._envelope(), "choices": [choice], "usage": usage(summary)}

    # --- streamed answers -----------------------------------------------------------------------------------

    def opening_chunks(self) -> list[dict]:
        """Chunks sent before any token: chat announces the assistant role, as OpenAI does."""
        if not self.request.chat:
            return []
        return [self._chunk({"role": "assistant", "content": ""}, None, None)]

    def delta_chunk(self, delta: decode_pb2.TokenDelta) -> dict | None:
        """The chunk for a delta, or None when it adds nothing the client would see."""
        tokens = token_logprobs(delta) if self.request.logprobs else []
        if not delta.text and not tokens:
            return None
        logprobs = self._logprobs_object(tokens) if self.request.logprobs else None
        content = {"content": delta.text} if self.request.chat else delta.text
        return self._chunk(content, logprobs, None)

    def closing_chunks(self, summary: decode_pb2.GenerateSummary) -> list[dict]:
        """The chunk carrying finish_reason, then the usage chunk when stream_options.include_usage."""
        empty = {} if self.request.chat else ""
        chunks = [self._chunk(empty, None, FINISH_REASONS.get(summary.finish_reason))]
        if self.request.include_usage:
            chunks.append({**self._envelope(chunk=True), "choices": [], "usage": usage(summary)})
        return chunks

    # --- pieces ---------------------------------------------------------------------------------------------

    def _envelope(self, chunk: bool = False) -> dict:
        # OpenAI streams completions under the same object name; chat chunks have their own.
        kind = (
            ("chat.completion.chunk" if chunk else "chat.completion")
            if self.request.chat
            else "text_completion"
        )
        return {"id": self.response_id, "object": kind, "created": self.created, "model": self.request.model}

    def _chunk(self, content: dict | str, logprobs: dict | None, finish_reason: str | None) -> dict:
        key = "delta" if self.request.chat else "text"
        choice = {"index": 0, key: content, "logprobs": logprobs, "finish_reason": finish_reason}
        chunk = {**self._envelope(chunk=True), "choices": [choice]}
        if self.request.include_usage:
            chunk["usage"] = None
        return chunk

    def _logprobs_object(self, tokens: list[TokenLogprob]) -> dict:
        if self.request.chat:
            return {
                "content": [
                    {
                        "token": t.text,
                        "logprob": t.logprob,
                        "bytes": list(t.text.encode()),
                        "top_logprobs": [],
                    }
                    for t in tokens
                ],
                "refusal": None,
            }
        offsets = []
        for t in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(t.text)
        return {
            "tokens": [t.text for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": None,
            "text_offset": offsets,
        }
