"""Where to send work, as typed values: the registry's Resolve answer in the form its core produces and its
resolver hands to routers (decode's set router, the gateway, the CLI). Plain Python, no protobuf."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillEndpoint:
    """A routable PCP set: its master's Prefill address, reported load and KV layout."""

    set_id: str
    generation: int
    address: str
    pcp_size: int
    load: int
    kv_fingerprint: str
    model: str


@dataclass(frozen=True)
class ServiceEndpoint:
    """A routable decode worker or KV store.

    host is the host part of the node's advertised address: a decode worker and a KV store with the same
    host are taken to share memory (the store's same-host path), so decode sends a request's replica there.
    """

    node_id: str
    address: str
    load: int
    kv_fingerprint: str
    host: str = ""


@dataclass(frozen=True)
class Resolution:
    """Ready prefill sets (least loaded first), live decode workers and KV stores.

    warming is True while the registry has just (re)started and may not have heard from every live node
    yet, so an empty list then means "not known yet" rather than "none"."""

    prefill_sets: tuple[PrefillEndpoint, ...] = ()
    decode: tuple[ServiceEndpoint, ...] = ()
    kvstore: tuple[ServiceEndpoint, ...] = ()
    warming: bool = False
