"""Decode's request path as plain Python: one `generate` call per request, yielding what to stream.

validate → route to a ready PCP set (one retry on another set if the first fails as a set) → the set
prefills the prompt and pushes one KV replica to the store → fetch the replica → release it → join the
continuous batch → stream tokens → a summary. The servicer (decode.server) only turns a GenerateRequest into a
`GenerateInput` and these events into protobuf; failures are raised as the common error kinds.

A replica is one store object per K/V head range (one per stored TP shard of the prefill set; a single
object holding every head without TP): the fetch reads them all and places each by its head range into the
whole model's K/V, whatever TP the prefill set or this worker runs. A decode context-parallel worker
(engine.dcp_size > 1) instead fetches, for each of its TP ranks, only that rank's token blocks of its K/V
heads with ranged Gets (decode.kv_ranges) and hands the batch one part per rank. Every store object of the
replica is released exactly once on every path: after the fetch (or when no fetch is needed), when the
request fails or is cancelled mid-fetch, and, when the caller leaves while the set is still prefilling, as
soon as the set's answer names the replica nobody will load. A caller that leaves as the answer is in flight
(sent by the set, not yet taken in here) cancels a call the set saw succeed: each Prefill carries a fresh
abandon_token, and when a cancelled call ends without its answer this worker calls the set's Abandon with
it, which deletes such a replica (and does nothing where the set dropped the job itself).

Prefix reuse: the set may answer with a handle whose leading `cached_tokens` come from the store's prefix
blocks (`prefix_segments`, read through the handle's prefix lease, one ranged Get per segment; a TP
prefill set's prefix is stored per K/V head range like its replica, each segment naming its heads and
fingerprint) and whose objects hold only the tokens after them; the fetch joins them into one sequence by
position and head, and the prefix lease is released with the objects. A DCP worker's ranks read their own
token blocks from the segments and the new objects alike (decode.kv_ranges plans the reads over both).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TypeVar

import grpc
import torch
from opentelemetry import trace
from opentelemetry.metrics import Observation

from pcpstack.common.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    error_of_code,
)
from pcpstack.common.ids import check_request_id
from pcpstack.common.logs import ThrottledWarning, request_id_var
from pcpstack.common.rpc_errors import error_from_rpc
from pcpstack.common.telemetry import (
    current_in_steps,
    current_trace_id,
    latency_histogram,
    meter,
    record_failure,
    tracer,
)
from pcpstack.decode.batcher import Batcher, DecodeRequest, KvReplica, TokenEvent, accept_token
from pcpstack.decode.kv_ranges import (
    KvSource,
    ShardRead,
    assemble_part,
    part_reads,
    prefix_sources,
    shard_sources,
)
from pcpstack.decode.router import NoReadySet, SetRouter
from pcpstack.engine.dcp import KvPart
from pcpstack.engine.engine import Engine
from pcpstack.engine.prompt import PromptLimits, check_logit_bias, check_token_ids
from pcpstack.engine.sampling import SamplingParams, StopChecker, TokenLogprobs, sampling_to_wire
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.prefill.client import PrefillClient
from pcpstack.registry.endpoints import PrefillEndpoint
from pcpstack.v1 import common_pb2, prefill_pb2

T = TypeVar("T")
log = logging.getLogger(__name__)
# Prompts with more characters than this are tokenized on a thread: the tokenizer releases the GIL, and a
# long text (a megabyte takes about half a second) must not hold up the worker's loop, which decodes and
# heartbeats for every other request.
TOKENIZE_ON_THREAD_CHARS = 16_384
# Seconds a request waits for its replica's release before its tokens go on (the release goes on behind).
RELEASE_WAIT_S = 1.0
_tracer = tracer(__name__)
_meter = meter("pcpstack.decode")
_requests = _meter.create_counter("pcpstack.decode.requests", description="Generate requests by outcome")
# vLLM's request metrics, under pcpstack: (common.telemetry explains the names).
_ttft = latency_histogram(_meter, "pcpstack.time_to_first_token", "seconds from arrival to the first token")
_tpot = latency_histogram(
    _meter, "pcpstack.time_per_output_token", "mean seconds per output token after the first, per request"
)
_e2e = latency_histogram(_meter, "pcpstack.e2e_request_latency", "seconds from arrival to the last token")
_prefill_time = latency_histogram(
    _meter, "pcpstack.request_prefill_time", "seconds from arrival to the PCP set's answer"
)
_kv_fetch_time = latency_histogram(_meter, "pcpstack.kv_fetch_time", "seconds to read a KV replica")
_prompt_tokens = _meter.create_counter("pcpstack.prompt_tokens", "{token}", "prompt tokens prefilled")
_generation_tokens = _meter.create_counter("pcpstack.generation_tokens", "{token}", "tokens generated")
_success = _meter.create_counter(
    "pcpstack.request_success", "{request}", "requests that finished, by finished_reason"
)
_kv_bytes = _meter.create_counter("pcpstack.decode.kv_bytes_fetched", unit="By")
# Without a deadline from the caller a request still ends some time.
_DEFAULT_DEADLINE_S = 3600.0
_CHAT_ROLES = ("system", "user", "assistant")
# How a Prefill call can end here while the set answered it: the set then keeps the answer's replica until
# Abandon or its lease.
_ANSWER_MAY_BE_LOST = frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
)
# While a set is down every request sent there fails to abandon too: one line a minute per set and kind of
# error says so.
_abandon_failures = ThrottledWarning(log)


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat prompt."""

    role: str
    content: str


