"""Fixtures of the decode tests: one tiny-model stack (registry, KV store, a PCP=2 prefill set, no decode
worker) for the whole session, and a pipeline over it per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pcpstack.decode.pipeline import GeneratePipeline
from pcpstack.engine.engine import Engine
from tests.decode.support import BLOCK_SIZE, STORE_BYTES, close_pipeline, make_pipeline
from tests.helpers import RunningStack, start_stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Iterator[RunningStack]:
    running = start_stack(
        tmp_path_factory.mktemp("decode-stack"),
        pcp=2,
        decode=0,
        model="tiny",
        block_size=BLOCK_SIZE,
        kv_capacity_bytes=STORE_BYTES,
    )
    yield running
    running.stop()


@pytest.fixture(scope="session")
def reference() -> Engine:
    """The tiny model alone, for expected answers."""
    return Engine.load("tiny", block_size=BLOCK_SIZE)


@pytest.fixture
def pipeline(stack: RunningStack) -> Iterator[GeneratePipeline]:
    made, resolver = make_pipeline(stack)
    yield made
    close_pipeline(stack, made, resolver)
