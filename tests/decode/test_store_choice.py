"""The KV store a request's replica goes to, as plain policy over real endpoints: the store on the decode
worker's own host first, else the least loaded, ties to the lowest node id; failed stores skipped until the
resolver's next fresh answer while another is live."""

from __future__ import annotations

import asyncio

from pcpstack.decode.router import SetRouter, pick_store
from pcpstack.registry.endpoints import Resolution, ServiceEndpoint


def store(node_id: str, host: str, load: int = 0) -> ServiceEndpoint:
    return ServiceEndpoint(node_id, f"{host}:7000", load, "", host)


def test_the_store_on_the_workers_host_wins_over_less_loaded_ones_else_the_least_loaded() -> None:
    local, far, farther = store("s-b", "10.0.0.2", load=9), store("s-c", "10.0.0.3"), store("s-a", "10.0.0.4")
    stores = [far, local, farther]
    assert pick_store(stores, "10.0.0.2", {}) == local
    # No store on this host: the least loaded, ties broken by node id (s-a before s-c) ...
    assert pick_store(stores, "10.0.0.9", {}) == farther
    # ... counting the requests this worker sent there since the last answer.
    assert pick_store(stores, "10.0.0.9", {farther.address: 1}) == far
    # The local store skipped (it failed a request): the least loaded of the others.
    assert pick_store(stores, "10.0.0.2", {}, skipped={local.address}) == farther
    assert pick_store([], "10.0.0.2", {}) is None


def test_a_failed_store_is_skipped_until_a_fresh_answer_and_none_listed_leaves_prefill_its_default() -> None:
    local, other = store("s-local", "10.0.0.2"), store("s-other", "10.0.0.3")
    answers = {"current": Resolution(kvstore=(local, other))}

    async def resolve() -> Resolution:
        return answers["current"]

    router = SetRouter(resolve, "fp", host="10.0.0.2")
    assert asyncio.run(router.choose_store()) == local.address
    router.forget(local.address)
    assert asyncio.run(router.choose_store()) == other.address  # the same cached answer: local stays out
    router.forget(other.address)  # both suspected: one is still taken rather than none
    assert asyncio.run(router.choose_store()) == local.address
    assert asyncio.run(router.choose_store(exclude={local.address})) == other.address
    answers["current"] = Resolution(kvstore=(local, other))  # a fresh answer lists it again
    assert asyncio.run(router.choose_store()) == local.address
    answers["current"] = Resolution()
    assert asyncio.run(router.choose_store()) == ""
