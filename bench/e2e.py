"""`pcpstack bench e2e`: the whole request path under load, and what the services cost over bare prefill.

A local stack (registry, KV store, one PCP set, one decode worker: real processes on loopback) serves
concurrent clients. After one warm-up prompt of the load's length, for 1, 4 and 16 clients it reports time
to first token and time per output token (medians, 90th percentiles and spread over all requests), where
the cores went meanwhile (CPU seconds of the prefill set, decode, the clients and the other services, the
cores' idle time, and what other processes took) and the TTFT p50 floor of prefilling the prompts back to
back at the cost their forwards had (_ttft_floor); with --compare-batching the same load runs again
on a stack whose prefill set takes one prompt a forward (--prefill-batch-max 1), so the result holds TTFT
p50 and p90 with and without batched prefill, measured in the same run. It then compares the whole path's
TTFT for prompts of --overhead-tokens with the engine's in-process prefill of each (one process, the same
total threads), run beside each request (_overhead).

Served PCP: for each size in --served-pcp (1 and 2) a stack of that PCP serves prompts of --served-tokens
(2048 and 4096), one request at a time, each prompt new (a repeated one would come from the prefix cache);
beside each timed request the same rank processes run once without the services, as `bench prefill` runs
them (same threads per rank, same model; the stack idle meanwhile). Every size's stack and rank set is up
at once and the sizes take turns request by request, the order flipping every other round (_served), so
that what is compared ran side by side. The result holds the client-measured TTFT, the ranks' raw prefill
time, the whole-path overhead over it in %, PCP=2 over PCP=1 for both, and the breakdown of one request's
TTFT at each size and length from its trace spans (see ttft_breakdown).

Multi-turn (--multi-turn, issue 18's prefix reuse): on the stack under load, conversations whose every turn
sends the whole history again (the last prompt, its answer, a few new user tokens). Each turn runs warm, with
the earlier turns' prompt blocks in the store, and cold, under a cache salt of its own so that nothing is
shared: the result holds both TTFTs per turn, their ratio, and the prompt tokens the store supplied.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import operator
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.machine import machine_facts, process_cpu_s, two_process_scaling
from bench.prefill import RankSet
from pcpstack.cli.stack import LocalStack, StackOptions
from pcpstack.common.config import served_model_name
from pcpstack.common.telemetry import read_span_file
from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.engine.engine import Engine
from pcpstack.engine.parallel import ParallelLayout
from pcpstack.engine.weights import load_model
from pcpstack.prefill.batch import BATCH_TOKENS

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# The phases of one request's TTFT in path order; they add up to the client's TTFT (ttft_breakdown).
TTFT_PHASES = (
    "to_decode",  # client call to the route lookup: the Generate hop and decode's request checks
    "routing",  # decode.route: the registry lookup (or its cached answer)
    "to_prefill",  # route to prefill.set: the Prefill hop into the set's node
    "queueing",  # prefill.set to the critical rank's prefill.rank: prefix lookup, job lock, hand-off
    "forward",  # that rank's forward (pcpstack.forward_us): the prefill proper
    "kv_push",  # that rank's push of its replica to the store (pcpstack.push_us; 0 on a rank that owns none)
    "gather",  # the rank's first-token sampling, the ranks' outcome all-gather and rank 0's reply to the node
    "first_token",  # the Prefill reply to decode, decode's hand-on and the stream to the client
)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):  # nan and inf fail too (inf would never end)
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, 0 or more, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the end-to-end benchmark."""
    parser.add_argument(
        "--concurrency", type=_int_list, default=[1, 4, 16], help="client counts, e.g. 1,4,16"
    )
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length under load")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument(
        "--overhead-tokens", type=int, default=2048, help="prompt length of the overhead test"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of the overhead and served tests")
    parser.add_argument("--pcp", type=int, default=2, help="PCP size of the set under load")
    parser.add_argument(
        "--served-pcp", type=_int_list, default=[1, 2], help="PCP sizes of the served-PCP test, e.g. 1,2"
    )
    parser.add_argument(
        "--served-tokens",
        type=_int_list,
        default=[2048, 4096],
        help="prompt lengths of the served-PCP test, e.g. 2048,4096 ('' skips the test)",
    )
    parser.add_argument(
        "--scaling-seconds",
        type=_seconds,
        default=2.0,
        help="seconds of each two-process scaling window beside the served stacks, before and after their "
        "rounds (0 skips it)",
    )
    parser.add_argument(
        "--no-raw-prefill",
        dest="raw_prefill",
        action="store_false",
        help="skip the served test's raw prefill reference (served TTFT and its breakdown only)",
    )
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument(
        "--compare-batching",
        action="store_true",
        help="also run the load test on a stack without batched prefill (--prefill-batch-max 1)",
    )
    parser.add_argument(
        "--multi-turn",
        type=int,
        default=4,
        help="turns of the prefix-reuse conversation on the load stack (0 skips it) (default 4)",
    )
    parser.add_argument(
        "--history-tokens", type=int, default=1350, help="the conversation's first prompt (default 1350)"
    )
    parser.add_argument(
        "--turn-tokens", type=int, default=48, help="new user tokens each later turn adds (default 48)"
    )
    parser.add_argument("--model", default=None, help="model (default SmolLM2); 'tiny' for a smoke run")


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass(frozen=True)
class Timing:
    """One request as its client saw it; the wall-clock stamps (time.time_ns) share the spans' clock."""

    ttft_s: float
    tpot_s: float
    trace_id: str
    sent_ns: int
    first_token_ns: int


