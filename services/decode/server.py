"""The Generate servicer: validate, tokenize, prefill on a PCP set, load the KV replica, stream the answer.

Request path: the prompt is tokenized (or rendered with the chat template), a ready set is chosen, its
master prefills the prompt and pushes one complete KV replica to the store, this worker fetches the replica,
releases it, and joins the continuous-batching loop. If the set fails before answering, the request is
retried once on another ready set within its deadline. A client that goes away cancels its request: its
blocks are freed and its store object released.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import torch
from opentelemetry.metrics import Observation

from pcpstack.common.logs import request_id_var
from pcpstack.common.telemetry import current_trace_id, meter, tracer
from pcpstack.decode.batcher import Batcher, DecodeRequest, TokenEvent, accept_token
from pcpstack.decode.router import NoReadySet, SetRouter
from pcpstack.engine.engine import Engine
from pcpstack.engine.sampling import SamplingParams, StopChecker, sampling_from_wire
from pcpstack.prefill.client import PrefillClient
from pcpstack.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2

log = logging.getLogger(__name__)
SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
_tracer = tracer(__name__)
_meter = meter("pcpstack.decode")
_requests = _meter.create_counter("pcpstack.decode.requests", description="Generate requests by outcome")
_ttft = _meter.create_histogram("pcpstack.decode.ttft", unit="s", description="time to first token")
_tpot = _meter.create_histogram("pcpstack.decode.time_per_output_token", unit="s")
_kv_bytes = _meter.create_counter("pcpstack.decode.kv_bytes_fetched", unit="By")
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
_FINISH = {
    "length": decode_pb2.FINISH_REASON_LENGTH,
    "stop": decode_pb2.FINISH_REASON_STOP,
    "cancelled": decode_pb2.FINISH_REASON_CANCELLED,
}


class RequestError(Exception):
    """A request that cannot be served, with the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class DecodeSettings:
    """What the servicer needs beyond the engine."""

    model_name: str
    kv_fingerprint: str
    prefill_timeout_s: float = 300.0
    kv_lease_ms: int = 0


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    """Serves Generate from one decode worker."""

    def __init__(
        self, engine: Engine, batcher: Batcher, router: SetRouter, kv_clients, settings: DecodeSettings
    ):
        self.engine = engine
        self.batcher = batcher
        self.router = router
        self.kv_clients = kv_clients  # address -> KvStoreClient (cached)
        self.settings = settings
        self._prefill_clients: dict[str, PrefillClient] = {}
        _meter.create_observable_gauge(
            "pcpstack.decode.queue_depth",
            callbacks=[lambda _: [Observation(batcher.queue_depth)]],
            description="requests waiting for KV blocks or decoding",
        )

    # --- request validation ------------------------------------------------------------------------------

    def prompt_tokens(self, request: decode_pb2.GenerateRequest) -> list[int]:
        """The prompt as token ids, validated; raises RequestError naming the field."""
        tokenizer, args = self.engine.tokenizer, self.engine.args
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "prompt: give one of text, chat or token_ids"
            )
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
            bad = next((i for i, t in enumerate(ids) if t >= args.vocab_size), None)
            if bad is not None:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"token_ids.ids[{bad}]={ids[bad]} is not below the vocabulary size {args.vocab_size}",
                )
        elif tokenizer is None:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{kind}: this model has no tokenizer; send token_ids"
            )
        elif kind == "text":
            ids = tokenizer.encode(request.text) if request.text else []
        else:
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            if not messages:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "chat.messages: must not be empty")
            bad_role = next(
                (m["role"] for m in messages if m["role"] not in ("system", "user", "assistant")), None
            )
            if bad_role is not None:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"chat.messages.role={bad_role!r} is not one of system, user, assistant",
                )
            try:
                ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
            except Exception as exc:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"chat: the chat template failed: {exc}"
                ) from exc
        if not ids:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{kind}: the prompt is empty")
        return ids

    def validate(self, request: decode_pb2.GenerateRequest) -> tuple[list[int], SamplingParams]:
        """Token ids and sampling parameters of a request, or RequestError."""
        if request.model and request.model != self.settings.model_name:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model={request.model!r} is not served here (this worker has {self.settings.model_name!r})",
            )
        try:
            params = sampling_from_wire(request.sampling)
        except ValueError as exc:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if params.stop and self.engine.tokenizer is None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop: this model has no tokenizer")
        ids = self.prompt_tokens(request)
        limit = self.engine.args.max_seq_len
        if len(ids) + params.max_tokens > limit:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"sampling.max_tokens={params.max_tokens} with {len(ids)} prompt tokens exceeds the model "
                f"context of {limit} tokens",
            )
        return ids, params

    # --- the request path --------------------------------------------------------------------------------

    async def _prefill(
        self, request_id: str, ids: list[int], sampling: common_pb2.SamplingParams, deadline: float
    ) -> prefill_pb2.PrefillResponse:
        """Prefill on the least loaded ready set; one retry on another set if the first fails."""
        tried: set[str] = set()
        last_error = ""
        for _ in range(2):
            try:
                # The registry lookup: Resolve, or its cached answer while fresh or the registry is away.
                with _tracer.start_as_current_span("decode.route") as span:
                    chosen = await self.router.choose(exclude=tried)
                    span.set_attribute("pcpstack.set_id", chosen.set_id)
            except NoReadySet as exc:
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE, f"{exc}{'; ' + last_error if last_error else ''}"
                ) from None
            tried.add(chosen.set_id)
            client = self._prefill_clients.get(chosen.address)
            if client is None:
                client = self._prefill_clients[chosen.address] = PrefillClient(chosen.address)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self.router.started(chosen.set_id)
            try:
                return await client.prefill(
                    request_id,
                    ids,
                    sampling,
                    kv_lease_ms=self.settings.kv_lease_ms,
                    expected_fingerprint=self.settings.kv_fingerprint,
                    timeout=min(remaining, self.settings.prefill_timeout_s),
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise RequestError(exc.code(), exc.details() or "prefill refused the request") from exc
                last_error = f"set {chosen.set_id} failed: {exc.code().name}: {exc.details()}"
                if exc.code() not in _RETRYABLE and exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise RequestError(exc.code(), last_error) from exc
                self.router.forget(chosen.set_id)
            finally:
                self.router.finished(chosen.set_id)
        raise RequestError(
            grpc.StatusCode.UNAVAILABLE, last_error or "the request's deadline passed before prefill"
        )

    def _kv_client(self, address: str):
        from pcpstack.kvstore.client import KvStoreClient

        client = self.kv_clients.get(address)
        if client is None:
            client = self.kv_clients[address] = KvStoreClient(address)
        return client

    async def _fetch_kv(self, handle: common_pb2.KvHandle) -> torch.Tensor:
        """Loads the replica from the store into a tensor; the store object is released afterwards."""
        layout = self.engine.layout
        with _tracer.start_as_current_span("decode.kv_fetch") as span:
            span.set_attribute("pcpstack.kv_bytes", handle.total_bytes)
            data, _ = await self._kv_client(handle.store_address).get(handle.key, handle.fingerprint)
        _kv_bytes.add(len(data))
        kv = torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=layout.torch_dtype)
        return kv.view(layout.num_layers, 2, handle.num_tokens, layout.num_kv_heads, layout.head_dim)

    async def _release(self, handle: common_pb2.KvHandle) -> None:
        try:
            await self._kv_client(handle.store_address).release(handle.key)
        except Exception as exc:  # the store's lease reclaims it anyway
            log.warning("release of %s failed: %s", handle.key, exc)

    async def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        arrived = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        request_id_var.set(request_id)
        remaining = context.time_remaining()
        deadline = arrived + (remaining if remaining is not None else 3600.0)
        with _tracer.start_as_current_span("decode.generate") as span:
            span.set_attribute("pcpstack.request_id", request_id)
            try:
                ids, params = self.validate(request)
            except RequestError as exc:
                _requests.add(1, {"outcome": "invalid"})
                await context.abort(exc.code, str(exc))
            span.set_attribute("pcpstack.prompt_tokens", len(ids))
            try:
                reply = await self._prefill(request_id, ids, request.sampling, deadline)
            except RequestError as exc:
                _requests.add(1, {"outcome": "error"})
                await context.abort(exc.code, str(exc))
            events: asyncio.Queue[TokenEvent] = asyncio.Queue()
            loop = asyncio.get_running_loop()
            # The first token (sampled by prefill) streams at once; the KV loads while the client reads it.
            checker = StopChecker(params, self.engine.args.eos_token_ids, self.engine.tokenizer)
            first = accept_token(checker, reply.first_token_id, None)
            if first is not None:
                events.put_nowait(first)
            fetch_failed = False

            async def load_and_submit() -> None:
                nonlocal fetch_failed
                try:
                    if checker.finish_reason is not None:
                        events.put_nowait(TokenEvent(None, "", finish_reason=checker.finish_reason))
                        return
                    kv = await self._fetch_kv(reply.kv)
                except Exception as exc:
                    fetch_failed = True
                    events.put_nowait(TokenEvent(None, "", error=f"could not fetch the KV replica: {exc}"))
                    return
                finally:
                    # Released as soon as it is loaded (or not needed): the store never holds it for nothing.
                    await asyncio.shield(self._release(reply.kv))
                self.batcher.submit(
                    DecodeRequest(
                        seq_id=request_id,
                        kv=kv,
                        num_tokens=len(ids),
                        checker=checker,
                        params=params,
                        emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                        logprobs=request.logprobs,
                    )
                )

            loader = asyncio.ensure_future(load_and_submit())
            first_at = None
            count = 0
            try:
                while True:
                    event = await events.get()
                    if event.error:
                        _requests.add(1, {"outcome": "error"})
                        code = (
                            grpc.StatusCode.UNAVAILABLE
                            if fetch_failed
                            else grpc.StatusCode.RESOURCE_EXHAUSTED
                        )
                        await context.abort(code, event.error)
                    if event.finish_reason:
                        break
                    if first_at is None:
                        first_at = time.monotonic()
                        _ttft.record(first_at - arrived)
                    count += event.token_id is not None
                    yield decode_pb2.GenerateResponse(
                        delta=decode_pb2.TokenDelta(
                            token_ids=[event.token_id] if event.token_id is not None else [],
                            text=event.text,
                            logprobs=[event.logprob] if event.logprob is not None else [],
                        )
                    )
            except asyncio.CancelledError:
                loader.cancel()  # its finally still releases the replica
                self.batcher.cancel(request_id)
                _requests.add(1, {"outcome": "cancelled"})
                raise
            done = time.monotonic()
            if count > 1 and first_at is not None:
                _tpot.record((done - first_at) / (count - 1))
            _requests.add(1, {"outcome": "ok"})
            yield decode_pb2.GenerateResponse(
                summary=decode_pb2.GenerateSummary(
                    finish_reason=_FINISH[event.finish_reason],
                    prompt_tokens=len(ids),
                    completion_tokens=count,
                    ttft_seconds=(first_at or done) - arrived,
                    total_seconds=done - arrived,
                    request_id=request_id,
                    prompt_token_ids=ids,
                    trace_id=current_trace_id(),
                )
            )
