"""The KV store core without gRPC: two-phase puts, pins and leases, capabilities, LRU eviction,
accounting."""

from __future__ import annotations

import pytest

from pcpstack.kvstore.errors import (
    AlreadyExists,
    CapabilityDenied,
    CapacityExceeded,
    FingerprintMismatch,
    InvalidArgument,
    NotFound,
)
from pcpstack.kvstore.store import KvStore, StoreConfig


class Payloads:
    """Records which payloads the store freed, so tests can check each is freed exactly once."""

    def __init__(self) -> None:
        self.freed: list[object] = []

    def free(self, payload: object) -> None:
        assert payload not in self.freed, "payload freed twice"
        self.freed.append(payload)


def make_store(capacity: int = 100, lease_ms: int = 1000) -> tuple[KvStore, Payloads]:
    payloads = Payloads()
    return KvStore(StoreConfig(capacity, lease_ms), on_free=payloads.free), payloads


def put(store: KvStore, key: str, size: int, now: float = 0.0, lease_ms: int = 0) -> str:
    """Puts and commits an object; returns its capability."""
    pending = store.begin_put(key, "fp", size, lease_ms, b"")
    pending.payload = f"payload-{key}"
    return store.commit_put(pending, 0, now).capability


def cap(store: KvStore, key: str) -> str:
    """The capability of a committed object, as its writer learnt it."""
    return store.find(key).capability


def test_object_is_invisible_until_commit():
    store, _ = make_store()
    pending = store.begin_put("k", "fp", 10, 0, b"")
    with pytest.raises(NotFound):
        store.begin_get("k", "fp", "")
    obj = store.commit_put(pending, 0, now=0.0)
    assert store.begin_get("k", "fp", obj.capability).total_bytes == 10


def test_second_put_of_a_key_is_refused_committed_or_pending():
    store, _ = make_store()
    put(store, "done", 1)
    store.begin_put("pending", "fp", 1, 0, b"")
    for key in ("done", "pending"):
        with pytest.raises(AlreadyExists):
            store.begin_put(key, "fp", 1, 0, b"")
    assert store.stats().refused_puts == 2


def test_aborted_put_frees_its_reservation_and_payload():
    store, payloads = make_store()
    pending = store.begin_put("k", "fp", 60, 0, b"")
    pending.payload = "segment"
    assert store.stats().reserved_bytes == 60
    store.abort_put(pending, refused=False)
    stats = store.stats()
    assert (stats.reserved_bytes, stats.objects, stats.aborted_puts) == (0, 0, 1)
    assert payloads.freed == ["segment"]
    assert store.free_bytes() == 100


def test_put_that_cannot_fit_is_refused_up_front_without_evicting():
    store, payloads = make_store(capacity=100)
    put(store, "pinned", 50)
    put(store, "released", 30)
    store.release("released", cap(store, "released"))
    with pytest.raises(CapacityExceeded, match="needs 80 bytes"):
        store.begin_put("big", "fp", 80, 0, b"")
    assert store.find("released") is not None and payloads.freed == []
    assert store.stats().refused_puts == 1


def test_eviction_is_lru_among_released_and_never_touches_pinned():
    store, payloads = make_store(capacity=100)
    for key in ("a", "b", "c", "pinned"):
        put(store, key, 25)
    for key in ("a", "b", "c"):
        store.release(key, cap(store, key))
    store.end_get(store.begin_get("a", "fp", cap(store, "a")), 25)  # a becomes the most recently used
    store.begin_put("new", "fp", 50, 0, b"")
    assert payloads.freed == ["payload-b", "payload-c"]
    assert store.find("a") is not None and store.find("pinned") is not None
    assert store.stats().evictions == 2


def test_reclaim_evicts_released_objects_lru_first_and_nothing_when_they_would_not_do():
    store, payloads = make_store(capacity=100)
    for key in ("old", "read", "newer", "pinned"):
        put(store, key, 25)
    for key in ("old", "read", "newer"):
        store.release(key, cap(store, key))
    reading = store.begin_get("read", "fp", cap(store, "read"))
    assert not store.reclaim(75)  # old and newer are all it may evict: 50 bytes
    assert payloads.freed == [] and store.stats().evictions == 0
    assert store.reclaim(0) and store.reclaim(25) and payloads.freed == ["payload-old"]
    assert store.reclaim(50) and payloads.freed == ["payload-old", "payload-newer"]
    assert store.find("read") is not None and store.find("pinned") is not None
    assert store.free_bytes() == 50 and store.stats().evictions == 2
    store.end_get(reading, 25)


def test_object_being_read_is_not_evicted():
    store, _ = make_store(capacity=50)
    put(store, "read", 25)
    put(store, "idle", 25)
    store.release("read", cap(store, "read"))
    store.release("idle", cap(store, "idle"))
    store.begin_get("read", "fp", cap(store, "read"))
    store.begin_put("new", "fp", 25, 0, b"")
    assert store.find("read") is not None and store.find("idle") is None


def test_lease_expiry_reclaims_and_counts_pinned_objects_only():
    store, payloads = make_store(lease_ms=1000)
    put(store, "short", 10, now=0.0, lease_ms=500)
    put(store, "default", 10, now=0.0)
    put(store, "released", 10, now=0.0, lease_ms=500)
    store.release("released", cap(store, "released"))
    assert store.expire(now=0.6) == 1
    assert payloads.freed == ["payload-short"]
    assert store.expire(now=1.0) == 1
    assert store.find("released") is not None
    assert store.stats().lease_expiries == 2


