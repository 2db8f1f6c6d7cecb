"""The KV store core: objects, two-phase puts, pins and leases, LRU eviction and accounting. No gRPC here.

Life of an object:
- `begin_put` checks the key and the lease (at most `max_lease_ms`), reserves its bytes (evicting released
  objects, least recently used first, when needed) and returns a PendingPut; nothing is visible yet.
  `commit_put` publishes it, pinned, with a lease and a fresh capability; `abort_put` drops it and frees
  what it held.
- The capability is an unguessable token only the writer learns (from the commit). Reading, releasing,
  deleting and describing an object all require it (CapabilityDenied otherwise), so a peer that can reach
  the store but was not handed the capability cannot read or unpin anyone's KV.
- An object is charged against the capacity for all the store holds of it (`held_bytes`): its payload, its
  metadata and its block keys, so that neither can grow the store's memory past its budget unseen.
- A pinned object is never evicted. `release` unpins it (once; a repeat is harmless and counted) and puts
  it in the LRU cache of released objects; a lease that runs out before the release reclaims it (`expire`).
- A reader (`begin_get` .. `end_get`) keeps its object alive: an object deleted or expired while being read
  leaves the index at once but its memory is freed when the last read ends.

Prefix reuse: a put may name the content-addressed keys of the full blocks it holds (kvstore.prefix); the
store indexes each key it does not hold yet (block key -> object, block index; a key already held is left
to its first holder, so a second put of a block is harmless). `lookup` finds how many leading blocks of a
prompt are held and where, and pins their objects under a `PrefixLease` (a reference each) until the lease
is released or expires: an object a lease references is never evicted, and one deleted meanwhile stays
readable through the lease until its last reference ends. `lookup_chains` does the same for a replica
stored as one object per K/V head range (a TP group's): one chain of keys per object, and the hit is the
run every chain holds. Objects, not blocks, are the unit of memory and of LRU eviction; an evicted
object's blocks leave the index with it.

Times are seconds on a monotonic clock passed in by the caller, so tests control them. Payloads (the
memory holding the bytes) are opaque here; each one is handed to `on_free` exactly once when nothing can
use it any more.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pcpstack.kvstore.errors import (
    AlreadyExists,
    CapabilityDenied,
    CapacityExceeded,
    FingerprintMismatch,
    InvalidArgument,
    NotFound,
)

MAX_KEY_BYTES = 512
MAX_FINGERPRINT_BYTES = 256  # a fingerprint is a sha256 hex digest (64); not charged with the object
MAX_BLOCK_KEYS = 65_536  # a 1M-token prompt in blocks of 16; bounds the work of one put or lookup
MAX_BLOCK_KEY_BYTES = 128
# A lookup answers its tokens in 32 bits: MAX_BLOCK_KEYS blocks of this many still fit (65535; prefill's
# blocks are 16 tokens).
MAX_BLOCK_TOKENS = (2**32 - 1) // MAX_BLOCK_KEYS
# What holding and indexing one block key costs the heap beyond its characters (CPython: the str, its
# tuple slot and its index entry, measured at ~170 bytes): charged with the object.
BLOCK_KEY_OVERHEAD_BYTES = 176
MAX_BLOCK_CHAINS = 256  # one per K/V head range of a replica: above any model's K/V heads
DEFAULT_MAX_LEASE_MS = 600_000  # ten minutes: far above any prefill-to-decode hand-off
_CAPABILITY_BYTES = 24  # 192 random bits


def new_capability() -> str:
    """A fresh, unguessable capability (URL-safe text)."""
    return secrets.token_urlsafe(_CAPABILITY_BYTES)


def held_bytes(total_bytes: int, metadata: bytes, block_keys: Sequence[str]) -> int:
    """What an object is charged against the capacity: its payload, its metadata and its block keys."""
    return total_bytes + len(metadata) + sum(len(key) + BLOCK_KEY_OVERHEAD_BYTES for key in block_keys)


@dataclass(frozen=True)
class StoreConfig:
    """Limits of one store, validated when built."""

    capacity_bytes: int
    default_lease_ms: int = 60_000
    # A writer may pin memory for at most this long: a huge lease would strand bytes after a lost release.
    max_lease_ms: int = DEFAULT_MAX_LEASE_MS

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {self.capacity_bytes}")
        if self.max_lease_ms <= 0:
            raise ValueError(f"max_lease_ms must be > 0, got {self.max_lease_ms}")
        if not 0 < self.default_lease_ms <= self.max_lease_ms:
            raise ValueError(
                f"default_lease_ms must be in 1..max_lease_ms ({self.max_lease_ms}), "
                f"got {self.default_lease_ms}"
            )


@dataclass(eq=False)
class PendingPut:
    """A put between its header and its commit: holds a reservation, visible to nobody."""

    key: str
    fingerprint: str
    total_bytes: int
    lease_ms: int
    metadata: bytes
    payload: object = None
    block_keys: tuple[str, ...] = ()
    block_tokens: int = 0
    held_bytes: int = 0  # charged against the capacity (store.held_bytes)


@dataclass(eq=False)
class StoredObject:
    """A committed, immutable object."""

    key: str
    fingerprint: str
    total_bytes: int
    crc32c: int
    metadata: bytes
    payload: object
    pinned: bool
    lease_expires: float
    capability: str = field(repr=False)  # a bearer secret: kept out of reprs and logs
    readers: int = 0
    doomed: bool = False  # left the index while read or leased; freed when the last of those ends
    block_keys: tuple[str, ...] = ()  # content keys of its full blocks, in order (prefix reuse)
    block_tokens: int = 0  # tokens per block of block_keys
    lease_refs: int = 0  # prefix leases referencing it: never evicted while > 0
    held_bytes: int = 0  # charged against the capacity: payload, metadata and block keys

    @property
    def in_use(self) -> bool:
        """Read or leased right now: its memory must stay."""
        return self.readers > 0 or self.lease_refs > 0


@dataclass(eq=False)
class PrefixLease:
    """A pin on the objects holding a lookup's leading blocks, held by the prefill and decode that read
    them; objects are referenced directly, so one deleted meanwhile stays readable through the lease."""

    lease_id: str
    capability: str = field(repr=False)
    objects: dict[str, StoredObject]
    expires: float


@dataclass(frozen=True)
class PrefixSegment:
    """A run of leading blocks: tokens [token_start, token_start + token_count) of one object, of chain
    `chain` (lookup_chains; 0 for lookup)."""

    obj: StoredObject
    token_start: int
    token_count: int
    chain: int = 0


@dataclass(frozen=True)
class PrefixLookup:
    """How many leading blocks are held, where, and the lease pinning them (None on a miss)."""

    blocks: int
    segments: tuple[PrefixSegment, ...] = ()
    lease: PrefixLease | None = None

    @property
    def tokens(self) -> int:
        """Tokens the leading blocks hold (each chain holds them all)."""
        return sum(segment.token_count for segment in self.segments if segment.chain == 0)


@dataclass
class StoreStats:
    """Gauges and counters of a store."""

    objects: int = 0
    bytes: int = 0
    pinned_bytes: int = 0
    reserved_bytes: int = 0
    capacity_bytes: int = 0
    evictions: int = 0
    lease_expiries: int = 0
    refused_puts: int = 0
    aborted_puts: int = 0
    repeated_releases: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    prefix_blocks: int = 0
    prefix_bytes: int = 0
    prefix_lookups: int = 0
    prefix_blocks_queried: int = 0
    prefix_blocks_hit: int = 0
    prefix_leases: int = 0
    prefix_lease_expiries: int = 0


def check_key(key: str) -> None:
    """Refuses an empty, oversized or control-character key (InvalidArgument naming the rule)."""
    if not key:
        raise InvalidArgument("key is required")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidArgument(f"key is {len(key.encode())} bytes; at most {MAX_KEY_BYTES} allowed")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in key):
        raise InvalidArgument(f"key {key!r} contains control characters")


def check_block_keys(block_keys: Sequence[str], field: str = "block_keys") -> None:
    """Refuses too many block keys, or an empty or oversized one (InvalidArgument naming the field)."""
    if len(block_keys) > MAX_BLOCK_KEYS:
        raise InvalidArgument(f"{field}: {len(block_keys)} keys; at most {MAX_BLOCK_KEYS}")
    for i, block_key in enumerate(block_keys):
        if not 0 < len(block_key) <= MAX_BLOCK_KEY_BYTES:
            raise InvalidArgument(
                f"{field}[{i}] is {len(block_key)} characters; must be 1..{MAX_BLOCK_KEY_BYTES}"
            )


@dataclass
class KvStore:
    """Index, pins, leases, LRU and the memory budget of one store."""

    config: StoreConfig
    on_free: Callable[[object], None] = lambda payload: None
    _objects: dict[str, StoredObject] = field(default_factory=dict)
    _released: OrderedDict[str, StoredObject] = field(default_factory=OrderedDict)  # LRU order, oldest first
    _pending: dict[str, PendingPut] = field(default_factory=dict)
    _blocks: dict[str, tuple[StoredObject, int]] = field(default_factory=dict)  # block key -> (holder, index)
    _leases: dict[str, PrefixLease] = field(default_factory=dict)
    _stats: StoreStats = field(default_factory=StoreStats)
    _used_bytes: int = 0  # committed objects, doomed ones included until freed

    # ---- puts -------------------------------------------------------------------------------------------

    def begin_put(
        self,
        key: str,
        fingerprint: str,
        total_bytes: int,
        lease_ms: int,
        metadata: bytes,
        block_keys: Sequence[str] = (),
        block_tokens: int = 0,
    ) -> PendingPut:
        """Checks a put and reserves what it will hold up front (held_bytes), evicting released objects
        (LRU) if needed. block_keys: the content keys of the object's full blocks of block_tokens tokens
        (prefix reuse)."""
        try:
            check_key(key)
            if not fingerprint:
                raise InvalidArgument("fingerprint is required")
            if len(fingerprint.encode()) > MAX_FINGERPRINT_BYTES:
                size = len(fingerprint.encode())
                raise InvalidArgument(f"fingerprint is {size} bytes; at most {MAX_FINGERPRINT_BYTES} allowed")
            if total_bytes < 0:
                raise InvalidArgument(f"total_bytes must be >= 0, got {total_bytes}")
            self._check_lease(lease_ms)
            check_block_keys(block_keys)
            if block_keys and not 0 < block_tokens <= MAX_BLOCK_TOKENS:
                raise InvalidArgument(
                    f"block_tokens must be in 1..{MAX_BLOCK_TOKENS} with block_keys (a lookup counts the "
                    f"tokens it found in 32 bits), got {block_tokens}"
                )
            if key in self._objects:
                raise AlreadyExists(f"key {key!r} is already committed; keys are write-once")
            if key in self._pending:
                raise AlreadyExists(f"a put of key {key!r} is already in progress")
            held = held_bytes(total_bytes, metadata, block_keys)
            self._make_room(key, held)
        except (InvalidArgument, AlreadyExists, CapacityExceeded):
            self._stats.refused_puts += 1
            raise
        pending = PendingPut(
            key,
            fingerprint,
            total_bytes,
            lease_ms or self.config.default_lease_ms,
            metadata,
            block_keys=tuple(block_keys),
            block_tokens=block_tokens if block_keys else 0,
            held_bytes=held,
        )
        self._pending[key] = pending
        self._stats.reserved_bytes += held
        return pending

    def commit_put(self, pending: PendingPut, crc32c: int, now: float) -> StoredObject:
        """Publishes a verified put: the object is visible, pinned, its lease starts now, and it gets the
        capability its readers must present (obj.capability, for the writer alone)."""
        self._forget_pending(pending)
        obj = StoredObject(
            key=pending.key,
            fingerprint=pending.fingerprint,
            total_bytes=pending.total_bytes,
            crc32c=crc32c,
            metadata=pending.metadata,
            payload=pending.payload,
            pinned=True,
            lease_expires=now + pending.lease_ms / 1000,
            capability=new_capability(),
            block_keys=pending.block_keys,
            block_tokens=pending.block_tokens,
            held_bytes=pending.held_bytes,
        )
        for index, block_key in enumerate(obj.block_keys):
            # Blocks are immutable and content-addressed: a block already held stays with its first holder.
            self._blocks.setdefault(block_key, (obj, index))
        self._objects[obj.key] = obj
        self._used_bytes += obj.held_bytes
        self._stats.pinned_bytes += obj.held_bytes
        self._stats.bytes_in += obj.total_bytes
        return obj

    def abort_put(self, pending: PendingPut, *, refused: bool) -> None:
        """Drops a put that will not commit and frees what it held. refused: the store turned it down
        (bad data); otherwise the writer went away."""
        if self._pending.get(pending.key) is not pending:
            return
        self._forget_pending(pending)
        if refused:
            self._stats.refused_puts += 1
        else:
            self._stats.aborted_puts += 1
        if pending.payload is not None:
            self.on_free(pending.payload)

    def _check_lease(self, lease_ms: int) -> None:
        if lease_ms < 0:
            raise InvalidArgument(f"lease_ms must be >= 0, got {lease_ms}")
        if lease_ms > self.config.max_lease_ms:
            raise InvalidArgument(
                f"lease_ms={lease_ms} exceeds this store's cap of {self.config.max_lease_ms} ms "
                "(its --max-lease-ms); ask for a shorter lease or 0 for the default"
            )

    def _forget_pending(self, pending: PendingPut) -> None:
        del self._pending[pending.key]
        self._stats.reserved_bytes -= pending.held_bytes

    def free_bytes(self) -> int:
        """Budget not held by objects or reservations."""
        return self.config.capacity_bytes - self._used_bytes - self._stats.reserved_bytes

    def reclaim(self, needed: int) -> bool:
        """Makes `needed` bytes free, evicting released objects nobody reads, least recently used first;
        False, evicting nothing, if even all of them would not free that much."""
        if self.free_bytes() >= needed:
            return True  # the common case, without a walk over every released object
        evictable = [obj for obj in self._released.values() if not obj.in_use]
        if self.free_bytes() + sum(obj.held_bytes for obj in evictable) < needed:
            return False
        for obj in evictable:
            if self.free_bytes() >= needed:
                break
            self._remove(obj)
            self._stats.evictions += 1
        return True

    def _make_room(self, key: str, needed: int) -> None:
        if self.reclaim(needed):
            return
        evictable_bytes = sum(obj.held_bytes for obj in self._released.values() if not obj.in_use)
        raise CapacityExceeded(
            f"put of key {key!r} needs {needed} bytes (payload, metadata and block keys) but only "
            f"{self.free_bytes()} are free and "
            f"{evictable_bytes} evictable "
            f"(capacity {self.config.capacity_bytes}, pinned {self._stats.pinned_bytes}, "
            f"reserved {self._stats.reserved_bytes}); release objects or raise the capacity"
        )

    # ---- reads, releases, deletes -----------------------------------------------------------------------

    def begin_get(self, key: str, fingerprint: str, capability: str, lease_id: str = "") -> StoredObject:
        """Starts a read: checks the capability (the object's, or with lease_id the prefix lease's, which
        covers only the objects it pins) and the fingerprint, keeps the object alive and marks it recently
        used."""
        obj = self._leased(lease_id, capability, key) if lease_id else self._authorised(key, capability)
        if fingerprint != obj.fingerprint:
            raise FingerprintMismatch(
                f"object {key!r} was written with fingerprint {obj.fingerprint!r} but the reader expects "
                f"{fingerprint!r}; the model or KV layout differs"
            )
        obj.readers += 1
        self._touch(obj)
        return obj

    def _touch(self, obj: StoredObject) -> None:
        """Marks a released object recently used (a doomed one is in no LRU any more)."""
        if not obj.pinned and not obj.doomed:
            self._released.move_to_end(obj.key)

    def end_get(self, obj: StoredObject, bytes_sent: int) -> None:
        """Ends a read started by begin_get; frees the object if it was removed meanwhile."""
        obj.readers -= 1
        self._stats.bytes_out += bytes_sent
        self._free_if_done(obj)

    def _free_if_done(self, obj: StoredObject) -> None:
        if obj.doomed and not obj.in_use:
            self._free(obj)

    # ---- prefix reuse -----------------------------------------------------------------------------------

    def lookup(self, block_keys: Sequence[str], fingerprint: str, lease_ms: int, now: float) -> PrefixLookup:
        """How many leading blocks of block_keys the store holds (written with fingerprint) and where; on a
        hit their objects are pinned under a new lease of lease_ms (0: the default) starting now."""
        return self.lookup_chains([(fingerprint, block_keys)], lease_ms, now)

    def lookup_chains(
        self, chains: Sequence[tuple[str, Sequence[str]]], lease_ms: int, now: float
    ) -> PrefixLookup:
        """lookup for a replica stored as several objects: chains are (fingerprint, block keys) of each
        object, and the hit is the longest leading run of blocks EVERY chain holds (a block one chain lacks
        is a miss for all: a prefix is only of use whole). Each chain's segments come in chain order; one
        lease pins the objects of them all."""
        if not 0 < len(chains) <= MAX_BLOCK_CHAINS:
            raise InvalidArgument(f"chains: {len(chains)}; a lookup takes 1..{MAX_BLOCK_CHAINS}")
        for i, (_, block_keys) in enumerate(chains):
            check_block_keys(block_keys, f"chains[{i}].block_keys")
        self._check_lease(lease_ms)
        self._stats.prefix_lookups += 1
        self._stats.prefix_blocks_queried += max(len(block_keys) for _, block_keys in chains)
        held = [self._held_run(block_keys, fingerprint) for fingerprint, block_keys in chains]
        blocks = min(len(run) for run in held)
        self._stats.prefix_blocks_hit += blocks
        if not blocks:
            return PrefixLookup(0)
        # (chain, object, first block index, blocks): each chain's run cut to the blocks all chains hold
        runs: list[tuple[int, StoredObject, int, int]] = []
        for chain, run in enumerate(held):
            for obj, index in run[:blocks]:
                last = runs[-1] if runs else None
                if last is not None and last[0] == chain and last[1] is obj and last[2] + last[3] == index:
                    runs[-1] = (chain, obj, last[2], last[3] + 1)
                else:
                    runs.append((chain, obj, index, 1))
        segments = tuple(
            PrefixSegment(obj, first * obj.block_tokens, count * obj.block_tokens, chain)
            for chain, obj, first, count in runs
        )
        objects = {segment.obj.key: segment.obj for segment in segments}
        # The lease is taken last: nothing above can leave it held with an id nobody learnt.
        lease = PrefixLease(
            lease_id=secrets.token_hex(16),
            capability=new_capability(),
            objects=objects,
            expires=now + (lease_ms or self.config.default_lease_ms) / 1000,
        )
        for obj in objects.values():
            obj.lease_refs += 1
            self._touch(obj)
        self._leases[lease.lease_id] = lease
        return PrefixLookup(blocks, segments, lease)

    def _held_run(self, block_keys: Sequence[str], fingerprint: str) -> list[tuple[StoredObject, int]]:
        """(holder, block index) of the leading block_keys held by objects written with fingerprint."""
        run = []
        for block_key in block_keys:
            held = self._blocks.get(block_key)
            if held is None or held[0].fingerprint != fingerprint:
                break
            run.append(held)
        return run

    def release_lease(self, lease_id: str, capability: str) -> bool:
        """Ends a prefix lease: its objects lose one reference (and stay cached until evicted). True the
        first time; False when the lease is unknown (already released or expired: harmless, counted)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            self._stats.repeated_releases += 1
            return False
        self._check_lease_secret(lease, capability)
        self._end_lease(lease)
        return True

    def _end_lease(self, lease: PrefixLease) -> None:
        del self._leases[lease.lease_id]
        for obj in lease.objects.values():
            obj.lease_refs -= 1
            self._free_if_done(obj)

    def _leased(self, lease_id: str, capability: str, key: str) -> StoredObject:
        """The object key as the prefix lease lease_id pins it, when capability is the lease's."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise NotFound(f"no prefix lease {lease_id!r} (released or expired)")
        self._check_lease_secret(lease, capability)
        obj = lease.objects.get(key)
        if obj is None:
            raise CapabilityDenied(f"prefix lease {lease_id!r} does not cover object {key!r}")
        return obj

    @staticmethod
    def _check_lease_secret(lease: PrefixLease, capability: str) -> None:
        if not _same_secret(capability, lease.capability):
            raise CapabilityDenied(
                f"prefix lease {lease.lease_id!r}: the capability presented is "
                f"{'wrong' if capability else 'missing'}; only the lookup hands it out"
            )

    def release(self, key: str, capability: str) -> bool:
        """Unpins an object; True the first time, False (counted, harmless) on any repeat."""
        obj = self._authorised(key, capability)
        if not obj.pinned:
            self._stats.repeated_releases += 1
            return False
        obj.pinned = False
        self._stats.pinned_bytes -= obj.held_bytes
        self._released[key] = obj
        return True

    def delete(self, key: str, capability: str) -> bool:
        """Removes an object now, pinned or not; a read in progress finishes first. False if unknown."""
        if key not in self._objects:
            return False
        self._remove(self._authorised(key, capability))
        return True

    def expire(self, now: float) -> int:
        """Reclaims every pinned object whose lease ended by now, and ends every prefix lease that did;
        returns how many objects."""
        expired = [obj for obj in self._objects.values() if obj.pinned and obj.lease_expires <= now]
        for obj in expired:
            self._remove(obj)
        self._stats.lease_expiries += len(expired)
        ended = [lease for lease in self._leases.values() if lease.expires <= now]
        for lease in ended:
            self._end_lease(lease)
        self._stats.prefix_lease_expiries += len(ended)
        return len(expired)

    def _lookup(self, key: str) -> StoredObject:
        obj = self._objects.get(key)
        if obj is None:
            if len(key.encode()) > MAX_KEY_BYTES:
                raise InvalidArgument(f"key is {len(key.encode())} bytes; at most {MAX_KEY_BYTES} allowed")
            raise NotFound(f"no object with key {key!r}")
        return obj

    def _authorised(self, key: str, capability: str) -> StoredObject:
        """The object, when capability is its own (NotFound, CapabilityDenied otherwise)."""
        obj = self._lookup(key)
        if not _same_secret(capability, obj.capability):
            # Names the key, never the capability (neither the right one nor the one presented).
            raise CapabilityDenied(
                f"object {key!r}: the capability presented is "
                f"{'wrong' if capability else 'missing'}; only the writer's commit hands it out"
            )
        return obj

    def _remove(self, obj: StoredObject) -> None:
        del self._objects[obj.key]
        for block_key in obj.block_keys:
            if self._blocks.get(block_key, (None,))[0] is obj:
                del self._blocks[block_key]
        if obj.pinned:
            obj.pinned = False
            self._stats.pinned_bytes -= obj.held_bytes
        else:
            del self._released[obj.key]
        if obj.in_use:
            obj.doomed = True
        else:
            self._free(obj)

    def _free(self, obj: StoredObject) -> None:
        self._used_bytes -= obj.held_bytes
        if obj.payload is not None:
            self.on_free(obj.payload)
            obj.payload = None

    # ---- introspection ----------------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        """A snapshot of the gauges and counters."""
        snapshot = StoreStats(**vars(self._stats))
        snapshot.objects = len(self._objects)
        snapshot.bytes = self._used_bytes
        snapshot.capacity_bytes = self.config.capacity_bytes
        holders = {obj.key: obj.total_bytes for obj, _ in self._blocks.values()}
        snapshot.prefix_blocks = len(self._blocks)
        snapshot.prefix_bytes = sum(holders.values())
        snapshot.prefix_leases = len(self._leases)
        return snapshot

    def load_percent(self) -> int:
        """The store's load as it reports it to the registry: the share of its capacity (0-100, rounded up)
        held by pinned objects and puts in progress, which no eviction can free. Routers send a replica to
        the least loaded store when none is on the decode worker's host."""
        held = self._stats.pinned_bytes + self._stats.reserved_bytes
        return min(100, -(-100 * held // max(self.config.capacity_bytes, 1)))

    def clear(self) -> None:
        """Deletes every object and prefix lease (at shutdown); reads in progress still finish first."""
        for lease in list(self._leases.values()):
            self._end_lease(lease)
        for obj in list(self._objects.values()):
            self._remove(obj)

    def find(self, key: str) -> StoredObject | None:
        """The committed object with this key, if any (for the store itself: no capability check)."""
        return self._objects.get(key)

    def describe(self, key: str, capability: str) -> StoredObject | None:
        """The committed object with this key when capability is its own; None otherwise, so a caller
        without it cannot even tell whether the object exists."""
        obj = self._objects.get(key)
        return obj if obj is not None and _same_secret(capability, obj.capability) else None


def _same_secret(presented: str, expected: str) -> bool:
    """Constant-time comparison (bytes, so any text presented compares safely); empty never matches."""
    return bool(presented) and secrets.compare_digest(presented.encode(), expected.encode())