@dataclass(frozen=True)
class TextPrompt:
    """Plain text, tokenized as is."""

    text: str


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages, rendered with the model's chat template and a generation prompt."""

    messages: tuple[ChatMessage, ...]


@dataclass(frozen=True)
class TokenPrompt:
    """Ready token ids."""

    ids: tuple[int, ...]


Prompt = TextPrompt | ChatPrompt | TokenPrompt


@dataclass(frozen=True)
class GenerateInput:
    """One request as the pipeline takes it: sampling already parsed (engine.prompt.check_sampling)."""

    prompt: Prompt | None
    sampling: SamplingParams
    request_id: str = ""  # empty: the pipeline makes one
    model: str = ""  # empty: the model this worker serves
    # Log-probabilities without alternatives when sampling.logprobs is unset (GenerateRequest.logprobs).
    logprobs: bool = False
    timeout_s: float | None = None  # what the caller gives the whole request; None: no deadline
    cache_salt: str = ""  # prefixes are shared only between requests with the same salt
    # sampling.max_tokens is a default (GenerateRequest.fit_max_tokens): cut to the context's room if needed
    fit_max_tokens: bool = False


@dataclass(frozen=True)
class Delta:
    """Newly generated text: one token (None while text is held back) and its log-probability if asked."""

    token_id: int | None
    text: str
    logprob: float | None = None
    # The token's raw log-probability with sampling.logprobs alternatives, when asked.
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class Summary:
    """The last event of a request."""

    request_id: str
    finish_reason: str  # "length", "stop" or "cancelled"
    prompt_token_ids: list[int]
    completion_tokens: int
    ttft_s: float
    total_s: float
    trace_id: str
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the store's prefix cache
    matched_stop: str = ""  # the stop string or stop token that ended it (StopChecker.matched_stop)


@dataclass(frozen=True)
class DecodeSettings:
    """What the pipeline needs beyond the engine."""

    model_name: str
    kv_fingerprint: str
    prefill_timeout_s: float = 300.0
    kv_lease_ms: int = 0


def _prompt_chars(prompt: Prompt) -> int:
    """Characters of a text or chat prompt (0 for token ids)."""
    if isinstance(prompt, TextPrompt):
        return len(prompt.text)
    if isinstance(prompt, ChatPrompt):
        return sum(len(message.content) for message in prompt.messages)
    return 0


