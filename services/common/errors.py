"""The one error hierarchy of pcpstack.

Every failure a service reports to a caller is a `ServiceError` of one kind below; the kind says which gRPC
status it travels as (by name, so the cores that raise these stay free of gRPC). The mapping to and from
real gRPC statuses lives in one place, `pcpstack.common.rpc_errors`; services subclass these kinds for
their own errors (the KV store's FingerprintMismatch is a FailedPrecondition, and so on).
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base of every error a service reports; `code` is the name of the gRPC status it travels as."""

    code = "UNKNOWN"


class InvalidArgument(ServiceError):
    """The request is malformed or out of range; the message names the field and the rule."""

    code = "INVALID_ARGUMENT"


class FailedPrecondition(ServiceError):
    """The request is well formed but the system is not in a state (or configuration) to serve it."""

    code = "FAILED_PRECONDITION"


class NotFound(ServiceError):
    """What the request names does not exist."""

    code = "NOT_FOUND"


class AlreadyExists(ServiceError):
    """What the request would create exists already."""

    code = "ALREADY_EXISTS"


class PermissionDenied(ServiceError):
    """The caller may not do this."""

    code = "PERMISSION_DENIED"


class ResourceExhausted(ServiceError):
    """Capacity is exhausted (memory, queue, blocks); the caller may retry later."""

    code = "RESOURCE_EXHAUSTED"


class Unavailable(ServiceError):
    """A peer this request needs is missing or failed; the caller may retry, possibly elsewhere."""

    code = "UNAVAILABLE"


class DeadlineExceeded(ServiceError):
    """The request's deadline passed before it finished."""

    code = "DEADLINE_EXCEEDED"


class DataLoss(ServiceError):
    """Bytes were corrupted (a checksum did not match)."""

    code = "DATA_LOSS"


class Internal(ServiceError):
    """A bug or an unexpected failure inside the service."""

    code = "INTERNAL"


KINDS: dict[str, type[ServiceError]] = {
    kind.code: kind
    for kind in (
        InvalidArgument,
        FailedPrecondition,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        DataLoss,
        Internal,
    )
}


def error_of_code(code_name: str, message: str) -> ServiceError:
    """The error of the kind that travels as gRPC status `code_name` (a plain ServiceError for others)."""
    kind = KINDS.get(code_name)
    if kind is not None:
        return kind(message)
    error = ServiceError(f"{code_name}: {message}")
    error.code = code_name
    return error
