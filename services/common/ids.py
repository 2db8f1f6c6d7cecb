"""Request ids: one rule, checked at every edge (the gateway's X-Request-Id, Generate's request_id).

An id names a request in logs, traces and replies; it never becomes a storage key by itself (KV keys are
unique per attempt), but it is printed and propagated everywhere, so it is kept short and plain: 1 to
MAX_REQUEST_ID_CHARS printable ASCII characters, no spaces or control characters.
"""

from __future__ import annotations

import re

from pcpstack.common.errors import InvalidArgument

MAX_REQUEST_ID_CHARS = 128
_ALLOWED = re.compile(r"[\x21-\x7e]+")


def check_request_id(request_id: str, field: str = "request_id") -> str:
    """Returns the id unchanged, or raises InvalidArgument naming `field` and the rule it breaks."""
    if not request_id:
        raise InvalidArgument(f"{field} must not be empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(
            f"{field} is {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed"
        )
    if not _ALLOWED.fullmatch(request_id):
        bad = next(c for c in request_id if not _ALLOWED.fullmatch(c))
        raise InvalidArgument(
            f"{field} contains {bad!r}; only printable ASCII without spaces (0x21-0x7e) is allowed"
        )
    return request_id
