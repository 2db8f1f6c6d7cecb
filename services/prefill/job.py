"""The typed work of a PCP set: one job in, one outcome out, and how each crosses the process group.

The servicer builds a `PrefillJob` (the prompt, its checked sampling parameters and the KV key it computed
once); the node hands it to global rank 0, which broadcasts it to every rank with the other jobs of the
same forward (prefill.batch.pack_jobs). After the forward each rank contributes a fixed-size `RankShare` per
job to one all-gather, and rank 0 folds each job's shares into the `PrefillOutcome` its node answers with.
Nothing on this path is a dict or JSON.

With tensor parallelism the replica of the owning PCP rank is spread over its TP group by K/V head, and it
is stored as one object per `ReplicaShard` (`replica_shards`, computed once by the servicer and carried in
the job): each shard's TP rank pushes its own heads under the shard's key and fingerprint.

Prefix reuse: a job may carry a `CachedPrefix` (the servicer's store lookup: where the prompt's leading
blocks are, per stored shard, and the one lease to read them all), and each shard carries the prompt's block
keys under its own fingerprint. Every rank loads the prefix of its K/V heads (from the shard that stores
them), prefills only the tokens after it, and the owner's TP ranks push only those, each shard offering
its full blocks under its keys; the shares report how many tokens each rank took from the cache (all or
none of the prefix, the same on every rank).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pcpstack.common.errors import Internal, ServiceError, error_of_code
from pcpstack.engine.config import ModelArgs
from pcpstack.engine.parallel import shard_fingerprint, stored_kv_shards
from pcpstack.engine.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprobs
from pcpstack.kvstore.client import make_key
from pcpstack.v1 import common_pb2

_LENGTH = struct.Struct("<I")
# lease_ms, number of tokens, of trace-context entries and of replica shards
_JOB_FIXED = struct.Struct("<qIII")
_SHARD_FIXED = struct.Struct("<IIII")  # tp_rank, kv_head_start, kv_head_end, number of block keys
_PREFIX_FIXED = struct.Struct("<II")  # cached tokens, number of segments
_SEGMENT_FIXED = struct.Struct("<IIQI")  # token_start, token_count, object_bytes, shard


def _pack_str(text: str) -> bytes:
    data = text.encode()
    return _LENGTH.pack(len(data)) + data


def _unpack_str(data: memoryview, offset: int) -> tuple[str, int]:
    (length,) = _LENGTH.unpack_from(data, offset)
    offset += _LENGTH.size
    return bytes(data[offset : offset + length]).decode(), offset + length


@dataclass(frozen=True)
class ReplicaShard:
    """One store object of a request's replica: the TP rank (of the owning PCP rank) that pushes it, its
    K/V heads [kv_head_start, kv_head_end), and the key and fingerprint it is stored under."""

    tp_rank: int
    kv_head_start: int
    kv_head_end: int
    key: str
    fingerprint: str
    # Prefix reuse: the content keys of the prompt's full blocks under this shard's fingerprint
    # (kvstore.prefix.prefix_block_keys); the pushed shard offers those after the cached prefix. Empty:
    # nothing is offered for reuse.
    block_keys: tuple[str, ...] = field(default=(), repr=False)

    def to_bytes(self) -> bytes:
        """The shard as bytes that read_from reads back."""
        fixed = _SHARD_FIXED.pack(self.tp_rank, self.kv_head_start, self.kv_head_end, len(self.block_keys))
        keys = b"".join(_pack_str(key) for key in self.block_keys)
        return fixed + _pack_str(self.key) + _pack_str(self.fingerprint) + keys

    @classmethod
    def read_from(cls, view: memoryview, offset: int) -> tuple[ReplicaShard, int]:
        """The shard encoded at offset, and the offset after it."""
        tp_rank, start, end, num_keys = _SHARD_FIXED.unpack_from(view, offset)
        key, offset = _unpack_str(view, offset + _SHARD_FIXED.size)
        fingerprint, offset = _unpack_str(view, offset)
        block_keys = []
        for _ in range(num_keys):
            block_key, offset = _unpack_str(view, offset)
            block_keys.append(block_key)
        return cls(tp_rank, start, end, key, fingerprint, tuple(block_keys)), offset


def replica_shards(kv_key: str, fingerprint: str, args: ModelArgs, tp_size: int) -> tuple[ReplicaShard, ...]:
    """The store objects of one attempt's replica made by a TP group of tp_size (args: the whole model's).

    Each K/V head is stored once, by the first TP rank holding it (engine.parallel.stored_kv_shards). A
    shard holding every head is the replica itself: it keeps `kv_key` and the replica's fingerprint, so tp 1
    stores exactly what it always did. A narrower shard is keyed `<attempt>.kv<start>-<end>/<fp prefix>`
    under its own fingerprint (engine.parallel.shard_fingerprint).
    """
    attempt = kv_key.split("/", 1)[0]
    shards = []
    for tp_rank, heads in stored_kv_shards(args, tp_size):
        shard_fp = shard_fingerprint(fingerprint, heads, args.n_kv_heads)
        whole = heads.start == 0 and heads.stop == args.n_kv_heads
        key = kv_key if whole else make_key(f"{attempt}.kv{heads.start}-{heads.stop}", shard_fp)
        shards.append(ReplicaShard(tp_rank, heads.start, heads.stop, key, shard_fp))
    return tuple(shards)


def shard_holding(shards: Sequence[ReplicaShard], heads: range) -> int:
    """The index of the stored shard that holds exactly K/V heads `heads` (a TP rank's): with more TP ranks
    than K/V heads a head is held by several ranks and stored once, by the first of them, so every holder
    loads its cached prefix from that shard. A shard naming no heads (kv_head_end 0) is the whole replica.
    ValueError when no shard does."""
    for index, shard in enumerate(shards):
        if not shard.kv_head_end or range(shard.kv_head_start, shard.kv_head_end) == heads:
            return index
    raise ValueError(f"no stored shard holds exactly K/V heads {heads.start}-{heads.stop}")


@dataclass(frozen=True)
class PrefixRun:
    """Cached prefix tokens [token_start, token_start + token_count) of one store object holding the K/V
    heads of the job's shard `shard` (an index into PrefillJob.stored_shards; kvstore LookupResponse's
    PrefixSegment, whose chain is that shard's)."""

    key: str
    token_start: int
    token_count: int
    object_bytes: int
    shard: int = 0


@dataclass(frozen=True)
class CachedPrefix:
    """The prompt's leading tokens the store holds: the runs holding them (each shard's, in prompt order;
    every shard's runs hold all `tokens`), and the prefix lease (id and capability) that pins and reads
    them all."""

    tokens: int
    runs: tuple[PrefixRun, ...]
    lease_id: str
    capability: str = field(repr=False)  # a bearer secret

    def runs_of(self, shard: int) -> tuple[PrefixRun, ...]:
        """The runs of the job's shard `shard`, in prompt order."""
        return tuple(run for run in self.runs if run.shard == shard)


@dataclass(frozen=True)
class PrefillJob:
    """One prompt for the set: what every rank needs to run it and push its replica."""

    request_id: str
    # The store key of this attempt's replica (computed once, by the servicer; unique per attempt).
    kv_key: str
    token_ids: list[int]
    sampling: SamplingParams
    kvstore_address: str
    lease_ms: int
    # W3C trace context of the caller's span, so every rank's work joins the request's trace.
    trace_context: dict[str, str] = field(default_factory=dict)
    # The store objects of the replica (replica_shards), with their block keys. Empty: one object under
    # kv_key, pushed by TP rank 0 under the rank's own (whole-model) fingerprint, offering no blocks.
    shards: tuple[ReplicaShard, ...] = ()
    # Prefix reuse: the leading tokens to load from the store instead of computing (None: none).
    prefix: CachedPrefix | None = None

    def stored_shards(self, fingerprint: str = "") -> tuple[ReplicaShard, ...]:
        """The shards to push: `shards`, or the whole replica under kv_key when the job names none."""
        return self.shards or (ReplicaShard(0, 0, 0, self.kv_key, fingerprint),)

    def to_bytes(self) -> bytes:
        """The job as bytes that from_bytes reads back exactly."""
        parts = [
            _JOB_FIXED.pack(self.lease_ms, len(self.token_ids), len(self.trace_context), len(self.shards)),
            _pack_str(self.request_id),
            _pack_str(self.kv_key),
            _pack_str(self.kvstore_address),
            self.sampling.to_bytes(),
        ]
        for key, value in self.trace_context.items():
            parts += [_pack_str(key), _pack_str(value)]
        parts += [shard.to_bytes() for shard in self.shards]
        prefix = self.prefix
        runs = prefix.runs if prefix else ()
        parts += [
            _PREFIX_FIXED.pack(prefix.tokens if prefix else 0, len(runs)),
            _pack_str(prefix.lease_id if prefix else ""),
            _pack_str(prefix.capability if prefix else ""),
        ]
        for run in runs:
            parts += [
                _SEGMENT_FIXED.pack(run.token_start, run.token_count, run.object_bytes, run.shard),
                _pack_str(run.key),
            ]
        # Token ids are below the vocabulary size, far from 2**32.
        parts.append(struct.pack(f"<{len(self.token_ids)}I", *self.token_ids))
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> PrefillJob:
        """The job encoded by to_bytes."""
        view = memoryview(data)
        lease_ms, num_tokens, num_trace, num_shards = _JOB_FIXED.unpack_from(view, 0)
        offset = _JOB_FIXED.size
        request_id, offset = _unpack_str(view, offset)
        kv_key, offset = _unpack_str(view, offset)
        kvstore_address, offset = _unpack_str(view, offset)
        sampling, offset = SamplingParams.from_bytes(view, offset)
        trace_context = {}
        for _ in range(num_trace):
            key, offset = _unpack_str(view, offset)
            trace_context[key], offset = _unpack_str(view, offset)
        shards = []
        for _ in range(num_shards):
            shard, offset = ReplicaShard.read_from(view, offset)
            shards.append(shard)
        cached, num_runs = _PREFIX_FIXED.unpack_from(view, offset)
        lease_id, offset = _unpack_str(view, offset + _PREFIX_FIXED.size)
        lease_capability, offset = _unpack_str(view, offset)
        runs = []
        for _ in range(num_runs):
            token_start, token_count, object_bytes, shard_index = _SEGMENT_FIXED.unpack_from(view, offset)
            key, offset = _unpack_str(view, offset + _SEGMENT_FIXED.size)
            runs.append(PrefixRun(key, token_start, token_count, object_bytes, shard_index))
        prefix = CachedPrefix(cached, tuple(runs), lease_id, lease_capability) if cached else None
        token_ids = list(struct.unpack_from(f"<{num_tokens}I", view, offset))
        return cls(
            request_id,
            kv_key,
            token_ids,
            sampling,
            kvstore_address,
            lease_ms,
            trace_context,
            tuple(shards),
            prefix,
        )

    def to_tensor(self) -> torch.Tensor:
        """The job as a uint8 tensor, for the rank broadcast."""
        return torch.frombuffer(bytearray(self.to_bytes()), dtype=torch.uint8)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> PrefillJob:
        """The job a broadcast delivered."""
        return cls.from_bytes(tensor.numpy().tobytes())


# first token id (-1: not sampled here), replica bytes, forward us, push us, cached prefix tokens used, then
# the byte lengths of the error code, the capability and the error message, which follow in that order.
_SHARE_FIXED = struct.Struct("<qqqqqHHH")
# The first token's log-probability and the number of its alternatives (_NO_LOGPROBS: none asked), then
# MAX_LOGPROBS slots of (token id, log-probability); they sit right after _SHARE_FIXED.
_SHARE_LOGPROBS = struct.Struct("<dH")
_SHARE_ALTERNATIVE = struct.Struct("<qd")
_NO_LOGPROBS = 0xFFFF
_SHARE_HEAD = _SHARE_FIXED.size + _SHARE_LOGPROBS.size + MAX_LOGPROBS * _SHARE_ALTERNATIVE.size


@dataclass(frozen=True)
class RankShare:
    """What one rank reports after a job, in one all-gather of SIZE bytes per rank."""

    SIZE = 1024

    first_token_id: int = -1  # set by the rank that holds the last prompt position
    total_bytes: int = 0  # bytes of the replica, set by the replica owner once pushed
    forward_us: int = 0
    push_us: int = 0
    capability: str = ""  # the store's read capability of the pushed replica
    error_code: str = ""  # the common.errors kind (gRPC status name) of this rank's failure
    error: str = ""
    # The first token's log-probabilities, when the request asked (set with first_token_id).
    first_token_logprobs: TokenLogprobs | None = None
    # Leading prompt tokens this rank loaded from the store instead of computing (the same on every rank).
    cached_tokens: int = 0

    def to_tensor(self) -> torch.Tensor:
        """SIZE bytes as a uint8 tensor; an error message too long for the rest is cut."""
        code, capability = self.error_code.encode(), self.capability.encode()
        room = self.SIZE - _SHARE_HEAD - len(code) - len(capability)
        if room < 0:
            raise ValueError(f"error code and capability take {-room} bytes more than a RankShare holds")
        # Cut on a character boundary so the message still decodes.
        message = self.error.encode()[:room].decode(errors="ignore").encode()
        data = bytearray(self.SIZE)
        fixed = (self.first_token_id, self.total_bytes, self.forward_us, self.push_us, self.cached_tokens)
        _SHARE_FIXED.pack_into(data, 0, *fixed, len(code), len(capability), len(message))
        logprobs = self.first_token_logprobs
        if logprobs is None:
            _SHARE_LOGPROBS.pack_into(data, _SHARE_FIXED.size, 0.0, _NO_LOGPROBS)
        else:
            if len(logprobs.top) > MAX_LOGPROBS:
                raise ValueError(f"{len(logprobs.top)} alternatives; a RankShare holds {MAX_LOGPROBS}")
            _SHARE_LOGPROBS.pack_into(data, _SHARE_FIXED.size, logprobs.logprob, len(logprobs.top))
            for i, alternative in enumerate(logprobs.top):
                offset = _SHARE_FIXED.size + _SHARE_LOGPROBS.size + i * _SHARE_ALTERNATIVE.size
                _SHARE_ALTERNATIVE.pack_into(data, offset, *alternative)
        tail = code + capability + message
        data[_SHARE_HEAD : _SHARE_HEAD + len(tail)] = tail
        return torch.frombuffer(data, dtype=torch.uint8)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> RankShare:
        """The share one rank contributed."""
        data = tensor.numpy().tobytes()
        token, total, forward_us, push_us, cached, n_code, n_cap, n_msg = _SHARE_FIXED.unpack_from(data, 0)
        logprob, n_top = _SHARE_LOGPROBS.unpack_from(data, _SHARE_FIXED.size)
        logprobs = None
        if n_top != _NO_LOGPROBS:
            first = _SHARE_FIXED.size + _SHARE_LOGPROBS.size
            size = _SHARE_ALTERNATIVE.size
            top = tuple(_SHARE_ALTERNATIVE.unpack_from(data, first + i * size) for i in range(n_top))
            logprobs = TokenLogprobs(token, logprob, top)
        offset = _SHARE_HEAD
        code = data[offset : offset + n_code].decode()
        capability = data[offset + n_code : offset + n_code + n_cap].decode()
        message = data[offset + n_code + n_cap : offset + n_code + n_cap + n_msg].decode()
        return cls(token, total, forward_us, push_us, capability, code, message, logprobs, cached)


@dataclass(frozen=True)
class StoredShard:
    """A shard of the replica that is in the store: where, under which capability, and its size."""

    shard: ReplicaShard
    capability: str
    total_bytes: int


@dataclass(frozen=True)
class PrefillOutcome:
    """What rank 0 reports back to its node for one job."""

    request_id: str
    kv_key: str
    first_token_id: int
    replica_rank: int
    total_bytes: int
    forward_seconds: float
    push_seconds: float
    capability: str = ""
    # The kind (gRPC status name) and message of the first rank's failure; empty when the job succeeded.
    error_code: str = ""
    error: str = ""
    # Whether the replica is in the store (it may be, even for a failed job: then nobody will read it).
    replica_stored: bool = False
    # The first token's log-probabilities, when the request asked.
    first_token_logprobs: TokenLogprobs | None = None
    # The shards of the replica that are in the store (all of them when the job succeeded), in head order.
    shards: tuple[StoredShard, ...] = ()
    # Leading prompt tokens the set took from the store's prefix cache (the stored replica holds the rest).
    cached_tokens: int = 0

    @classmethod
    def combine(
        cls, job: PrefillJob, replica_rank: int, shares: Sequence[RankShare], tp_size: int = 1
    ) -> PrefillOutcome:
        """Rank 0's view of a job from every rank's share (shares[i] is global rank i's); replica_rank is
        the owning PCP rank, whose TP ranks pushed the job's shards."""
        pushed = [(shard, shares[replica_rank * tp_size + shard.tp_rank]) for shard in job.stored_shards()]
        stored = tuple(
            StoredShard(shard, share.capability, share.total_bytes)
            for shard, share in pushed
            if not share.error and share.total_bytes > 0
        )
        failed = next((s for s in shares if s.error), None)
        sampler = next((s for s in shares if s.first_token_id >= 0), None)
        first_token = -1 if sampler is None else sampler.first_token_id
        code, error = (failed.error_code, failed.error) if failed else ("", "")
        if not error and first_token < 0:
            code, error = Internal.code, "no rank sampled the first token"
        return cls(
            request_id=job.request_id,
            kv_key=job.kv_key,
            first_token_id=first_token,
            replica_rank=replica_rank,
            total_bytes=sum(s.total_bytes for s in stored),
            forward_seconds=max(s.forward_us for s in shares) / 1e6,
            # The shards are pushed in parallel: the slowest bounds the push.
            push_seconds=max(share.push_us for _, share in pushed) / 1e6,
            capability=stored[0].capability if stored else "",
            error_code=code,
            error=error,
            replica_stored=bool(stored),
            first_token_logprobs=None if sampler is None else sampler.first_token_logprobs,
            shards=stored,
            cached_tokens=shares[0].cached_tokens,
        )

    def first_token_logprobs_wire(self) -> common_pb2.TokenLogprobs | None:
        """PrefillResponse.first_token_logprobs (texts left to decode); None when none were asked."""
        logprobs = self.first_token_logprobs
        if logprobs is None:
            return None
        return common_pb2.TokenLogprobs(
            chosen=common_pb2.TokenLogprob(token_id=logprobs.token_id, logprob=logprobs.logprob),
            top=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
        )

    def error_kind(self) -> ServiceError | None:
        """The failure as an error of its kind (None when the job succeeded)."""
        return error_of_code(self.error_code or Internal.code, self.error) if self.error else None