def test_reader_keeps_an_expired_object_alive_until_the_read_ends():
    store, payloads = make_store()
    put(store, "k", 10, now=0.0, lease_ms=100)
    reading = store.begin_get("k", "fp", cap(store, "k"))
    store.expire(now=1.0)
    assert store.find("k") is None and payloads.freed == []
    assert store.stats().bytes == 10
    store.end_get(reading, 10)
    assert payloads.freed == ["payload-k"] and store.stats().bytes == 0


def test_release_counts_once_and_reports_repeats():
    store, _ = make_store()
    put(store, "k", 10)
    assert store.release("k", cap(store, "k")) is True
    assert store.release("k", cap(store, "k")) is False
    stats = store.stats()
    assert (stats.pinned_bytes, stats.repeated_releases, stats.bytes) == (0, 1, 10)
    with pytest.raises(NotFound):
        store.release("unknown", "")


def test_reader_with_another_fingerprint_is_refused():
    store, _ = make_store()
    put(store, "k", 10)
    with pytest.raises(FingerprintMismatch, match="'fp'"):
        store.begin_get("k", "other", cap(store, "k"))


def test_delete_while_reading_hides_the_key_and_frees_after_the_read():
    store, payloads = make_store()
    put(store, "k", 10)
    capability = cap(store, "k")
    reading = store.begin_get("k", "fp", capability)
    assert store.delete("k", capability) is True
    assert store.delete("k", capability) is False
    assert payloads.freed == []
    store.end_get(reading, 0)
    assert payloads.freed == ["payload-k"]


@pytest.mark.parametrize(("key", "message"), [("", "required"), ("a\nb", "control"), ("x" * 513, "at most")])
def test_bad_keys_are_refused_naming_the_rule(key, message):
    store, _ = make_store()
    with pytest.raises(InvalidArgument, match=message):
        store.begin_put(key, "fp", 1, 0, b"")


def test_an_oversized_fingerprint_or_read_key_is_refused_naming_the_limit():
    store, _ = make_store()
    with pytest.raises(InvalidArgument, match="fingerprint is 257 bytes; at most 256"):
        store.begin_put("k", "f" * 257, 1, 0, b"")
    # a key no put could have written: refused as such, not looked for
    with pytest.raises(InvalidArgument, match="key is 513 bytes; at most 512"):
        store.begin_get("x" * 513, "fp", "capability")
    with pytest.raises(InvalidArgument, match="key is 513 bytes"):
        store.release("x" * 513, "capability")


def test_config_names_the_bad_option():
    with pytest.raises(ValueError, match="capacity_bytes"):
        StoreConfig(0)


def test_each_committed_object_gets_its_own_unguessable_capability():
    store, _ = make_store()
    capabilities = {put(store, f"k{i}", 1) for i in range(50)}
    assert len(capabilities) == 50
    assert all(len(c) >= 32 for c in capabilities)  # 24 random bytes, URL-safe base64
    assert store.find("k0").capability not in repr(store.find("k0"))  # reprs end up in logs


@pytest.mark.parametrize("presented", ["", "forged-token", "é"], ids=["missing", "wrong", "non-ascii"])
def test_get_release_and_delete_without_the_capability_are_refused_naming_the_key(presented: str):
    store, payloads = make_store()
    capability = put(store, "k", 10)
    for attempt in (
        lambda: store.begin_get("k", "fp", presented),
        lambda: store.release("k", presented),
        lambda: store.delete("k", presented),
    ):
        with pytest.raises(CapabilityDenied, match="'k'") as refused:
            attempt()
        assert capability not in str(refused.value) and (not presented or presented not in str(refused.value))
    obj = store.find("k")
    assert (obj.pinned, obj.readers, payloads.freed) == (True, 0, [])


def test_capability_of_one_object_does_not_open_another():
    store, _ = make_store()
    put(store, "mine", 10)
    other = put(store, "theirs", 10)
    with pytest.raises(CapabilityDenied):
        store.begin_get("mine", "fp", other)


def test_describe_shows_an_object_only_to_the_holder_of_its_capability():
    store, _ = make_store()
    capability = put(store, "k", 10)
    assert store.describe("k", capability) is store.find("k")
    assert store.describe("k", "") is None and store.describe("k", "wrong") is None
    assert store.describe("missing", capability) is None


def test_lease_above_the_cap_is_refused_naming_the_cap():
    store = KvStore(StoreConfig(100, default_lease_ms=1000, max_lease_ms=5000))
    with pytest.raises(InvalidArgument, match="cap of 5000 ms"):
        store.begin_put("k", "fp", 1, 5001, b"")
    assert store.begin_put("k", "fp", 1, 5000, b"").lease_ms == 5000
    assert store.stats().refused_puts == 1


def test_default_lease_above_the_cap_is_a_config_error():
    with pytest.raises(ValueError, match="default_lease_ms"):
        StoreConfig(100, default_lease_ms=10_000, max_lease_ms=5000)


def test_load_is_the_share_of_capacity_no_eviction_can_free():
    store, _ = make_store(capacity=1000)
    put(store, "pinned", 300)
    store.begin_put("in-progress", "fp", 101, 0, b"")
    released = put(store, "released", 200)
    store.release("released", released)  # cached, evictable: not load
    assert store.load_percent() == 41  # 401 of 1000, rounded up
    store.release("pinned", cap(store, "pinned"))
    assert store.load_percent() == 11
