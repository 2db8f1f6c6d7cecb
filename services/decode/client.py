"""Typed client of the Decode service: what `pcpstack generate`, the gateway and the tests use."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pcpstack.common.channel import open_channel
from pcpstack.v1 import common_pb2, decode_pb2, decode_pb2_grpc

# How a worker's RESOURCE_EXHAUSTED refusal of a request it has no room to hold (its --max-requests) begins:
# another worker may take it, and a router may try one (other RESOURCE_EXHAUSTED refusals are the request's).
BUSY = "decode worker busy"
DEFAULT_MAX_REQUESTS = 256


@dataclass
class Generation:
    """A whole answer, gathered from the stream."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    summary: decode_pb2.GenerateSummary | None = None


def build_request(
    prompt: str | list[int] | list[dict[str, str]],
    *,
    request_id: str = "",
    max_tokens: int = 16,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    logprobs: bool = False,
    model: str = "",
) -> decode_pb2.GenerateRequest:
    """A GenerateRequest from text, token ids or chat messages ([{"role", "content"}])."""
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop=stop or [],
        stop_token_ids=stop_token_ids or [],
        ignore_eos=ignore_eos,
    )
    if seed is not None:
        sampling.seed = seed
    request = decode_pb2.GenerateRequest(
        request_id=request_id, sampling=sampling, logprobs=logprobs, model=model
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], dict):
        request.chat.messages.extend(common_pb2.ChatMessage(**m) for m in prompt)
    else:
        request.token_ids.ids.extend(prompt)  # type: ignore[arg-type]
    return request


class DecodeClient:
    """Calls Generate on a decode worker."""

    def __init__(self, address: str, default_deadline: float = 600.0) -> None:
        self.address = address
        self._channel = open_channel(address, default_deadline=default_deadline)
        self._stub = decode_pb2_grpc.DecodeServiceStub(self._channel)

    def stream(
        self, request: decode_pb2.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        """The raw response stream (cancel it to cancel the request)."""
        return self._stub.Generate(request, timeout=timeout)

    async def generate(self, request: decode_pb2.GenerateRequest, timeout: float | None = None) -> Generation:
        """The whole answer; raises grpc.aio.AioRpcError with the service's status on failure."""
        result = Generation()
        async for message in self.stream(request, timeout):
            if message.HasField("delta"):
                result.token_ids.extend(message.delta.token_ids)
                result.text += message.delta.text
                result.logprobs.extend(message.delta.logprobs)
            else:
                result.summary = message.summary
        return result

    async def close(self) -> None:
        """Closes the channel."""
        await self._channel.close()
