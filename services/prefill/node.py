"""A prefill node: the supervisor process of the ranks one host contributes to a set.

The node registers with the registry, waits for its assignment on the Session stream, then starts one
process per global rank the assignment names (the TP ranks of its PCP ranks; an assignment without global
ranks is tp 1: its PCP ranks) and reports the set ready once every local rank has loaded its model shard
and joined the process groups. A rank process's position on this node (its local index) picks its device.
On the master node (the one running global rank 0) it serves Prefill by handing jobs to global rank 0:
jobs queue, and the set takes the waiting ones that fit into one forward (batched prefill, up to
`prefill_batch_max`; each job still gets its own outcome). A job whose caller leaves while it waits is
withdrawn and never runs, so an overloaded set spends no forward on answers nobody will read.
When a rank dies, or the group stops making progress, the node fails the requests in flight with
UNAVAILABLE (SetUnavailable), tells the registry, stops its ranks and waits to be re-assigned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from pcpstack.common.telemetry import meter
from pcpstack.engine.config import ModelArgs
from pcpstack.engine.device import default_dtype, pick_device
from pcpstack.engine.engine import DEFAULT_CACHE_TOKENS
from pcpstack.engine.kv_cache import KvLayout, blocks_needed
from pcpstack.engine.prompt import PromptLimits
from pcpstack.engine.weights import describe_model
from pcpstack.prefill.batch import BATCH_TOKENS, jobs_in_batch
from pcpstack.prefill.errors import NotMaster, SetUnavailable
from pcpstack.prefill.job import PrefillJob, PrefillOutcome
from pcpstack.prefill.rank import RankReady, RankSpec, rank_main
from pcpstack.v1 import registry_pb2

log = logging.getLogger(__name__)
# How many prompts each forward of the set took (batched prefill: up to --prefill-batch-max, BATCH_TOKENS).
_batch_prompts = meter("pcpstack.prefill").create_histogram(
    "pcpstack.prefill_batch_prompts",
    description="prompts the set prefilled in one forward",
    explicit_bucket_boundaries_advisory=(1, 2, 4, 8, 16, 32, 64),
)


@dataclass(frozen=True)
class ModelInfo:
    """What the node knows of its model without running it: enough to validate requests and build handles."""

    fingerprint: str
    layout: KvLayout
    # The whole model's arguments (heads, vocabulary, context length).
    args: ModelArgs

    @property
    def limits(self) -> PromptLimits:
        """What a prompt for this model may hold."""
        return PromptLimits(self.vocab_size, self.max_seq_len, self.args.sliding_window)

    @classmethod
    def probe(cls, model: str | None, block_size: int, device: str = "") -> ModelInfo:
        """Reads the model's shape and identity from its config or GGUF header (no weights are loaded here)
        and the replica fingerprint its ranks will have in the dtype they run on `device` (cpu, cuda, npu;
        "" = what is present)."""
        kind = device or pick_device().type
        described = describe_model(model)
        dtype = default_dtype(torch.device(kind))
        layout = KvLayout.for_model(described.model_id, described.args, dtype, block_size)
        return cls(layout.fingerprint(), layout, described.args)

    @property
    def vocab_size(self) -> int:
        """Size of the model's vocabulary."""
        return self.args.vocab_size

    @property
    def max_seq_len(self) -> int:
        """The model's context length."""
        return self.args.max_seq_len

    @property
    def num_kv_heads(self) -> int:
        """The whole model's K/V heads (a replica holds them all)."""
        return self.args.n_kv_heads


@dataclass(frozen=True)
class NodeOptions:
    """How a prefill node runs its ranks."""

    model: str | None
    block_size: int
    advertised_host: str
    # Rank processes per node: tp x pcp / nnodes.
    local_ranks: int = 1
    # cpu, cuda or npu ("" = what is present).
    device: str = ""
    threads_per_rank: int = 1
    collective_timeout_s: float = 120.0
    idle_tick_s: float = 1.0
    start_timeout_s: float = 600.0
    # Tokens of K/V each rank's cache holds: the longest prompt the set takes (each rank keeps it whole).
    kv_cache_tokens: int = DEFAULT_CACHE_TOKENS
    # Longest chunk of a prompt one forward runs; 0: the whole prompt in one forward.
    prefill_chunk_tokens: int = 0
    # Most waiting jobs the set prefills in one forward (--prefill-batch-max); 1: one job at a time.
    prefill_batch_max: int = 1


@dataclass
class _RankProcess:
    process: mp.Process  # type: ignore[name-defined]
    conn: Connection
    progress: object  # the time of the group's last step or layer, as this rank saw it
    running_at: object  # the time the process last ran at all (rank._keep_running_stamp)
    global_rank: int
    ready: bool = False


@dataclass(eq=False)
class _Waiting:
    """A job in the node's queue, the future of (the set that ran it, its outcome), and the run_job task
    waiting for its turn (cancelled if its caller leaves before the set takes the job)."""

    job: PrefillJob
    result: asyncio.Future
    task: asyncio.Task