async def _one(address: str, ids: list[int], max_tokens: int) -> Timing:
    """Sends one request and times its first token and the tokens after it."""
    client = DecodeClient(address)
    sent_ns = time.time_ns()
    started = time.perf_counter()
    first = last = None
    first_ns = 0
    count = 0
    trace_id = ""
    try:
        async for message in client.stream(build_request(ids, max_tokens=max_tokens, ignore_eos=True)):
            if message.HasField("delta") and message.delta.token_ids:
                last = time.perf_counter()
                if first is None:
                    first, first_ns = last, time.time_ns()
                count += len(message.delta.token_ids)
            elif message.HasField("summary"):
                trace_id = message.summary.trace_id
    finally:
        await client.close()
    assert first is not None and last is not None
    return Timing(first - started, (last - first) / max(count - 1, 1), trace_id, sent_ns, first_ns)


@dataclass(frozen=True)
class Turn:
    """One conversation turn as its client saw it."""

    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    answer: list[int]


async def _turn(address: str, ids: list[int], max_tokens: int, cache_salt: str) -> Turn:
    """Sends one turn and returns its TTFT, the prompt tokens the store already held, and its answer."""
    request = build_request(ids, max_tokens=max_tokens, ignore_eos=True)
    request.cache_salt = cache_salt
    client = DecodeClient(address)
    started = time.perf_counter()
    ttft, answer, cached = None, [], 0
    try:
        async for message in client.stream(request):
            if message.HasField("delta") and message.delta.token_ids:
                ttft = ttft if ttft is not None else time.perf_counter() - started
                answer += list(message.delta.token_ids)
            elif message.HasField("summary"):
                cached = message.summary.cached_prompt_tokens
    finally:
        await client.close()
    assert ttft is not None
    return Turn(len(ids), cached, ttft, answer)


async def _conversations(address: str, vocab: int, args: argparse.Namespace) -> list[list[dict]]:
    """`repeats` conversations of `multi_turn` turns: each turn's prompt is the last prompt, its answer and
    `turn_tokens` new user tokens. Every turn runs warm (the default cache salt: the earlier turns' blocks are
    in the store) and then cold (a salt of its own, so no block is shared): the same prompt both ways."""
    runs = []
    for repeat in range(args.repeats):
        history = _prompt(vocab, args.history_tokens, 500 + repeat)
        rows = []
        for turn in range(1, args.multi_turn + 1):
            if turn > 1:
                history = history + _prompt(vocab, args.turn_tokens, 600 + 10 * repeat + turn)
            warm = await _turn(address, history, args.max_tokens, "")
            cold = await _turn(address, history, args.max_tokens, f"cold-{repeat}-{turn}-{time.time_ns()}")
            rows.append(
                {
                    "turn": turn,
                    "prompt_tokens": warm.prompt_tokens,
                    "cached_tokens": warm.cached_tokens,
                    "cold_cached_tokens": cold.cached_tokens,
                    "warm_ttft_s": warm.ttft_s,
                    "cold_ttft_s": cold.ttft_s,
                    "same_answer": warm.answer == cold.answer,
                }
            )
            history = history + warm.answer
        runs.append(rows)
    return runs