class GeneratePipeline:
    """Serves requests on one decode worker: the engine's batch, a set router and the peers' clients."""

    def __init__(self, engine: Engine, batcher: Batcher, router: SetRouter, settings: DecodeSettings) -> None:
        self.engine = engine
        self.batcher = batcher
        self.router = router
        self.settings = settings
        args = engine.args
        self._limits = PromptLimits(args.vocab_size, args.max_seq_len, args.sliding_window)
        self._prefill_clients: dict[str, PrefillClient] = {}
        self._kv_clients: dict[str, KvStoreClient] = {}
        # Releases of replicas whose caller left during prefill; kept so they are not garbage collected.
        self._background: set[asyncio.Task] = set()
        self._prefilling = 0
        # Batch ids are unique per attempt: two requests may carry the same caller id.
        self._sequence = itertools.count()
        _meter.create_observable_gauge(
            "pcpstack.decode.queue_depth",
            callbacks=[lambda _: [Observation(batcher.queue_depth)]],
            description="requests waiting for KV blocks or decoding",
        )
        _meter.create_observable_gauge(
            "pcpstack.num_requests_running",
            callbacks=[lambda _: [Observation(batcher.active)]],
            description="requests in the decode batch",
        )
        _meter.create_observable_gauge(
            "pcpstack.num_requests_waiting",
            # Waiting as vLLM means it: arrived and not decoding yet (in prefill, or queued for blocks).
            callbacks=[lambda _: [Observation(self._prefilling + batcher.waiting)]],
            description="requests in prefill or queued for KV blocks",
        )
        _meter.create_observable_gauge(
            "pcpstack.kv_cache_usage_perc",
            callbacks=[lambda _: [Observation(batcher.kv_usage)]],
            description="fraction of the decode KV cache's blocks in use (0 to 1)",
        )

    @property
    def prefills_in_flight(self) -> int:
        """Prefill calls sent and not answered yet (including those whose caller left)."""
        return self._prefilling

    async def close(self) -> None:
        """Waits for background releases, then closes the peers' channels."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for client in [*self._prefill_clients.values(), *self._kv_clients.values()]:
            await client.close()

    # --- validate ----------------------------------------------------------------------------------------

    def prompt_tokens(self, prompt: Prompt | None) -> tuple[list[int], str]:
        """The prompt as token ids and the field it came from; raises InvalidArgument naming the field."""
        tokenizer = self.engine.tokenizer
        if prompt is None:
            raise InvalidArgument("prompt: give one of text, chat or token_ids")
        if isinstance(prompt, TokenPrompt):
            return list(prompt.ids), "token_ids.ids"
        kind = "text" if isinstance(prompt, TextPrompt) else "chat"
        if tokenizer is None:
            raise InvalidArgument(f"{kind}: this model has no tokenizer; send token_ids")
        chars = _prompt_chars(prompt)
        longest = tokenizer.longest_token_bytes
        if chars > self._limits.max_seq_len * longest:
            raise InvalidArgument(
                f"{kind}: {chars} characters cannot fit the context of {self._limits.max_seq_len} tokens: no "
                f"token of this model stands for more than {longest} bytes, and a character is at least one"
            )
        if isinstance(prompt, TextPrompt):
            return (tokenizer.encode(prompt.text) if prompt.text else []), kind
        if not prompt.messages:
            raise InvalidArgument("chat.messages: must not be empty")
        bad_role = next((m.role for m in prompt.messages if m.role not in _CHAT_ROLES), None)
        if bad_role is not None:
            raise InvalidArgument(f"chat.messages.role={bad_role!r} is not one of {', '.join(_CHAT_ROLES)}")
        messages = [{"role": m.role, "content": m.content} for m in prompt.messages]
        try:
            rendered = tokenizer.apply_chat_template(messages)
        except Exception as exc:
            raise InvalidArgument(f"chat: the chat template failed: {exc}") from exc
        return tokenizer.encode(rendered, add_special_tokens=False), kind

    def validate(self, request: GenerateInput) -> tuple[list[int], GenerateInput]:
        """The prompt's token ids once the whole request is known to be servable here, and the request (its
        default max_tokens cut to the context's room: GenerateInput.fit_max_tokens); or InvalidArgument."""
        if request.model and request.model != self.settings.model_name:
            raise InvalidArgument(
                f"model={request.model!r} is not served here (this worker has {self.settings.model_name!r})"
            )
        if request.sampling.stop and self.engine.tokenizer is None:
            raise InvalidArgument("sampling.stop: this model has no tokenizer")
        check_logit_bias(request.sampling, self._limits)
        ids, field = self.prompt_tokens(request.prompt)
        request = self._fit_max_tokens(request, len(ids))
        ids = check_token_ids(ids, self._limits, field=field, max_tokens=request.sampling.max_tokens)
        # The batch reserves room for max_tokens on admission; a request that can never fit is refused now,
        # before a prefill set spends its forward on it. (One token only comes from prefill: no batch.)
        max_tokens = request.sampling.max_tokens
        need = self.engine.blocks_for(len(ids) + max_tokens)
        capacity = self.engine.cache.num_blocks
        if max_tokens > 1 and need > capacity:
            raise ResourceExhausted(
                f"prompt of {len(ids)} tokens plus max_tokens={max_tokens} need {need} KV blocks of "
                f"{self.engine.block_size} tokens; this decode worker's cache has {capacity}"
            )
        return ids, request

    def _fit_max_tokens(self, request: GenerateInput, prompt_tokens: int) -> GenerateInput:
        """The request with a default max_tokens cut to the room the context, and this worker's cache, leave
        after the prompt."""
        room = min(self._limits.max_seq_len - prompt_tokens, self._cache_room(prompt_tokens))
        sampling = request.sampling
        if not request.fit_max_tokens or sampling.max_tokens <= room or room < 1:
            return request  # a prompt that leaves no room is refused by the checks that follow
        if sampling.min_tokens > room:
            raise InvalidArgument(
                f"sampling.min_tokens={sampling.min_tokens}: the prompt's {prompt_tokens} tokens leave room "
                f"for {room} more in {self._limits.context()} and this decode worker's cache"
            )
        return replace(request, sampling=replace(sampling, max_tokens=room))

    def _cache_room(self, prompt_tokens: int) -> int:
        """The most tokens a sequence of prompt_tokens may generate in this worker's whole cache (0: none)."""
        capacity = self.engine.cache.num_blocks
        low, high = 0, self._limits.max_seq_len
        while low < high:  # blocks_for counts one rank's blocks (about 1/DCP of them with DCP): search it
            middle = (low + high + 1) // 2
            if self.engine.blocks_for(prompt_tokens + middle) <= capacity:
                low = middle
            else:
                high = middle - 1
        return low

    # --- the request path --------------------------------------------------------------------------------

    async def generate(self, request: GenerateInput) -> AsyncIterator[Delta | Summary]:
        """Deltas as tokens come, then one Summary; raises a ServiceError when the request fails.

        Cancel the consuming task (or aclose the iterator) to cancel the request: its blocks are freed and
        its store object released.
        """
        arrived = time.monotonic()
        if request.logprobs and request.sampling.logprobs is None:
            # One switch from here on: sampling.logprobs, which also travels to prefill.
            request = replace(request, sampling=replace(request.sampling, logprobs=0))
        # An empty id gets one; a given one is checked here, at the edge, before any peer sees it.
        request_id = check_request_id(request.request_id) if request.request_id else uuid.uuid4().hex
        request_id_var.set(request_id)
        deadline = arrived + (request.timeout_s if request.timeout_s is not None else _DEFAULT_DEADLINE_S)
        outcome = "error"
        # Current in each step of the request, not across its yields (telemetry.current_in_steps).
        span = _tracer.start_span("decode.generate", attributes={"pcpstack.request_id": request_id})
        steps = self._steps(span, request, request_id, arrived, deadline)
        try:
            # aclosing here and below: a request closed at a yield cleans up at once, not when collected.
            async with aclosing(current_in_steps(span, steps)) as events:
                async for event in events:
                    yield event
            outcome = "ok"
        except InvalidArgument as exc:
            outcome = "invalid"
            record_failure(span, exc)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        except Exception as exc:
            record_failure(span, exc)
            raise
        finally:
            _requests.add(1, {"outcome": outcome})
            span.end()

    async def _steps(
        self, span: trace.Span, request: GenerateInput, request_id: str, arrived: float, deadline: float
    ) -> AsyncIterator[Delta | Summary]:
        """generate's work: check, prefill, then the decoded tokens."""
        if request.prompt is not None and _prompt_chars(request.prompt) > TOKENIZE_ON_THREAD_CHARS:
            ids, request = await asyncio.to_thread(self.validate, request)
        else:
            ids, request = self.validate(request)
        span.set_attribute("pcpstack.prompt_tokens", len(ids))
        reply = await self._prefill(request_id, ids, request.sampling, deadline, request.cache_salt)
        _prefill_time.record(time.monotonic() - arrived)
        _prompt_tokens.add(len(ids))
        async with aclosing(self._decode(request_id, ids, request, reply, arrived)) as events:
            async for event in events:
                yield event

    async def _decode(
        self,
        request_id: str,
        ids: list[int],
        request: GenerateInput,
        reply: prefill_pb2.PrefillResponse,
        arrived: float,
    ) -> AsyncIterator[Delta | Summary]:
        """Streams the first token (sampled by prefill) while the replica loads, then the batch's tokens."""
        params = request.sampling
        checker = StopChecker(params, self.engine.args.eos_token_ids, self.engine.tokenizer)
        first_logprobs = None
        if reply.HasField("first_token_logprobs"):
            first_logprobs = _logprobs_from_wire(reply.first_token_logprobs)
        first = accept_token(checker, reply.first_token_id, first_logprobs)
        first_at: float | None = None
        count = 0
        # The fetch starts before the first token is handed on, so the KV loads while the client reads it.
        fetch = asyncio.ensure_future(self._fetch_kv(reply.kv)) if checker.finish_reason is None else None
        try:
            if first is not None:
                first_at = time.monotonic()
                _ttft.record(first_at - arrived)
                count += first.token_id is not None
                yield Delta(first.token_id, first.text, first.logprob, first.logprobs)
            kv = await fetch if fetch is not None else None
        finally:
            if fetch is not None and not fetch.done():
                fetch.cancel()
                await asyncio.gather(fetch, return_exceptions=True)
            # The one release of this replica: loaded, not needed, failed or cancelled alike. Waited for
            # (done in milliseconds) at most RELEASE_WAIT_S: a store that stalls must not hold the tokens.
            await asyncio.wait({self._in_background(self._release(reply.kv))}, timeout=RELEASE_WAIT_S)
        if kv is not None:
            async with aclosing(self._join_batch(request_id, ids, request, checker, kv)) as events:
                async for event in events:
                    if first_at is None:
                        first_at = time.monotonic()
                        _ttft.record(first_at - arrived)
                    count += event.token_id is not None
                    yield event
        done = time.monotonic()
        if count > 1 and first_at is not None:
            _tpot.record((done - first_at) / (count - 1))
        _e2e.record(done - arrived)
        _generation_tokens.add(count)
        _success.add(1, {"finished_reason": checker.finish_reason or "cancelled"})
        yield Summary(
            request_id=request_id,
            # No reason of its own: the batch ended it (the worker is stopping).
            finish_reason=checker.finish_reason or "cancelled",
            prompt_token_ids=ids,
            completion_tokens=count,
            ttft_s=(first_at or done) - arrived,
            total_s=done - arrived,
            trace_id=current_trace_id(),
            cached_prompt_tokens=reply.kv.cached_tokens,
            matched_stop=checker.matched_stop,
        )

    async def _join_batch(
        self, request_id: str, ids: list[int], request: GenerateInput, checker: StopChecker, kv: KvReplica
    ) -> AsyncIterator[Delta]:
        """Decodes in the shared batch until the request finishes; leaving early cancels it there."""
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        seq_id = f"{request_id}#{next(self._sequence)}"
        self.batcher.submit(
            DecodeRequest(
                seq_id=seq_id,
                kv=kv,
                num_tokens=len(ids),
                checker=checker,
                params=request.sampling,
                emit=lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                logprobs=request.logprobs,
                prompt_ids=ids,
            )
        )
        ended = False
        try:
            while True:
                event = await events.get()
                if event.error is not None:
                    ended = True
                    raise event.error
                if event.finish_reason:
                    ended = True
                    return
                yield Delta(event.token_id, event.text, event.logprob, event.logprobs)
        finally:
            if not ended:
                self.batcher.cancel(seq_id)

    async def _prefill(
        self, request_id: str, ids: list[int], params: SamplingParams, deadline: float, cache_salt: str = ""
    ) -> prefill_pb2.PrefillResponse:
        """Prefill on the least loaded ready set, its replica pushed to the store the router picks (on this
        worker's host if one is live); one retry on another set and store if the first fails as a set.

        Only an UNAVAILABLE failure (a rank died, the set or its store is unreachable) takes the set and the
        store out of routing; an error that belongs to this request fails it alone, with its own kind.
        """
        tried: set[str] = set()
        tried_stores: set[str] = set()
        last_error = ""
        sampling = _sampling_wire(params)
        for _ in range(2):
            try:
                # The registry lookup: Resolve, or its cached answer while fresh or the registry is away.
                with _tracer.start_as_current_span("decode.route") as span:
                    chosen = await self.router.choose(exclude=tried)
                    store = await self.router.choose_store(exclude=tried_stores)
                    span.set_attribute("pcpstack.set_id", chosen.set_id)
                    span.set_attribute("pcpstack.kvstore_address", store)
            except NoReadySet as exc:
                if last_error:  # the failure first: the only set(s) failed, not "none was ready"
                    raise Unavailable(f"{last_error}; no other ready set to retry on") from None
                raise Unavailable(str(exc)) from None
            tried.add(chosen.set_id)
            tried_stores.add(store)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                return await self._prefill_on(chosen, store, request_id, ids, sampling, remaining, cache_salt)
            except (grpc.aio.AioRpcError, ServiceError) as exc:
                error = error_from_rpc(exc) if isinstance(exc, grpc.aio.AioRpcError) else exc
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.CANCELLED:
                    # Not cancelled here (that ends this task): the set's server ended the call, as a
                    # stopping node's does once its grace runs out. Another set may serve it.
                    error = Unavailable(f"the set ended the call ({exc.details() or 'cancelled'})")
                last_error = f"set {chosen.set_id} failed: {error.code}: {error}"
                if not store:
                    last_error += " (the registry named no live KV store; the set used its own --kvstore)"
                # The set's refusal of a lease names the field first. The request's kv_lease_ms is this
                # worker's --kv-lease-ms: not the client's fault.
                lease = self.settings.kv_lease_ms
                if lease and isinstance(error, InvalidArgument) and str(error).startswith("kv_lease_ms="):
                    raise FailedPrecondition(
                        f"this decode worker's --kv-lease-ms={lease} is too long: {error} (prefill on set "
                        f"{chosen.set_id}); the worker must be restarted with a lease within the store's cap"
                    ) from exc
                if not isinstance(error, Unavailable):
                    # Prefill's message first: it names the request's field ("prompt of 900 tokens exceeds
                    # ..."), which the gateway reads to answer the right status and parameter.
                    raise error_of_code(error.code, f"{error} (prefill on set {chosen.set_id})") from exc
                # Which of the two failed is not told apart here; each comes back with a fresh answer.
                self.router.forget(chosen.set_id, store)
        if last_error:
            raise Unavailable(last_error)
        # Out of time, not out of peers: a retry elsewhere with the same deadline would fail the same way.
        raise DeadlineExceeded("the request's deadline passed before prefill")

    async def _prefill_on(
        self,
        chosen: PrefillEndpoint,
        store: str,
        request_id: str,
        ids: list[int],
        sampling: common_pb2.SamplingParams,
        remaining: float,
        cache_salt: str = "",
    ) -> prefill_pb2.PrefillResponse:
        """One Prefill call pushing to `store` ("": the set's default). If the caller leaves first, the call
        is cancelled: the set drops the job if it still queues, or deletes its replica after the forward;
        an answer already on its way names a replica that this worker releases."""
        set_id, address = chosen.set_id, chosen.address
        client = self._prefill_clients.get(address)
        if client is None:
            client = self._prefill_clients[address] = PrefillClient(address)
        self.router.started(set_id, store)
        self._prefilling += 1
        abandon_token = uuid.uuid4().hex
        rpc = client.start_prefill(
            request_id,
            ids,
            sampling,
            kvstore_address=store,
            kv_lease_ms=self.settings.kv_lease_ms,
            expected_fingerprint=self.settings.kv_fingerprint,
            cache_salt=cache_salt,
            abandon_token=abandon_token,
            timeout=min(remaining, self.settings.prefill_timeout_s),
        )
        call = asyncio.ensure_future(_answer(rpc))
        call.add_done_callback(lambda _: self._prefill_done(set_id, store))
        try:
            return await asyncio.shield(call)
        except grpc.aio.AioRpcError as exc:
            # The set may have sent its answer as the call ended on this side: the deadline passed here a
            # moment before it did there, or the connection broke with the answer on the wire.
            if exc.code() in _ANSWER_MAY_BE_LOST:
                self._in_background(self._abandon(client, abandon_token))
            raise
        except asyncio.CancelledError:
            # Nobody will read the answer: under load, a set kept busy with such jobs is what makes callers
            # give up. The RPC is cancelled, not the task awaiting it: an answer this process has already
            # taken in (cancel() does nothing then) still reaches `call`, and its replica is released.
            # Cancelling the task dropped such an answer unread, its replica pinned until its lease ended.
            rpc.cancel()
            call.add_done_callback(lambda done: self._release_abandoned(done, client, abandon_token))
            raise

    def _prefill_done(self, set_id: str, store: str) -> None:
        self._prefilling -= 1
        self.router.finished(set_id, store)

    def _release_abandoned(self, call: asyncio.Future, client: PrefillClient, abandon_token: str) -> None:
        """Releases the replica of an answer taken in after its caller left; where the call ended without
        one, asks the set to delete the replica of an answer it may have sent meanwhile."""
        if call.cancelled() or call.exception() is not None:
            self._in_background(self._abandon(client, abandon_token))
        else:
            self._in_background(self._release(call.result().kv))

    def _in_background(self, work: Awaitable[None]) -> asyncio.Future:
        """Runs a clean-up in a task of its own, kept until done (close waits for it); the task."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _abandon(self, client: PrefillClient, abandon_token: str) -> None:
        try:
            if await client.abandon(abandon_token):
                log.info("the set deletes the replica of an answer this worker never took in")
        except Exception as exc:  # the replica's lease reclaims it anyway
            kind = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else type(exc).__name__
            message = "could not abandon a prefill answer on %s: %s"
            _abandon_failures.warning(f"{client.address} {kind}", message, client.address, exc)

    def _kv_client(self, address: str) -> KvStoreClient:
        client = self._kv_clients.get(address)
        if client is None:
            client = self._kv_clients[address] = KvStoreClient(address)
        return client

    async def _fetch_kv(self, handle: common_pb2.KvHandle) -> KvReplica:
        """The replica as a tensor [layers, 2, tokens, kv_heads, head_dim] of the whole model, put together
        from its shards by K/V head range; with DCP, one part per TP rank (_fetch_parts). Unavailable when a
        shard cannot be read, DataLoss when the shards do not make up the replica."""
        shards = replica_shards(handle, self.engine.layout.num_kv_heads)
        started = time.monotonic()
        with _tracer.start_as_current_span("decode.kv_fetch") as span:
            span.set_attribute("pcpstack.kv_bytes", handle.total_bytes)
            span.set_attribute("pcpstack.kv_shards", len(shards))
            span.set_attribute("pcpstack.cached_tokens", handle.cached_tokens)
            if self.engine.dcp_size > 1:
                parts = await _all_or_none(self._fetch_parts(handle, shards))
                _kv_fetch_time.record(time.monotonic() - started)
                return parts
            # The cached prefix as one part of every head and position, read from its segments by window.
            prefix_read = []
            if handle.cached_tokens:
                sources, objects = self._prefix_plan(handle)
                layout = self.engine.layout
                whole = KvPart(0, range(layout.num_kv_heads), (range(handle.cached_tokens),))
                prefix_read.append(
                    self._fetch_part(handle, objects, whole, part_reads(whole, sources, layout))
                )
            parts = await _all_or_none(
                [*(self._fetch_shard(handle, shard) for shard in shards), *prefix_read]
            )
        _kv_fetch_time.record(time.monotonic() - started)
        prefix, parts = parts[len(shards) :], parts[: len(shards)]
        if len(parts) == 1:
            new = parts[0]
        else:
            layout = self.engine.layout
            new = torch.empty(
                (
                    layout.num_layers,
                    2,
                    handle.num_tokens - handle.cached_tokens,
                    layout.num_kv_heads,
                    layout.head_dim,
                ),
                dtype=layout.torch_dtype,
            )
            for shard, part in zip(shards, parts, strict=True):
                new[:, :, :, shard.kv_head_start : shard.kv_head_end] = part
        return torch.cat([*prefix, new], dim=2) if prefix else new

    def _prefix_plan(
        self, handle: common_pb2.KvHandle
    ) -> tuple[list[KvSource], list[tuple[str, str, str, str]]]:
        """The cached prefix's segments as sources over common windows (decode.kv_ranges.prefix_sources),
        and the (key, fingerprint, capability, lease id) of each source's object, read through the handle's
        prefix lease. DataLoss when the segments do not make up the prefix of every K/V head."""
        layout = self.engine.layout
        itemsize = torch.empty(0, dtype=layout.torch_dtype).element_size()
        runs = []
        for segment in handle.prefix_segments:
            # A segment without heads (a prefill set without TP) holds every head.
            heads = range(segment.kv_head_start, segment.kv_head_end or layout.num_kv_heads)
            token_bytes = layout.num_layers * 2 * len(heads) * layout.head_dim * itemsize
            object_tokens, rest = divmod(segment.object_bytes, token_bytes) if heads else (0, 0)
            if not heads or rest or segment.token_start + segment.token_count > object_tokens:
                raise DataLoss(
                    f"cached prefix segment {segment.key} (K/V heads {heads.start}-{heads.stop}) does not "
                    f"fit its {segment.object_bytes} bytes"
                )
            runs.append(KvSource(0, segment.token_count, heads, object_tokens, segment.token_start))
        try:
            placed = prefix_sources(runs, layout.num_kv_heads, handle.cached_tokens)
        except ValueError as exc:
            raise DataLoss(
                f"the cached prefix segments do not make up its {handle.cached_tokens} tokens: {exc}"
            ) from exc
        segments = handle.prefix_segments
        objects = [
            (
                segments[index].key,
                segments[index].fingerprint or handle.fingerprint,
                handle.prefix_lease_capability,
                handle.prefix_lease_id,
            )
            for index, _ in placed
        ]
        return [source for _, source in placed], objects

    def _fetch_parts(
        self, handle: common_pb2.KvHandle, shards: list[common_pb2.KvShard]
    ) -> list[Awaitable[torch.Tensor]]:
        """One fetch per TP rank of a DCP worker: the rank's own token blocks of its K/V heads, read with
        ranged Gets from the objects that hold them (never a whole object per rank): the cached prefix's runs
        (through the handle's prefix lease), then the shards of the new tokens."""
        layout = self.engine.layout
        itemsize = torch.empty(0, dtype=layout.torch_dtype).element_size()
        heads = [range(shard.kv_head_start, shard.kv_head_end) for shard in shards]
        new_tokens = handle.num_tokens - handle.cached_tokens
        for shard, held in zip(shards, heads, strict=True):
            expected = layout.num_layers * 2 * new_tokens * len(held) * layout.head_dim * itemsize
            if shard.total_bytes and shard.total_bytes != expected:
                raise DataLoss(
                    f"KV shard {shard.key} holds {shard.total_bytes} bytes; K/V heads {held.start}-"
                    f"{held.stop} of {new_tokens} tokens are {expected} bytes in {layout.dtype}"
                )
        # the sources in sequence order, and (key, fingerprint, capability, lease id) of each one's object
        sources, objects = self._prefix_plan(handle) if handle.cached_tokens else ([], [])
        sources += shard_sources(heads, new_tokens, start=handle.cached_tokens)
        objects += [(shard.key, shard.fingerprint, shard.capability, "") for shard in shards]
        return [
            self._fetch_part(handle, objects, part, part_reads(part, sources, layout))
            for part in self.engine.kv_parts(handle.num_tokens)
        ]

    async def _fetch_part(
        self,
        handle: common_pb2.KvHandle,
        objects: list[tuple[str, str, str, str]],
        part: KvPart,
        reads: list[ShardRead],
    ) -> torch.Tensor:
        """One rank's part [layers, 2, its tokens, its heads, head_dim], its reads run at once."""
        client = self._kv_client(handle.store_address)

        async def read(planned: ShardRead) -> memoryview:
            key, fingerprint, capability, lease_id = objects[planned.shard_index]
            try:
                data, _ = await client.get(
                    key, fingerprint, capability, ranges=planned.ranges, lease_id=lease_id
                )
            except Exception as exc:
                what = f"TP rank {part.tp_rank}'s KV of {key}"
                raise Unavailable(f"could not fetch {what}: {exc}") from exc
            _kv_bytes.add(len(data))
            return data

        data = await _all_or_none(read(planned) for planned in reads)
        return assemble_part(part, reads, data, self.engine.layout)

    async def _fetch_shard(self, handle: common_pb2.KvHandle, shard: common_pb2.KvShard) -> torch.Tensor:
        """One store object of a replica: [layers, 2, tokens, its heads, head_dim] in the layout's dtype."""
        layout = self.engine.layout
        try:
            data, _ = await self._kv_client(handle.store_address).get(
                shard.key, shard.fingerprint, shard.capability
            )
        except Exception as exc:
            raise Unavailable(f"could not fetch the KV replica's shard {shard.key}: {exc}") from exc
        _kv_bytes.add(len(data))
        shape = (
            layout.num_layers,
            2,
            handle.num_tokens - handle.cached_tokens,  # the tokens after a cached prefix
            shard.kv_head_end - shard.kv_head_start,
            layout.head_dim,
        )
        # Bytes first, then the dtype: numpy (under frombuffer) has no bfloat16.
        raw = torch.frombuffer(bytearray(data) if isinstance(data, bytes) else data, dtype=torch.uint8)
        itemsize = torch.empty(0, dtype=layout.torch_dtype).element_size()
        if raw.numel() != itemsize * torch.Size(shape).numel():
            raise DataLoss(
                f"KV shard {shard.key} holds {raw.numel()} bytes; K/V heads "
                f"{shard.kv_head_start}-{shard.kv_head_end} of {shape[2]} tokens are "
                f"{itemsize * torch.Size(shape).numel()} bytes in {layout.dtype}"
            )
        return raw.view(layout.torch_dtype).view(shape)

    async def _release(self, handle: common_pb2.KvHandle) -> None:
        """Releases every store object of the replica (each once) and its prefix lease; a failure is logged,
        not raised."""
        # Unchecked: whatever the handle names is pinned and released, even shards that do not fit together;
        # by key, so an object named twice is released once.
        named = replica_shards(handle, self.engine.layout.num_kv_heads, check=False)
        shards = list({shard.key: shard for shard in named}.values())
        client = self._kv_client(handle.store_address)
        releases = [client.release(shard.key, shard.capability) for shard in shards]
        names = [shard.key for shard in shards]
        if handle.prefix_lease_id:
            releases.append(
                client.release(handle.prefix_lease_id, handle.prefix_lease_capability, lease=True)
            )
            names.append(f"prefix lease {handle.prefix_lease_id}")
        outcomes = await asyncio.gather(*releases, return_exceptions=True)
        for name, outcome in zip(names, outcomes, strict=True):
            if isinstance(outcome, BaseException):  # the store's lease reclaims it anyway
                log.warning("release of %s failed: %s", name, outcome)


async def _answer(rpc: grpc.aio.UnaryUnaryCall) -> prefill_pb2.PrefillResponse:
    """The answer of a started Prefill call, awaited in a task of its own."""
    return await rpc


async def _all_or_none(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Every result in order; the first failure cancels the rest (their objects are released anyway) and is
    raised once they have stopped."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def replica_shards(
    handle: common_pb2.KvHandle, num_kv_heads: int, check: bool = True
) -> list[common_pb2.KvShard]:
    """The store objects of a replica in K/V head order. A handle without shards (a writer before TP) is one
    object holding every head. With `check`, DataLoss unless the shards cover heads 0..num_kv_heads, each
    exactly once."""
    if not handle.shards:
        return [
            common_pb2.KvShard(
                key=handle.key,
                capability=handle.capability,
                kv_head_start=0,
                kv_head_end=num_kv_heads,
                total_bytes=handle.total_bytes,
                fingerprint=handle.fingerprint,
            )
        ]
    shards = sorted(handle.shards, key=lambda shard: shard.kv_head_start)
    if check:
        fits, next_head = True, 0
        for shard in shards:
            fits = fits and shard.kv_head_start == next_head < shard.kv_head_end
            next_head = shard.kv_head_end
        if not fits or next_head != num_kv_heads:
            covered = ", ".join(f"{s.kv_head_start}-{s.kv_head_end}" for s in shards)
            raise DataLoss(
                f"the KV replica's shards hold K/V heads {covered}; this model needs heads 0-{num_kv_heads} "
                "each exactly once"
            )
    return shards


def _sampling_wire(params: SamplingParams) -> common_pb2.SamplingParams:
    """The wire form of parsed sampling parameters, for the Prefill call."""
    return sampling_to_wire(params, common_pb2.SamplingParams())


def _logprobs_from_wire(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    """The first token's log-probabilities as prefill sent them."""
    return TokenLogprobs(
        msg.chosen.token_id, msg.chosen.logprob, tuple((t.token_id, t.logprob) for t in msg.top)
    )
