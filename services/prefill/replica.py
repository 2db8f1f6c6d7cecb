"""Which PCP rank's complete KV replica is kept for a request.

Every party computes the same answer from the request id alone, without talking: the first 8 bytes of
sha256(request_id) read little-endian, modulo the PCP size. Python's hash() is salted per process and
must never be used here.
"""

from __future__ import annotations

import hashlib


def replica_owner(request_id: str, pcp_size: int) -> int:
    """The PCP rank whose replica is pushed to the KV store for request_id."""
    if pcp_size < 1:
        raise ValueError(f"pcp_size={pcp_size} must be >= 1")
    digest = hashlib.sha256(request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % pcp_size
