"""The Prefill servicer: turns a PrefillRequest into a job for the node's set and the outcome into a reply.

Every check on the request happens here, before any rank works: an empty prompt, one longer than the
model's context, token ids outside the vocabulary and bad sampling values are INVALID_ARGUMENT; a node
that is not the master, or whose set is not ready, answers UNAVAILABLE/FAILED_PRECONDITION at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace

import grpc
from opentelemetry.metrics import Observation
from opentelemetry.propagate import inject

from pcpstack.common.logs import request_id_var
from pcpstack.common.telemetry import meter, tracer
from pcpstack.engine.sampling import sampling_from_wire
from pcpstack.kvstore.client import make_key
from pcpstack.prefill.node import ModelInfo, RankSupervisor, SetUnavailable
from pcpstack.prefill.rank import PrefillJob
from pcpstack.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
_tracer = tracer(__name__)
_meter = meter("pcpstack.prefill")
_requests = _meter.create_counter("pcpstack.prefill.requests", description="Prefill requests by outcome")
_forward = _meter.create_histogram("pcpstack.prefill.forward", unit="s", description="prefill forward time")


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """Serves Prefill on the master node of a PCP set."""

    def __init__(
        self,
        supervisor: RankSupervisor,
        info: ModelInfo,
        default_kvstore: Callable[[], Awaitable[str]],
        lease_ms: int = 0,
    ) -> None:
        self.supervisor = supervisor
        self.info = info
        self._background: set[asyncio.Future] = set()
        _meter.create_observable_gauge(
            "pcpstack.prefill.queue_depth",
            callbacks=[lambda _: [Observation(supervisor.load)]],
            description="prefill jobs queued or running on this set",
        )
        self._default_kvstore = default_kvstore
        self._lease_ms = lease_ms

    def _discard(self, done: asyncio.Future, fingerprint: str, job: PrefillJob) -> None:
        """Deletes the replica of a job whose caller left: nobody will ever release it."""
        if done.cancelled() or done.exception() is not None or done.result().error:
            return
        task = asyncio.ensure_future(self._delete(job.kvstore_address, make_key(job.request_id, fingerprint)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _delete(self, address: str, key: str) -> None:
        from pcpstack.kvstore.client import KvStoreClient

        client = KvStoreClient(address)
        try:
            await client.delete(key)
        except Exception as exc:  # the store's lease reclaims it anyway
            log.warning("could not delete abandoned replica %s: %s", key, exc)
        finally:
            await client.close()

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        request_id_var.set(request.request_id)
        info = self.info
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        if not request.token_ids:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "token_ids: the prompt must hold at least one token"
            )
        if len(request.token_ids) > info.max_seq_len:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"token_ids: {len(request.token_ids)} tokens exceed the model context ({info.max_seq_len})",
            )
        bad = next((i for i, t in enumerate(request.token_ids) if t >= info.vocab_size), None)
        if bad is not None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"token_ids[{bad}]={request.token_ids[bad]} is not below the vocab size {info.vocab_size}",
            )
        try:
            # Prefill samples one token; max_tokens matters to decode only.
            sampling = sampling_from_wire(request.sampling, default_max_tokens=1)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.expected_fingerprint and request.expected_fingerprint != info.fingerprint:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"expected_fingerprint={request.expected_fingerprint[:16]}… but this set produces KV with "
                f"fingerprint {info.fingerprint[:16]}… (another model or KV layout)",
            )
        running = self.supervisor.current
        if running is None or not running.ready.is_set() or running.failed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node has no ready PCP set")
        if not running.is_master:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this node is headless in set {running.assignment.set_id}; send Prefill to its master at "
                f"{running.assignment.master_addr}",
            )
        store = request.kvstore_address or await self._default_kvstore()
        if not store:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no KV store is known to push the replica to")
        job = PrefillJob(
            request_id=request.request_id,
            token_ids=list(request.token_ids),
            sampling=vars(sampling),
            kvstore_address=store,
            lease_ms=request.kv_lease_ms or self._lease_ms,
        )
        with _tracer.start_as_current_span("prefill.set") as span:
            carrier: dict[str, str] = {}
            inject(carrier)
            job = replace(job, trace_context=carrier)
            span.set_attribute("pcpstack.request_id", request.request_id)
            span.set_attribute("pcpstack.prompt_tokens", len(job.token_ids))
            span.set_attribute("pcpstack.pcp_size", running.assignment.pcp_size)
            # The set finishes a job it started even if the caller leaves; then its replica is deleted.
            task = asyncio.ensure_future(self.supervisor.run_job(job))
            try:
                outcome = await asyncio.wait_for(asyncio.shield(task), context.time_remaining())
            except SetUnavailable as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            except (TimeoutError, asyncio.CancelledError) as exc:
                task.add_done_callback(lambda done: self._discard(done, info.fingerprint, job))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish within the deadline"
                )
            span.set_attribute("pcpstack.replica_rank", outcome.replica_rank)
        if outcome.error:
            _requests.add(1, {"outcome": "error"})
            await context.abort(grpc.StatusCode.UNAVAILABLE, outcome.error)
        _requests.add(1, {"outcome": "ok"})
        _forward.record(outcome.forward_seconds)
        layout = info.layout
        return prefill_pb2.PrefillResponse(
            request_id=request.request_id,
            first_token_id=outcome.first_token_id,
            kv=common_pb2.KvHandle(
                key=make_key(request.request_id, info.fingerprint),
                fingerprint=info.fingerprint,
                layout=common_pb2.KvLayout(**layout),
                num_tokens=len(job.token_ids),
                source_pcp_rank=outcome.replica_rank,
                store_address=store,
                total_bytes=outcome.total_bytes,
            ),
            set_id=running.assignment.set_id,
            generation=running.assignment.generation,
            pcp_size=running.assignment.pcp_size,
            forward_seconds=outcome.forward_seconds,
            kv_push_seconds=outcome.push_seconds,
        )
