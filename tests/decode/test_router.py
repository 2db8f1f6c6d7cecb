"""Set routing as plain policy over the resolver's typed answer: least loaded, fingerprint filter, failed
sets skipped until the next fresh answer, a clear error when nothing is ready."""

from __future__ import annotations

import asyncio

import pytest

from pcpstack.common.errors import Unavailable
from pcpstack.decode.router import NoReadySet, SetRouter
from pcpstack.registry.endpoints import PrefillEndpoint, Resolution


def sets(*entries: tuple[str, int, str]) -> Resolution:
    return Resolution(
        prefill_sets=tuple(PrefillEndpoint(s, 1, f"{s}:1", 2, load, fp, "") for s, load, fp in entries)
    )


def test_picks_least_loaded_matching_set_and_spreads_a_burst() -> None:
    answer = sets(("a", 2, "fp"), ("b", 0, "fp"), ("c", 0, "other"))

    async def resolve():
        return answer

    router = SetRouter(resolve, "fp")

    async def scenario() -> list[str]:
        chosen = []
        for _ in range(4):
            s = await router.choose()
            router.started(s.set_id)
            chosen.append(s.set_id)
        return chosen

    # b (0) -> b (1) -> a or b at 2 each: ties break by id -> a (2+1) ... never the other-fingerprint set c.
    assert asyncio.run(scenario()) == ["b", "b", "a", "b"]


def test_excluded_sets_are_skipped_and_a_forgotten_set_while_another_is_ready() -> None:
    answers = {"current": sets(("a", 0, "fp"), ("b", 5, "fp"))}

    async def resolve():
        return answers["current"]

    router = SetRouter(resolve, "fp")
    assert asyncio.run(router.choose(exclude={"a"})).set_id == "b"
    router.forget("a")
    assert asyncio.run(router.choose()).set_id == "b"  # the same (cached) answer: a stays out
    answers["current"] = sets(("a", 0, "fp"), ("b", 5, "fp"))  # a fresh answer lists a again
    assert asyncio.run(router.choose()).set_id == "a"
    router.forget("b")
    # The only set left is suspected, not excluded: it is taken rather than refusing the request.
    assert asyncio.run(router.choose(exclude={"a"})).set_id == "b"
    with pytest.raises(NoReadySet, match="tried"):
        asyncio.run(router.choose(exclude={"a", "b"}))


def test_a_registry_with_nothing_cached_is_no_ready_set_naming_the_cause() -> None:
    async def resolve():
        raise Unavailable("the registry at r:1 is unreachable (UNAVAILABLE) and no endpoints are cached")

    with pytest.raises(NoReadySet, match="unreachable"):
        asyncio.run(SetRouter(resolve, "fp").choose())


def test_no_set_at_all_is_a_clear_error() -> None:
    async def resolve():
        return Resolution()

    with pytest.raises(NoReadySet, match="no ready prefill set"):
        asyncio.run(SetRouter(resolve, "fp").choose())
