"""`pcpstack bench e2e`: the whole request path under load, and its overhead over in-process prefill.

A local stack (registry, KV store, one PCP set, one decode worker: real processes on loopback) serves
concurrent clients. For 1, 4 and 16 clients it reports time to first token and time per output token
(medians and spread over all requests). It then compares the whole path's TTFT for one prompt of
--overhead-tokens with the engine's in-process prefill of the same prompt (one process, the same total
threads), which is the cost of the services: routing, the gRPC hops, the KV push and fetch.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from bench.machine import machine_facts
from pcpstack.cli.stack import LocalStack, StackOptions
from pcpstack.common.config import served_model_name
from pcpstack.decode.client import DecodeClient, build_request
from pcpstack.engine.engine import Engine


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


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
    parser.add_argument("--repeats", type=int, default=3, help="runs of the overhead test")
    parser.add_argument("--pcp", type=int, default=2, help="PCP size of the set")
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--model", default=None, help="model (default SmolLM2); 'tiny' for a smoke run")


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _one(address: str, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(ttft, time per output token) of one request."""
    client = DecodeClient(address)
    started = time.perf_counter()
    first = last = None
    count = 0
    try:
        async for message in client.stream(build_request(ids, max_tokens=max_tokens, ignore_eos=True)):
            if message.HasField("delta") and message.delta.token_ids:
                last = time.perf_counter()
                first = first or last
                count += len(message.delta.token_ids)
    finally:
        await client.close()
    assert first is not None and last is not None
    return first - started, (last - first) / max(count - 1, 1)


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


async def _load(address: str, vocab: int, args: argparse.Namespace) -> list[dict]:
    rows = []
    for clients in args.concurrency:
        prompts = [_prompt(vocab, args.prompt_tokens, 1000 * clients + i) for i in range(clients)]
        started = time.perf_counter()
        results = await asyncio.gather(*(_one(address, p, args.max_tokens) for p in prompts))
        wall = time.perf_counter() - started
        rows.append(
            {
                "clients": clients,
                "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens,
                "ttft_s": _summary([r[0] for r in results]),
                "tpot_s": _summary([r[1] for r in results]),
                "output_tokens_per_s": round(clients * args.max_tokens / wall, 1),
            }
        )
    return rows


def run(args: argparse.Namespace) -> dict:
    """Starts a stack, measures load and overhead, stops the stack."""
    total_threads = args.pcp * args.threads_per_rank
    facts = machine_facts()

    async def main() -> dict:
        options = StackOptions(pcp=args.pcp, model=args.model, threads_per_rank=args.threads_per_rank)
        async with LocalStack(options, progress=lambda m: None) as stack:
            address = stack.decode_addresses[0]
            vocab = 49152 if args.model is None else 256
            await _one(address, _prompt(vocab, 16, 0), 2)  # warm-up
            load = await _load(address, vocab, args)
            overhead_ids = _prompt(vocab, args.overhead_tokens, 7)
            path_ttft = [(await _one(address, overhead_ids, 1))[0] for _ in range(args.repeats)]
        return {"load": load, "path_ttft": path_ttft, "overhead_ids": overhead_ids}

    measured = asyncio.run(main())
    # In-process reference after the stack is gone, so it has the machine to itself.
    previous = torch.get_num_threads()
    torch.set_num_threads(total_threads)
    engine = Engine.load(args.model, block_size=128)
    local = []
    for _ in range(args.repeats + 1):
        started = time.perf_counter()
        engine.prefill("bench", measured["overhead_ids"])
        local.append(time.perf_counter() - started)
        engine.free("bench")
    torch.set_num_threads(previous)
    local = local[1:]
    path = statistics.median(measured["path_ttft"])
    inproc = statistics.median(local)
    return {
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
            "in_process_threads": total_threads,
            "overhead_pct": round(100 * (path - inproc) / inproc, 1),
        },
    }
