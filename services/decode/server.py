"""The Generate servicer: a GenerateRequest becomes a call of the request pipeline, its events protobuf.

The request path itself (validation, routing, prefill, the KV replica, the batch) is decode.pipeline; errors
are the common kinds, answered with their gRPC status by the common interceptor, also after tokens were
streamed. A client that goes away cancels the call, and with it the pipeline's request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from pcpstack.decode.pipeline import (
    ChatMessage,
    ChatPrompt,
    Delta,
    GenerateInput,
    GeneratePipeline,
    Prompt,
    TextPrompt,
    TokenPrompt,
)
from pcpstack.engine.prompt import check_sampling
from pcpstack.engine.sampling import TokenLogprobs
from pcpstack.engine.tokenizer import Tokenizer
from pcpstack.v1 import common_pb2, decode_pb2, decode_pb2_grpc

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
_FINISH = {
    "length": decode_pb2.FINISH_REASON_LENGTH,
    "stop": decode_pb2.FINISH_REASON_STOP,
    "cancelled": decode_pb2.FINISH_REASON_CANCELLED,
}


def prompt_of(request: decode_pb2.GenerateRequest) -> Prompt | None:
    """The request's prompt in the pipeline's terms (None when it gives none)."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return TextPrompt(request.text)
    if kind == "chat":
        return ChatPrompt(tuple(ChatMessage(m.role, m.content) for m in request.chat.messages))
    if kind == "token_ids":
        return TokenPrompt(tuple(request.token_ids.ids))
    return None


def logprobs_wire(logprobs: TokenLogprobs, tokenizer: Tokenizer | None) -> common_pb2.TokenLogprobs:
    """One token's log-probabilities as sent in TokenDelta.token_logprobs, each token with its text alone
    and its own bytes (both empty when the model has no tokenizer)."""

    def entry(token_id: int, logprob: float) -> common_pb2.TokenLogprob:
        if tokenizer is None:
            return common_pb2.TokenLogprob(token_id=token_id, logprob=logprob)
        return common_pb2.TokenLogprob(
            token_id=token_id,
            logprob=logprob,
            text=tokenizer.decode([token_id]),
            token_bytes=tokenizer.token_bytes(token_id),
        )

    return common_pb2.TokenLogprobs(
        chosen=entry(logprobs.token_id, logprobs.logprob), top=[entry(t, lp) for t, lp in logprobs.top]
    )


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    """Serves Generate from one decode worker's pipeline."""

    def __init__(self, pipeline: GeneratePipeline) -> None:
        self.pipeline = pipeline

    async def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        call = GenerateInput(
            prompt=prompt_of(request),
            sampling=check_sampling(request.sampling, vocab_size=self.pipeline.engine.args.vocab_size),
            request_id=request.request_id,
            model=request.model,
            logprobs=request.logprobs,
            timeout_s=context.time_remaining(),
            cache_salt=request.cache_salt,
            fit_max_tokens=request.fit_max_tokens,
        )
        # aclosing: closing this stream closes the pipeline's request with it.
        async with aclosing(self.pipeline.generate(call)) as events:
            async for event in events:
                if isinstance(event, Delta):
                    yield decode_pb2.GenerateResponse(
                        delta=decode_pb2.TokenDelta(
                            token_ids=[] if event.token_id is None else [event.token_id],
                            text=event.text,
                            logprobs=[] if event.logprob is None else [event.logprob],
                            token_logprobs=(
                                []
                                if event.logprobs is None
                                else [logprobs_wire(event.logprobs, self.pipeline.engine.tokenizer)]
                            ),
                        )
                    )
                else:
                    yield decode_pb2.GenerateResponse(
                        summary=decode_pb2.GenerateSummary(
                            finish_reason=_FINISH[event.finish_reason],
                            prompt_tokens=len(event.prompt_token_ids),
                            completion_tokens=event.completion_tokens,
                            ttft_seconds=event.ttft_s,
                            total_seconds=event.total_s,
                            request_id=event.request_id,
                            prompt_token_ids=event.prompt_token_ids,
                            trace_id=event.trace_id,
                            cached_prompt_tokens=event.cached_prompt_tokens,
                            matched_stop=event.matched_stop,
                        )
                    )