def _multi_turn(runs: list[list[dict]]) -> list[dict]:
    """Per turn: the median warm and cold TTFT over the conversations, and warm over cold."""
    rows = []
    for turn_rows in zip(*runs, strict=True):
        warm = [r["warm_ttft_s"] for r in turn_rows]
        cold = [r["cold_ttft_s"] for r in turn_rows]
        rows.append(
            {
                "turn": turn_rows[0]["turn"],
                "prompt_tokens": turn_rows[-1]["prompt_tokens"],
                "cached_tokens": turn_rows[-1]["cached_tokens"],
                "cold_cached_tokens": max(r["cold_cached_tokens"] for r in turn_rows),
                "warm_ttft_s": _summary(warm),
                "cold_ttft_s": _summary(cold),
                "warm_over_cold": round(statistics.median(warm) / statistics.median(cold), 3),
                "same_answers": all(r["same_answer"] for r in turn_rows),
            }
        )
    return rows


def _p90(values: list[float]) -> float:
    """The 90th percentile (interpolated between the values, as numpy's default)."""
    return statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]


def _paired_median(a: list[float], b: list[float], compare: Callable[[float, float], float]) -> float:
    """The median of compare(a[i], b[i]) over pairs that ran side by side (round i of both)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} values against {len(b)}: pairs need one of each per round")
    return statistics.median(compare(x, y) for x, y in zip(a, b, strict=True))


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "p90": round(_p90(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "n": len(values),
    }


def ttft_breakdown(spans: list[dict], timing: Timing) -> dict:
    """Seconds of each TTFT_PHASES phase of one request, from its trace's spans and its client stamps.

    The critical rank is the one that finished its forward and push last; the phases are consecutive
    intervals between the client's send, decode.route, prefill.set, that rank's prefill.rank (start,
    forward, push) and the client's first token, so they add up to the client's TTFT. The KV fetch
    (decode.kv_fetch) runs while the first token is streamed, off the TTFT path: it is reported apart.
    Raises ValueError when the trace lacks a span the phases need.
    """
    own = [s for s in spans if s["trace_id"] == timing.trace_id]

    def single(name: str) -> dict:
        found = [s for s in own if s["name"] == name]
        if len(found) != 1:
            raise ValueError(f"trace {timing.trace_id} has {len(found)} {name} spans, not 1")
        return found[0]

    route, prefill_set = single("decode.route"), single("prefill.set")
    ranks = [s for s in own if s["name"] == "prefill.rank"]
    if not ranks:
        raise ValueError(f"trace {timing.trace_id} has no prefill.rank span")

    def work_ns(rank: dict) -> int:
        attributes = rank["attributes"]
        return 1000 * (attributes.get("pcpstack.forward_us", 0) + attributes.get("pcpstack.push_us", 0))

    critical = max(ranks, key=lambda r: r["start_ns"] + work_ns(r))
    forward_ns = 1000 * critical["attributes"].get("pcpstack.forward_us", 0)
    work_end = critical["start_ns"] + work_ns(critical)
    stamps = [
        timing.sent_ns,
        route["start_ns"],
        route["end_ns"],
        prefill_set["start_ns"],
        critical["start_ns"],
        critical["start_ns"] + forward_ns,
        work_end,
        prefill_set["end_ns"],
        timing.first_token_ns,
    ]
    phases = {
        phase: round((end - start) / 1e9, 4)
        for phase, start, end in zip(TTFT_PHASES, stamps[:-1], stamps[1:], strict=True)
    }
    fetch = [s for s in own if s["name"] == "decode.kv_fetch"]
    return {
        "trace_id": timing.trace_id,
        "ttft_s": round((timing.first_token_ns - timing.sent_ns) / 1e9, 4),
        "phases_s": phases,
        "critical_pcp_rank": critical["attributes"].get("pcpstack.pcp_rank"),
        # CPU seconds of the critical rank's process over its forward and push: their sum when it had a
        # core throughout, less when it waited for one (other processes of the stack or of the machine).
        "critical_rank_cpu_s": round(critical["attributes"].get("pcpstack.cpu_us", 0) / 1e6, 4),
        "kv_fetch_s": round((fetch[0]["end_ns"] - fetch[0]["start_ns"]) / 1e9, 4) if fetch else None,
        "kv_bytes": fetch[0]["attributes"].get("pcpstack.kv_bytes") if fetch else None,
    }


def _process_tree(pid: int) -> list[int]:
    """pid and every process below it (a prefill node's rank processes), from /proc."""
    pids = [pid]
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as children:
                for child in children.read().split():
                    pids += _process_tree(int(child))
    return pids


def _idle_s() -> float:
    """Idle seconds so far (idle + iowait, /proc/stat) of the CPUs this process may run on."""
    cpus = {f"cpu{n}" for n in os.sched_getaffinity(0)}
    with open("/proc/stat") as stat:
        rows = [line.split() for line in stat if line.split(maxsplit=1)[0] in cpus]
    return sum(int(row[4]) + int(row[5]) for row in rows) / _CLOCK_TICKS


def _cpu_by_role(stack: LocalStack) -> dict[str, float]:
    """CPU seconds so far of each kind of service of the stack (prefill: the nodes and their ranks), of
    this process (the clients), and the idle seconds of the cores."""
    used: dict[str, float] = {"clients": process_cpu_s(os.getpid()), "idle": _idle_s()}
    for service in stack.services:
        role = service.name.split("-")[0]
        used[role] = used.get(role, 0.0) + sum(process_cpu_s(p) for p in _process_tree(service.process.pid))
    return used


def _where_cores_went(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Seconds of each kind of use between two _cpu_by_role readings, plus `elsewhere`: the cores' time
    in wall_s that was neither the stack's, the clients' nor idle (other processes on the machine; a few
    hundredths either way are the clock tick's rounding)."""
    used = {role: round(after[role] - before[role], 2) for role in after}
    used["elsewhere"] = round(len(os.sched_getaffinity(0)) * wall_s - sum(used.values()), 2)
    return used


def _forwards(stack: LocalStack) -> tuple[float, float]:
    """The forwards the stack's prefill set has run so far and the prompts they took together (its
    metrics' pcpstack.prefill_batch_prompts histogram: count and sum)."""
    url = next(url for name, url in stack.metrics_urls.items() if name.startswith("prefill"))
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    found = {"count": 0.0, "sum": 0.0}
    for line in text.splitlines():
        name, _, number = line.partition(" ")
        for kind in found:
            if name == f"pcpstack:prefill_batch_prompts_{kind}":
                found[kind] = float(number)
    return found["count"], found["sum"]


# A stack has settled once its processes use less than this share of one core over SETTLE_WINDOW_S (an idle
# local stack uses ~4 %: the ranks' and registry's ticks).
SETTLED_CORE_SHARE = 0.1
SETTLE_WINDOW_S = 0.2
SETTLE_TIMEOUT_S = 10.0


async def _settled(stacks: list[LocalStack]) -> None:
    """Waits until the stacks' processes together are idle (under SETTLED_CORE_SHARE of a core over a
    window), at most SETTLE_TIMEOUT_S."""
    started = time.monotonic()

    def used() -> float:
        return sum(
            sum(v for k, v in _cpu_by_role(stack).items() if k not in ("clients", "idle")) for stack in stacks
        )

    before = used()
    while time.monotonic() - started < SETTLE_TIMEOUT_S:
        await asyncio.sleep(SETTLE_WINDOW_S)
        now = used()
        if now - before < SETTLED_CORE_SHARE * SETTLE_WINDOW_S:
            return
        before = now


def _ttft_floor(prefill_cpu_s: float, clients: int, prefill_threads: int) -> float:
    """TTFT p50 of `clients` prompts prefilled back to back, each taking the wall time its share of the
    prefill CPU would take on the set's threads with nothing else running (the k-th first token after k
    such forwards): what the set could reach at the cost its forwards had in this run, were it never
    descheduled or kept waiting. Only a cheaper forward lowers it (batched prompts share no work but
    the forward's fixed costs)."""
    forward_s = prefill_cpu_s / clients / prefill_threads
    return round(statistics.median(k * forward_s for k in range(1, clients + 1)), 3)


async def _load(stack: LocalStack, vocab: int, args: argparse.Namespace) -> list[dict]:
    address = stack.decode_addresses[0]
    # One prompt of the load's length first: a rank's first long forward keeps its dequantized weights
    # (PCPSTACK_WEIGHTS=cached) and touches its activations' pages for the first time, a one-off cost (a
    # 512-token SmolLM2 prompt: 3.4 CPU-s against 1.6 after) that would otherwise land on the first client.
    await _one(address, _prompt(vocab, args.prompt_tokens, 1), 2)
    rows = []
    for clients in args.concurrency:
        prompts = [_prompt(vocab, args.prompt_tokens, 1000 * clients + i) for i in range(clients)]
        before, forwards_before = _cpu_by_role(stack), _forwards(stack)
        started = time.perf_counter()
        results = await asyncio.gather(*(_one(address, p, args.max_tokens) for p in prompts))
        wall = time.perf_counter() - started
        cores = _where_cores_went(before, _cpu_by_role(stack), wall)
        forwards, prompts_run = (a - b for a, b in zip(_forwards(stack), forwards_before, strict=True))
        rows.append(
            {
                "clients": clients,
                "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens,
                "ttft_s": _summary([r.ttft_s for r in results]),
                "tpot_s": _summary([r.tpot_s for r in results]),
                "output_tokens_per_s": round(clients * args.max_tokens / wall, 1),
                "wall_s": round(wall, 2),
                "cpu_s": cores,
                # How the set took the prompts: forwards, and prompts in each on average.
                "forwards": int(forwards),
                "prompts_per_forward": round(prompts_run / forwards, 2) if forwards else None,
                "batch_tokens": BATCH_TOKENS,
                "ttft_p50_floor_s": _ttft_floor(
                    cores.get("prefill", 0.0), clients, args.pcp * args.threads_per_rank
                ),
            }
        )
    return rows


async def _served(
    stacks: dict[int, LocalStack], raw_sets: dict[int, RankSet | None], vocab: int, args: argparse.Namespace
) -> tuple[
    dict[tuple[int, int], list[Timing]],
    dict[tuple[int, int], list[float]],
    dict[tuple[int, int], list[float]],
]:
    """Served PCP, every size's stack (`stacks`) and raw rank set up at once.

    Per length: a warm-up request on each stack (it pays for first-touch allocations of this length, as
    bench prefill's warm-up does) and a warm-up raw prefill on each set; then `repeats` rounds, each one
    request per stack, one at a time, every prompt new, each beside one raw prefill of the same ranks
    without the services (bench prefill's RankSet, kept up beside the stacks). Each request and raw
    prefill starts once every stack has settled (_settled): work a stack does after a reply (the KV store
    readying a standby for the next put) is not charged to whatever runs next. Sizes take turns within a
    round and the order of sizes, and of request and raw prefill, flips every other round: this machine's
    speed drifts by a third over minutes, so only what ran side by side is compared. Returns per
    (pcp, tokens) the requests' timings (the warm-up first), the raw prefill times (global rank 0's,
    barrier to barrier) and the KV store's CPU seconds during each timed request."""
    sizes = sorted(stacks)
    timings: dict[tuple[int, int], list[Timing]] = {}
    raw: dict[tuple[int, int], list[float]] = {}
    store_cpu: dict[tuple[int, int], list[float]] = {}

    def store_cpu_s(pcp: int) -> float:
        return _cpu_by_role(stacks[pcp]).get("kvstore", 0.0)

    async def request(pcp: int, ids: list[int]) -> tuple[Timing, float]:
        """The request's timing and the KV store's CPU seconds from its start to its last token."""
        await _settled(list(stacks.values()))
        before = store_cpu_s(pcp)
        timing = await _one(stacks[pcp].decode_addresses[0], ids, 2)
        return timing, store_cpu_s(pcp) - before

    async def raw_prefill(pcp: int, tokens: int) -> float:
        await _settled(list(stacks.values()))
        return (await asyncio.to_thread(raw_sets[pcp].prefill, tokens))[0].wall_s

    for tokens in args.served_tokens:
        for pcp in sizes:  # raw warm-ups first: a set's ranks load before the stacks' first requests
            if raw_sets[pcp] is not None:
                await raw_prefill(pcp, tokens)
            raw[(pcp, tokens)], store_cpu[(pcp, tokens)] = [], []
        for pcp in sizes:
            # Two tokens: the second waits for the KV fetch, so the trace holds decode.kv_fetch too.
            timings[(pcp, tokens)] = [(await request(pcp, _prompt(vocab, tokens, 100 * tokens + pcp)))[0]]
        for repeat in range(1, args.repeats + 1):
            flipped = repeat % 2 == 0
            for pcp in reversed(sizes) if flipped else sizes:
                prompt = _prompt(vocab, tokens, 100 * tokens + pcp + 10 * repeat)
                if raw_sets[pcp] is not None and flipped:
                    raw[(pcp, tokens)].append(await raw_prefill(pcp, tokens))
                timing, store_cpu_used = await request(pcp, prompt)
                timings[(pcp, tokens)].append(timing)
                store_cpu[(pcp, tokens)].append(store_cpu_used)
                if raw_sets[pcp] is not None and not flipped:
                    raw[(pcp, tokens)].append(await raw_prefill(pcp, tokens))
    return timings, raw, store_cpu


def _scaling(args: argparse.Namespace) -> dict:
    """bench prefill's two-process scaling and its lockstep ceiling (3 rounds of --scaling-seconds, 1 under
    a second)."""
    return two_process_scaling(args.scaling_seconds, rounds=3 if args.scaling_seconds >= 1 else 1)


def _raw_rank_set(args: argparse.Namespace, pcp: int) -> contextlib.AbstractContextManager:
    """bench prefill's rank processes for TP=1 x PCP=pcp (up until the block ends), or None without
    --raw-prefill."""
    if not args.raw_prefill:
        return contextlib.nullcontext()
    settings = {
        "model": args.model,
        "tokens": args.served_tokens,
        "threads": args.threads_per_rank,
        "block_size": 128,
    }
    layout = ParallelLayout(tp_size=1, pcp_size=pcp)
    return contextlib.closing(RankSet(mp.get_context("spawn"), layout, settings))


def _stack_options(
    args: argparse.Namespace, pcp: int, trace_file: str = "", batch_max: int = 0
) -> StackOptions:
    """A local stack of PCP=pcp with the bench's model and threads (batch_max 0: the service's default)."""
    return StackOptions(
        pcp=pcp,
        model=args.model,
        threads_per_rank=args.threads_per_rank,
        trace_file=trace_file,
        prefill_batch_max=batch_max,
        metrics=True,  # the load runs read how many forwards the set ran (_forwards)
    )


async def _stacks(args: argparse.Namespace, vocab: int, trace_dir: Path) -> dict:
    """Runs the stack under load (PCP=args.pcp), then the served stacks (one per served PCP size, all up
    together), then with --compare-batching the unbatched stack under load: one phase after another."""
    measured: dict = {"served": {}, "raw": {}}
    async with LocalStack(_stack_options(args, args.pcp), progress=lambda m: None) as stack:
        address = stack.decode_addresses[0]
        await _one(address, _prompt(vocab, 16, 0), 2)  # warm-up
        measured["load"] = await _load(stack, vocab, args)
        measured["path_ttft"], measured["in_process"] = await _overhead(address, vocab, args)
        if args.multi_turn:
            measured["multi_turn"] = await _conversations(address, vocab, args)
    sizes = sorted(set(args.served_pcp)) if args.served_tokens else []
    if sizes:
        spans_files = {pcp: trace_dir / f"spans-pcp{pcp}.jsonl" for pcp in sizes}
        async with contextlib.AsyncExitStack() as up:
            raw_sets = {pcp: up.enter_context(_raw_rank_set(args, pcp)) for pcp in sizes}
            stacks = {}
            for pcp in sizes:
                options = _stack_options(args, pcp, trace_file=str(spans_files[pcp]))
                stacks[pcp] = await up.enter_async_context(LocalStack(options, progress=lambda m: None))
                await _one(stacks[pcp].decode_addresses[0], _prompt(vocab, 16, 0), 2)  # warm-up
            # What two one-thread processes get done together against one alone, beside the idle stacks,
            # before and after the served rounds: the most PCP=2 over PCP=1 can reach on these cores then.
            measured["scaling"] = [await asyncio.to_thread(_scaling, args)] if args.scaling_seconds else []
            served = await _served(stacks, raw_sets, vocab, args)
            measured["served"], measured["raw"], measured["store_cpu"] = served
            if args.scaling_seconds:
                measured["scaling"].append(await asyncio.to_thread(_scaling, args))
        for pcp in sizes:
            spans = read_span_file(spans_files[pcp])  # complete once the stack has stopped
            for tokens in args.served_tokens:
                # The first request of the length (the warm-up) and the last timed one.
                timings = measured["served"][(pcp, tokens)]
                measured.setdefault("breakdown", []).extend(
                    {"pcp": pcp, "tokens": tokens, "request": which, **ttft_breakdown(spans, timing)}
                    for which, timing in (("first", timings[0]), ("last", timings[-1]))
                )
    if args.compare_batching:
        async with LocalStack(_stack_options(args, args.pcp, batch_max=1), progress=lambda m: None) as stack:
            address = stack.decode_addresses[0]
            await _one(address, _prompt(vocab, 16, 0), 2)  # warm-up
            measured["load_unbatched"] = await _load(stack, vocab, args)
    return measured


def _batching(batched: list[dict], unbatched: list[dict]) -> list[dict]:
    """TTFT p50 and p90 per client count with batched prefill (the default) and without (one a forward)."""
    rows = []
    for on, off in zip(batched, unbatched, strict=True):
        rows.append(
            {
                "clients": on["clients"],
                "ttft_p50_s": {"batched": on["ttft_s"]["median"], "unbatched": off["ttft_s"]["median"]},
                "ttft_p90_s": {"batched": on["ttft_s"]["p90"], "unbatched": off["ttft_s"]["p90"]},
                "p50_speedup": round(off["ttft_s"]["median"] / on["ttft_s"]["median"], 3),
            }
        )
    return rows


class _InProcess:
    """The overhead test's reference: the engine's prefill in this process, with the stack's total prefill
    threads (the stack idle meanwhile)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._threads = args.pcp * args.threads_per_rank
        self._engine = Engine(load_model(args.model, prefill=True), block_size=128)  # as a prefill rank loads

    def prefill(self, ids: list[int]) -> float:
        """Seconds one prefill of ids took."""
        previous = torch.get_num_threads()
        torch.set_num_threads(self._threads)
        try:
            started = time.perf_counter()
            self._engine.prefill("bench", ids)
            return time.perf_counter() - started
        finally:
            self._engine.free("bench")
            torch.set_num_threads(previous)


async def _overhead(address: str, vocab: int, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """The whole path's TTFT of `repeats` new prompts of --overhead-tokens, each beside the in-process
    prefill of the same prompt (the order flipped every other round, after one warm-up of the reference):
    both ran side by side, not minutes apart."""
    reference = await asyncio.to_thread(_InProcess, args)
    # New prompts each time: a repeated one would be served from the prefix cache.
    prompts = [_prompt(vocab, args.overhead_tokens, 7 + r) for r in range(args.repeats)]
    await asyncio.to_thread(reference.prefill, prompts[0])
    path, local = [], []
    for repeat, ids in enumerate(prompts):
        if repeat % 2:
            local.append(await asyncio.to_thread(reference.prefill, ids))
        path.append((await _one(address, ids, 1)).ttft_s)
        if not repeat % 2:
            local.append(await asyncio.to_thread(reference.prefill, ids))
    return path, local


def _served_result(args: argparse.Namespace, measured: dict) -> dict:
    """Served TTFT against the same ranks' raw prefill (bench prefill's ranks, each run right after a
    served request: _served), and the PCP speedups."""
    rows = []
    for pcp in args.served_pcp:
        for tokens in args.served_tokens:
            warm_up, *timed = measured["served"][(pcp, tokens)]
            served = [t.ttft_s for t in timed]
            row = {
                "pcp": pcp,
                "tokens": tokens,
                "served_ttft_s": _summary(served),
                # The first request of this length on the stack, as a one-off `generate --local` sees it.
                "first_request_ttft_s": round(warm_up.ttft_s, 4),
                # The KV store's work for each request: the replica's put and its standby's pages, readied
                # beside the ranks' forward (a new size) or right after the forward (a repeating one).
                "store_cpu_s": _summary(measured["store_cpu"][(pcp, tokens)]),
            }
            raw = measured["raw"][(pcp, tokens)]
            if raw:
                served_median, raw_median = statistics.median(served), statistics.median(raw)
                row["raw_prefill_s"] = _summary(raw)
                row["overhead_pct"] = round(100 * (served_median - raw_median) / raw_median, 1)
                # Request i and raw prefill i ran back to back: the drift between rounds cancels.
                paired = _paired_median(served, raw, lambda s, r: 100 * (s - r) / r)
                row["overhead_paired_pct"] = round(paired, 1)
            rows.append(row)

    def speedups(key: str) -> dict[str, float]:
        base = {r["tokens"]: r[key]["median"] for r in rows if r["pcp"] == 1 and key in r}
        return {
            f"pcp{r['pcp']}_over_pcp1_at_{r['tokens']}": round(base[r["tokens"]] / r[key]["median"], 3)
            for r in rows
            if r["pcp"] > 1 and r["tokens"] in base
        }

    def paired_speedups(times: dict[tuple[int, int], list[float]]) -> dict[str, float]:
        """Per round, PCP=1's time over PCP=p's of the same round; their median."""
        return {
            f"pcp{pcp}_over_pcp1_at_{tokens}": round(
                _paired_median(times[(1, tokens)], values, operator.truediv), 3
            )
            for (pcp, tokens), values in times.items()
            if pcp > 1 and times.get((1, tokens)) and values
        }

    served_times = {key: [t.ttft_s for t in timed] for key, (_, *timed) in measured["served"].items()}
    return {
        "threads_per_rank": args.threads_per_rank,
        "repeats": args.repeats,
        "rows": rows,
        "speedup": speedups("served_ttft_s"),
        "raw_speedup": speedups("raw_prefill_s"),
        "speedup_paired": paired_speedups(served_times),
        "raw_speedup_paired": paired_speedups(measured["raw"]),
        "breakdown": measured.get("breakdown", []),
        # Twice the slower of two one-thread processes over one alone, beside the stacks before (and after)
        # the rounds: the ceiling of PCP=2 over PCP=1 on these cores (two_process_scaling's lockstep).
        "two_process_scaling": measured.get("scaling", []),
    }


def run(args: argparse.Namespace) -> dict:
    """Starts the stacks, measures load, overhead and served PCP, stops them, then times the references."""
    facts = machine_facts()
    vocab = 49152 if args.model is None else 256
    with tempfile.TemporaryDirectory(prefix="pcpstack-bench-e2e-") as trace_dir:
        measured = asyncio.run(_stacks(args, vocab, Path(trace_dir)))
    local = measured["in_process"]
    path = statistics.median(measured["path_ttft"])
    inproc = statistics.median(local)
    result = {
        "benchmark": "e2e",
        "model": served_model_name(args.model),
        "pcp": args.pcp,
        "threads_per_rank": args.threads_per_rank,
        **facts,
        "load": measured["load"],
        "overhead": {
            "prompt_tokens": args.overhead_tokens,
            "path_ttft_s": _summary(measured["path_ttft"]),
            "in_process_prefill_s": _summary(local),
            "in_process_threads": args.pcp * args.threads_per_rank,
            "overhead_pct": round(100 * (path - inproc) / inproc, 1),
        },
    }
    if args.served_tokens:
        result["served"] = _served_result(args, measured)
    if args.compare_batching:
        result["load_unbatched"] = measured["load_unbatched"]
        result["batching"] = _batching(measured["load"], measured["load_unbatched"])
    if args.multi_turn:
        result["multi_turn"] = {
            "history_tokens": args.history_tokens,
            "turn_tokens": args.turn_tokens,
            "max_tokens": args.max_tokens,
            "conversations": args.repeats,
            "turns": _multi_turn(measured["multi_turn"]),
        }
    return result
