"""Errors of the prefill service, as kinds of the shared hierarchy (pcpstack.common.errors).

The common interceptor answers each with its kind's gRPC status, so the servicer only raises them. A set
that cannot run work (not assigned, starting, failed) is UNAVAILABLE: the caller should go to another set.
An error of one request (its sampling failed, the store refused its replica) is reported with the kind of
its cause, and the set keeps serving.
"""

from __future__ import annotations

from pcpstack.common.errors import FailedPrecondition, PermissionDenied, ResourceExhausted, Unavailable


class SetUnavailable(Unavailable):
    """The node has no ready set to run a job on (not assigned yet, starting, or failed)."""


class NotMaster(FailedPrecondition):
    """The node is headless in its set: Prefill is served by the set's master only."""


class StoreNotListed(PermissionDenied):
    """A request named a KV store the registry does not list; ranks push only to listed stores."""


class StoreGone(Unavailable):
    """A request named a KV store the registry listed before but no longer does (it died or left): the
    caller should pick another store."""


class PromptOverCapacity(ResourceExhausted):
    """A prompt longer than the K/V a rank's cache holds (--kv-cache-tokens): every PCP rank keeps the
    whole prompt's K/V, so no set of this configuration can take it."""
