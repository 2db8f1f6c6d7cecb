"""Set routing as plain logic: least loaded, fingerprint filter, cache while the registry is away."""

from __future__ import annotations

import asyncio

import pytest

from pcpstack.decode.router import NoReadySet, SetRouter
from pcpstack.v1 import registry_pb2


def sets(*entries: tuple[str, int, str]) -> registry_pb2.ResolveResponse:
    return registry_pb2.ResolveResponse(
        prefill_sets=[
            registry_pb2.PrefillSetEndpoint(set_id=s, address=f"{s}:1", load=load, kv_fingerprint=fp)
            for s, load, fp in entries
        ]
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_picks_least_loaded_matching_set_and_spreads_a_burst() -> None:
    answer = sets(("a", 2, "fp"), ("b", 0, "fp"), ("c", 0, "other"))

    async def resolve():
        return answer

    router = SetRouter(resolve, "fp", clock=FakeClock())

    async def scenario() -> list[str]:
        chosen = []
        for _ in range(4):
            s = await router.choose()
            router.started(s.set_id)
            chosen.append(s.set_id)
        return chosen

    # b (0) -> b (1) -> a or b at 2 each: ties break by id -> a (2+1) ... never the other-fingerprint set c.
    assert asyncio.run(scenario()) == ["b", "b", "a", "b"]


def test_excluded_and_forgotten_sets_are_skipped() -> None:
    async def resolve():
        return sets(("a", 0, "fp"), ("b", 5, "fp"))

    router = SetRouter(resolve, "fp", clock=FakeClock())
    assert asyncio.run(router.choose(exclude={"a"})).set_id == "b"
    router.forget("b")
    assert asyncio.run(router.choose()).set_id == "a"
    with pytest.raises(NoReadySet, match="tried"):
        asyncio.run(router.choose(exclude={"a"}))


def test_cached_sets_serve_while_the_registry_is_down() -> None:
    clock = FakeClock()
    up = {"value": True}

    async def resolve():
        if not up["value"]:
            raise ConnectionError("registry down")
        return sets(("a", 0, "fp"))

    router = SetRouter(resolve, "fp", ttl_s=1.0, clock=clock)
    assert asyncio.run(router.choose()).set_id == "a"
    up["value"] = False
    clock.now = 30.0
    assert asyncio.run(router.choose()).set_id == "a"


def test_no_set_at_all_is_a_clear_error() -> None:
    async def resolve():
        return registry_pb2.ResolveResponse()

    with pytest.raises(NoReadySet, match="no ready prefill set"):
        asyncio.run(SetRouter(resolve, "fp", clock=FakeClock()).choose())