@dataclass
class RunningSet:
    """The ranks this node runs for one assignment."""

    assignment: registry_pb2.Assignment
    ranks: list[_RankProcess]
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    failed: str = ""
    pending: asyncio.Future | None = None

    @property
    def is_master(self) -> bool:
        """Whether global rank 0 (which takes jobs) is on this node."""
        return 0 in [r.global_rank for r in self.ranks]


class RankSupervisor:
    """Starts, watches and stops the local rank processes of this node's current set."""

    def __init__(
        self, options: NodeOptions, info: ModelInfo, on_failure: Callable[[RunningSet, str], None]
    ) -> None:
        self.options = options
        self.info = info
        self.current: RunningSet | None = None
        self._on_failure = on_failure
        self._ctx = mp.get_context("spawn")
        self._job_lock = asyncio.Lock()
        # Held while a set's ranks stop: a set started meanwhile (the registry re-forms a failed set at once)
        # would find the old ranks still holding its ports.
        self._stop_lock = asyncio.Lock()
        self.waiting = 0
        # Jobs not yet handed to the set, oldest first.
        self._queue: list[_Waiting] = []

    @property
    def load(self) -> int:
        """Jobs queued or running."""
        return self.waiting

    async def start(self, assignment: registry_pb2.Assignment) -> RunningSet:
        """Starts the local ranks of `assignment` and waits until they have joined the group."""
        await self.stop("re-assigned")
        loop = asyncio.get_running_loop()
        ranks = []
        tp_size = assignment.tp_size or 1
        global_ranks = list(assignment.global_ranks) or list(assignment.pcp_ranks)
        for local_index, global_rank in enumerate(global_ranks):
            spec = RankSpec(
                model=self.options.model,
                global_rank=global_rank,
                pcp_size=assignment.pcp_size,
                tp_size=tp_size,
                device=self.options.device,
                local_index=local_index,
                master_addr=assignment.master_addr,
                master_port=assignment.master_port,
                block_size=self.options.block_size,
                advertised_host=self.options.advertised_host,
                threads=self.options.threads_per_rank,
                collective_timeout_s=self.options.collective_timeout_s,
                idle_tick_s=self.options.idle_tick_s,
                log_level=logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                kv_cache_tokens=self.options.kv_cache_tokens,
                prefill_chunk_tokens=self.options.prefill_chunk_tokens,
            )
            parent, child = self._ctx.Pipe()
            progress = self._ctx.Value("d", 0.0, lock=False)
            running_at = self._ctx.Value("d", time.time(), lock=False)
            process = self._ctx.Process(
                target=rank_main, args=(spec, child, progress, running_at), daemon=True
            )
            process.start()
            child.close()
            ranks.append(_RankProcess(process, parent, progress, running_at, global_rank))
        running = RunningSet(assignment, ranks)
        self.current = running
        for rank in ranks:
            threading.Thread(
                target=self._read,
                args=(loop, running, rank),
                name=f"rank-{rank.global_rank}-reader",
                daemon=True,
            ).start()
        try:
            await asyncio.wait_for(running.ready.wait(), self.options.start_timeout_s)
        except TimeoutError:
            await self.stop("ranks did not start in time")
            raise SetUnavailable(
                f"ranks {global_ranks} did not join set {assignment.set_id} within "
                f"{self.options.start_timeout_s:.0f} s"
            ) from None
        if running.failed:
            raise SetUnavailable(running.failed)
        return running

    def _read(self, loop: asyncio.AbstractEventLoop, running: RunningSet, rank: _RankProcess) -> None:
        """Reader thread of one rank's pipe: readiness, outcomes, failures, and EOF when it dies."""
        while True:
            try:
                message = rank.conn.recv()
            except (EOFError, OSError):
                message = f"rank {rank.global_rank} exited (code {rank.process.exitcode})"
            loop.call_soon_threadsafe(self._on_message, running, rank, message)
            if isinstance(message, str):
                return

    def _on_message(self, running: RunningSet, rank: _RankProcess, message: object) -> None:
        if isinstance(message, RankReady):
            if message.fingerprint != self.info.fingerprint:
                self._fail(running, f"rank {rank.global_rank} loaded a model with another KV fingerprint")
                return
            rank.ready = True
            if all(r.ready for r in running.ranks):
                running.ready.set()
        elif isinstance(message, list):  # the outcomes of one forward's jobs
            if running.pending is not None and not running.pending.done():
                running.pending.set_result(message)
        elif isinstance(message, str):
            self._fail(running, message)

    def _fail(self, running: RunningSet, reason: str) -> None:
        if running.failed or self.current is not running:
            return
        running.failed = reason
        log.error("set %s failed: %s", running.assignment.set_id, reason)
        if running.pending is not None and not running.pending.done():
            running.pending.set_exception(SetUnavailable(reason))
        running.ready.set()  # wakes a start() still waiting
        self._on_failure(running, reason)

    def check_progress(self, stale_after_s: float) -> None:
        """Fails the set when a rank died, its process stopped running (stopped or frozen: even mid-job, so
        the job fails over now rather than when the group's collective timeout ends it) or, while no job
        runs, its group made no progress for stale_after_s seconds. A job's own steps are not timed: one
        layer of a long prompt, or a push to a slow store, may take longer."""
        running = self.current
        if running is None or running.failed or not running.ready.is_set():
            return
        now = time.time()
        for rank in running.ranks:
            if not rank.process.is_alive():
                self._fail(running, f"rank {rank.global_rank} exited (code {rank.process.exitcode})")
                return
            if now - rank.running_at.value > stale_after_s:
                self._fail(
                    running,
                    f"rank {rank.global_rank} has not run for {now - rank.running_at.value:.1f} s (its "
                    "process is stopped or frozen)",
                )
                return
            if now - rank.progress.value > stale_after_s and (
                running.pending is None or running.pending.done()
            ):
                self._fail(
                    running, f"rank {rank.global_rank} made no progress for {now - rank.progress.value:.1f} s"
                )
                return

    def ready_set(self) -> RunningSet:
        """The set a job would run on now; SetUnavailable when none is ready, NotMaster on a headless node."""
        running = self.current
        if running is None or not running.ready.is_set() or running.failed:
            detail = f": {running.failed}" if running is not None and running.failed else ""
            raise SetUnavailable(f"this node has no ready PCP set{detail}")
        if not running.is_master:
            raise NotMaster(
                f"this node is headless in set {running.assignment.set_id}; send Prefill to its master at "
                f"{running.assignment.master_addr}"
            )
        return running

    async def run_job(self, job: PrefillJob) -> tuple[RunningSet, PrefillOutcome]:
        """Runs one job and returns the set that ran it with its outcome; raises SetUnavailable when the set
        cannot run it. A failure of the job alone is in the outcome. Jobs queue; the oldest takes the
        waiting jobs that fit after it into the same forward (`_run_batch`). A job `withdraw`n while it
        waits raises CancelledError."""
        waiting = _Waiting(job, asyncio.get_running_loop().create_future(), asyncio.current_task())
        self._queue.append(waiting)
        self.waiting += 1
        try:
            async with self._job_lock:
                if not waiting.result.done():  # else it ran in the batch of a job queued before it
                    await self._run_batch(waiting)
            return await waiting.result
        finally:
            self.waiting -= 1
            if waiting in self._queue:
                self._queue.remove(waiting)

    def withdraw(self, job: PrefillJob) -> None:
        """Takes a job whose caller left off the queue if the set has not taken it yet: it never runs (nor
        joins a batch) and its run_job raises CancelledError. A job the set has taken runs to the end."""
        waiting = next((w for w in self._queue if w.job is job), None)
        if waiting is not None:
            self._queue.remove(waiting)
            waiting.task.cancel()

    async def _run_batch(self, head: _Waiting) -> None:
        """Runs `head` with the jobs queued after it that fit (jobs_in_batch: at most prefill_batch_max,
        BATCH_TOKENS or one chunk of tokens, the rank's cache) in one forward, and answers each."""
        options = self.options
        queued = [head, *(w for w in self._queue if w is not head)]
        count = jobs_in_batch(
            [len(w.job.token_ids) for w in queued],
            options.prefill_batch_max,
            min(BATCH_TOKENS, options.prefill_chunk_tokens or BATCH_TOKENS),
            blocks_needed(options.kv_cache_tokens, options.block_size),
            options.block_size,
        )
        batch = queued[:count]
        for waiting in batch:
            if waiting in self._queue:
                self._queue.remove(waiting)
        try:
            running = self.ready_set()
            running.pending = asyncio.get_running_loop().create_future()
            master = next(r for r in running.ranks if r.global_rank == 0)
            master.conn.send([w.job for w in batch])
            _batch_prompts.record(len(batch))
            outcomes = await running.pending
        except Exception as exc:
            for waiting in batch:
                waiting.result.set_exception(exc)
            return
        except BaseException:  # head's caller went away: the others still need an answer
            for waiting in batch[1:]:
                waiting.result.set_exception(SetUnavailable("the job's batch was cancelled"))
            raise
        for waiting, outcome in zip(batch, outcomes, strict=True):
            waiting.result.set_result((running, outcome))

    async def stop(self, reason: str, only: RunningSet | None = None) -> None:
        """Stops the local ranks: politely through rank 0 if the set works, by force at once if it failed
        (its ranks are gone, stuck or frozen). Returns once they have exited; a start() waits for it. With
        only, stops nothing unless that set is still the current one (a newer one may have started)."""
        async with self._stop_lock:
            if only is not None and self.current is not only:
                return
            running, self.current = self.current, None
            if running is None:
                return
            log.info("stopping set %s: %s", running.assignment.set_id, reason)
            if running.pending is not None and not running.pending.done():
                running.pending.set_exception(SetUnavailable(f"set stopped: {reason}"))
            if not running.failed:
                for rank in running.ranks:
                    if rank.global_rank == 0 and rank.process.is_alive():
                        with contextlib.suppress(OSError):
                            rank.conn.send(None)
            deadline = time.monotonic() + (0 if running.failed else 5)
            for rank in running.ranks:
                while rank.process.is_alive() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if rank.process.is_alive():
                    rank.process.kill()
                await asyncio.to_thread(rank.process.join, 5)
                rank.conn.close()
