"""Continuous batching: one thread runs decode steps over every active request at once.

Requests join between steps as soon as their KV replica is loaded and leave as soon as they finish or are
cancelled, so the batch changes every step. The engine is touched only from the loop thread; the asyncio
side talks to it through a thread-safe inbox and gets tokens back through per-request callbacks.

Admission is by KV blocks: a request is admitted only when the cache can hold its prompt and all of its
max_tokens, so a running request never runs out of blocks half-way. Blocks are counted per rank
(engine.blocks_for): a decode context-parallel rank holds about 1/D of each sequence.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from pcpstack.common.errors import Internal, ResourceExhausted, ServiceError
from pcpstack.common.telemetry import latency_histogram, meter
from pcpstack.engine.engine import Engine
from pcpstack.engine.sampling import (
    SamplingParams,
    StopChecker,
    TokenHistory,
    TokenLogprobs,
    generator_after_first_token,
    raw_logprobs,
    sample_batch,
    token_logprobs,
)

log = logging.getLogger(__name__)
# A prompt's KV as the batch adopts it: the whole model's replica [layers, 2, prompt_tokens, kv_heads,
# head_dim], or with decode context parallelism one part per TP rank (engine.kv_parts says which).
KvReplica = torch.Tensor | list[torch.Tensor]
_queue_time = latency_histogram(
    meter("pcpstack.decode"),
    "pcpstack.request_queue_time",
    "seconds a request waited in the batch queue for KV blocks before it started decoding",
)


@dataclass
class TokenEvent:
    """One generated token (or the end of a request) as delivered to the request's callback."""

    token_id: int | None
    text: str
    logprob: float | None = None
    finish_reason: str | None = None
    error: ServiceError | None = None
    # The token's log-probability with its alternatives, when the request asked for them.
    logprobs: TokenLogprobs | None = None


def accept_token(checker: StopChecker, token: int, logprobs: TokenLogprobs | None) -> TokenEvent | None:
    """Records one sampled token; returns what to stream (None when nothing shows yet).

    Stop and EOS tokens end the request without being part of the answer, and text that may still turn
    into a stop string is held back; `checker.finish_reason` says when the request is done. `logprobs`
    travels with the token only when the token is emitted.
    """
    kept_before = len(checker.token_ids)
    text = checker.push(token)
    emitted = token if len(checker.token_ids) > kept_before else None
    if emitted is None:
        return TokenEvent(None, text) if text else None
    value = None if logprobs is None else logprobs.logprob
    return TokenEvent(emitted, text, value, logprobs=logprobs)


@dataclass
class DecodeRequest:
    """A request ready to decode: its prompt's KV replica, its limits, and its StopChecker, which has
    already taken the first token (prefill samples it, and it is streamed before the KV is loaded)."""

    seq_id: Hashable
    kv: KvReplica
    num_tokens: int
    checker: StopChecker
    params: SamplingParams
    emit: Callable[[TokenEvent], None]
    # Asks for log-probabilities even when params.logprobs is unset (then without alternatives).
    logprobs: bool = False
    generator: torch.Generator | None = field(default=None, repr=False)
    blocks: int = 0
    # The prompt, for the repetition penalty (empty: the penalty sees the generated tokens only).
    prompt_ids: Sequence[int] = ()
    # When it was submitted: its queue time ends when it is admitted.
    submitted_at: float = field(default_factory=time.monotonic)

    @property
    def top_logprobs(self) -> int | None:
        """How many alternatives each token's log-probabilities list; None: no log-probabilities."""
        if self.params.logprobs is not None:
            return self.params.logprobs
        return 0 if self.logprobs else None

    def history(self) -> TokenHistory:
        """What this request's logits processors look at now."""
        return TokenHistory(self.prompt_ids, self.checker.token_ids, self.checker.stop_ids)

    @property
    def last_token(self) -> int:
        """The token the next decode step feeds in: the last one sampled (a running request's last token
        is always kept; a stop token would have ended it)."""
        return self.checker.token_ids[-1]


