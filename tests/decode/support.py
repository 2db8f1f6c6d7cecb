"""What the decode tests share: a pipeline over a running tiny-model stack, prompts, and store probes."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import torch

from pcpstack.decode.batcher import Batcher
from pcpstack.decode.pipeline import DecodeSettings, Delta, GenerateInput, GeneratePipeline, Summary
from pcpstack.decode.router import SetRouter
from pcpstack.engine.engine import Engine
from pcpstack.engine.sampling import SamplingParams
from pcpstack.kvstore.client import KvStoreClient
from pcpstack.registry.resolver import Resolver
from tests.helpers import RunningStack

BLOCK_SIZE = 128
# 1 MiB holds about 2000 tokens of the tiny model's KV (512 bytes a token): a 3000-token replica cannot fit.
STORE_BYTES = 1 << 20
TOO_BIG_FOR_THE_STORE = 3000


def make_pipeline(
    stack: RunningStack, router_cls: type[SetRouter] = SetRouter, kv_lease_ms: int = 0, **engine_options
) -> tuple[GeneratePipeline, Resolver]:
    """A pipeline over the stack; its resolver's clock stands still, so a set it forgets stays forgotten.
    kv_lease_ms: the replicas' lease it asks for (0: the store's default)."""
    engine = Engine.load("tiny", block_size=BLOCK_SIZE, **engine_options)
    fingerprint = engine.layout.fingerprint()
    resolver = Resolver(stack.stack.registry_address, clock=lambda: 0.0)
    router = router_cls(resolver.resolve, fingerprint)
    settings = DecodeSettings(
        model_name="tiny", kv_fingerprint=fingerprint, prefill_timeout_s=60, kv_lease_ms=kv_lease_ms
    )
    return GeneratePipeline(engine, Batcher(engine), router, settings), resolver


def close_pipeline(stack: RunningStack, pipeline: GeneratePipeline, resolver: Resolver) -> None:
    stack.run(pipeline.close())
    stack.run(resolver.close())
    pipeline.batcher.close()


def prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    """n token ids of the tiny model, below its EOS id."""
    return tuple(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def greedy(max_tokens: int, **options) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **options)


async def answer(pipeline: GeneratePipeline, request: GenerateInput) -> tuple[list[Delta], Summary]:
    """The request's deltas and summary."""
    deltas: list[Delta] = []
    async with aclosing(pipeline.generate(request)) as events:
        async for event in events:
            if isinstance(event, Delta):
                deltas.append(event)
            else:
                return deltas, event
    raise AssertionError("the pipeline ended without a summary")


async def prefills_answered(pipeline: GeneratePipeline) -> bool:
    """Whether every Prefill call the pipeline sent has its answer (waits a bounded while)."""
    for _ in range(600):
        if pipeline.prefills_in_flight == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def bytes_stored(store_address: str) -> int:
    """Bytes the store has taken in by committed puts since it started."""
    async with KvStoreClient(store_address) as store:
        return (await store.stat()).bytes_in
