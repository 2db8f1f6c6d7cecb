"""Errors of the KV store, shared by the core, the servicer and the client.

Each error names the gRPC status code it travels as (by name, so the core stays free of gRPC); the
servicer aborts with that code and the client turns the code back into the same class.
"""

from __future__ import annotations


class KvStoreError(Exception):
    """Base of every KV store error; `code` is the gRPC status code name it travels as."""

    code = "UNKNOWN"


class InvalidArgument(KvStoreError):
    """A request is malformed; the message names the field."""

    code = "INVALID_ARGUMENT"


class AlreadyExists(KvStoreError):
    """The key is already committed (or being put): keys are write-once."""

    code = "ALREADY_EXISTS"


class NotFound(KvStoreError):
    """No object with that key."""

    code = "NOT_FOUND"


class FingerprintMismatch(KvStoreError):
    """The reader's model/KV-layout fingerprint differs from the writer's."""

    code = "FAILED_PRECONDITION"


class CapacityExceeded(KvStoreError):
    """The object cannot fit in the memory budget even after evicting every released object."""

    code = "RESOURCE_EXHAUSTED"


class ChecksumMismatch(KvStoreError):
    """Bytes do not match their CRC32C: a chunk or a whole object is corrupt."""

    code = "DATA_LOSS"


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        AlreadyExists,
        NotFound,
        FingerprintMismatch,
        CapacityExceeded,
        ChecksumMismatch,
    )
}


def error_for_code(code_name: str, message: str) -> KvStoreError:
    """The error class for a gRPC status code name (KvStoreError with that code for any other)."""
    cls = _BY_CODE.get(code_name)
    if cls is not None:
        return cls(message)
    error = KvStoreError(f"{code_name}: {message}")
    error.code = code_name
    return error