class Batcher:
    """The decode loop of one worker; `submit` and `cancel` are safe to call from any thread."""

    def __init__(self, engine: Engine, max_batch: int = 16) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._waiting: deque[DecodeRequest] = deque()
        self._active: dict[Hashable, DecodeRequest] = {}
        self._reserved_blocks = 0
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Requests waiting for blocks plus requests decoding."""
        return len(self._waiting) + len(self._active)

    @property
    def active(self) -> int:
        """Requests decoding now."""
        return len(self._active)

    @property
    def waiting(self) -> int:
        """Requests queued for KV blocks, not decoding yet."""
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        """The fraction of the cache's blocks reserved by admitted requests (prompt plus max_tokens each)."""
        return self._reserved_blocks / self.engine.cache.num_blocks

    def submit(self, request: DecodeRequest) -> None:
        """Queues a request; its first token is emitted as soon as it is admitted."""
        self._inbox.put(("submit", request))
        self._wake.set()

    def cancel(self, seq_id: Hashable) -> None:
        """Stops a request and frees its blocks; unknown or finished ids are ignored."""
        self._inbox.put(("cancel", seq_id))
        self._wake.set()

    def close(self) -> None:
        """Stops the loop thread (requests still running are cancelled)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # --- loop thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            self._admit()
            if not self._active:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self._step()
            except Exception as exc:  # a failed step fails its requests, never the worker
                log.exception("decode step failed")
                # A ServiceError keeps its kind: a TP engine whose rank died is Unavailable, not Internal.
                error = exc if isinstance(exc, ServiceError) else Internal(f"decode step failed: {exc}")
                for request in list(self._active.values()):
                    self._finish(request, TokenEvent(None, "", error=error))
        for request in [*self._active.values(), *self._waiting]:
            self._finish(request, TokenEvent(None, "", finish_reason="cancelled"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._waiting.append(item)  # type: ignore[arg-type]
            else:
                self._cancel(item)

    def _cancel(self, seq_id: Hashable) -> None:
        request = self._active.get(seq_id)
        if request is None:
            request = next((r for r in self._waiting if r.seq_id == seq_id), None)
            if request is None:
                return
            self._waiting.remove(request)
        self._finish(request, TokenEvent(None, "", finish_reason="cancelled"))

    def _admit(self) -> None:
        capacity = self.engine.cache.num_blocks
        while self._waiting:
            request = self._waiting[0]
            # Blocks of one rank's cache: with DCP a rank holds about 1/D of each sequence.
            need = self.engine.blocks_for(request.num_tokens + request.params.max_tokens)
            if need > capacity:
                self._waiting.popleft()
                self._finish(
                    request,
                    TokenEvent(
                        None,
                        "",
                        error=ResourceExhausted(
                            f"prompt of {request.num_tokens} tokens plus "
                            f"max_tokens={request.params.max_tokens} needs {need} KV blocks; the cache has "
                            f"{capacity}"
                        ),
                    ),
                )
                continue
            if self._reserved_blocks + need > capacity:
                return
            self._waiting.popleft()
            self._reserved_blocks += need
            request.blocks = need
            try:
                if isinstance(request.kv, list):
                    self.engine.adopt_parts(request.seq_id, request.kv, request.num_tokens)
                else:
                    self.engine.adopt_sequence(request.seq_id, request.kv, request.num_tokens)
            except Exception as exc:
                self._reserved_blocks -= need  # never admitted: _finish only returns an active one's blocks
                error = exc
                if not isinstance(exc, ServiceError):
                    error = Internal(f"could not load the KV replica: {exc}")
                self._finish(request, TokenEvent(None, "", error=error))
                continue
            request.kv = torch.empty(0)  # the cache holds it now
            request.generator = generator_after_first_token(request.params, self.engine.args.vocab_size)
            self._active[request.seq_id] = request
            _queue_time.record(time.monotonic() - request.submitted_at)

    def _step(self) -> None:
        batch = list(self._active.values())[: self.max_batch]
        logits = self.engine.decode_step([r.seq_id for r in batch], [r.last_token for r in batch])
        tokens = sample_batch(
            logits, [r.params for r in batch], [r.generator for r in batch], [r.history() for r in batch]
        )
        want_logprobs = any(r.top_logprobs is not None for r in batch)
        logprobs = raw_logprobs(logits) if want_logprobs else None
        for row, (request, token) in enumerate(zip(batch, tokens, strict=True)):
            top = request.top_logprobs
            value = None
            if logprobs is not None and top is not None:
                value = token_logprobs(logprobs[row], token, top)
            self._accept(request, token, value)
        # Requests beyond max_batch go first next step, so none starves.
        for request in batch:
            if request.seq_id in self._active:
                self._active[request.seq_id] = self._active.pop(request.seq_id)

    def _accept(self, request: DecodeRequest, token: int, logprobs: TokenLogprobs | None) -> None:
        event = accept_token(request.checker, token, logprobs)
        if event is not None:
            request.emit(event)
        if request.checker.finish_reason is not None:
            self._finish(request, TokenEvent(None, "", finish_reason=request.checker.finish_reason))

    def _finish(self, request: DecodeRequest, event: TokenEvent) -> None:
        if self._active.pop(request.seq_id, None) is not None:
            self.engine.free(request.seq_id)
            self._reserved_blocks -= request.blocks
        request.emit(event)
