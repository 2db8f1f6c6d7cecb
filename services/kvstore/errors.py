"""Errors of the KV store: kinds of pcpstack's one error hierarchy (pcpstack.common.errors).

The core and the servicer raise these; the common interceptor sends each as its gRPC status; the client
turns a status back into the same kind with `error_from_rpc`. The generic kinds are re-exported under the
names callers already import from here (`except NotFound` works whichever side raised it). The store's
own errors subclass a kind, so `except FailedPrecondition` catches a FingerprintMismatch too; a client
receiving one over gRPC gets the kind (FailedPrecondition), a caller of the core the subclass.
"""

from __future__ import annotations

from pcpstack.common.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)

__all__ = [
    "AlreadyExists",
    "CapabilityDenied",
    "CapacityExceeded",
    "ChecksumMismatch",
    "FingerprintMismatch",
    "Internal",
    "InvalidArgument",
    "NotFound",
    "ProtocolError",
    "StoreStalled",
]


class FingerprintMismatch(FailedPrecondition):
    """The reader's model/KV-layout fingerprint differs from the writer's."""


class CapacityExceeded(ResourceExhausted):
    """The object cannot fit in the memory budget even after evicting every released object."""


class ChecksumMismatch(DataLoss):
    """Bytes do not match their CRC32C: a chunk or a whole object is corrupt."""


class CapabilityDenied(PermissionDenied):
    """The caller did not present the object's capability (missing or wrong)."""


class ProtocolError(Internal):
    """The peer broke the stream's protocol (a message out of order, bytes missing)."""


class StoreStalled(Unavailable):
    """A store that took or answered nothing of a call for the client's stall bound (frozen, overloaded, cut
    off): a new channel would wait as long, so a caller does not retry on one."""
