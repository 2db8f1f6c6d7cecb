"""Which PCP rank's complete KV replica is kept for a request, and the store key it is kept under.

Every party computes the owner from the request id alone, without talking: the first 8 bytes of
sha256(request_id) read little-endian, modulo the PCP size. Python's hash() is salted per process and
must never be used here.

The key is per attempt, not per request: store keys are write-once, and a client may send the same request
id twice (a retry, a reused X-Request-Id), so the id is followed by a random nonce. It still starts with the
request id (readable in the store's logs) and ends with the fingerprint prefix the store's keys carry.
"""

from __future__ import annotations

import hashlib
import uuid

from pcpstack.kvstore.client import make_key


def replica_owner(request_id: str, pcp_size: int) -> int:
    """The PCP rank whose replica is pushed to the KV store for request_id."""
    if pcp_size < 1:
        raise ValueError(f"pcp_size={pcp_size} must be >= 1")
    digest = hashlib.sha256(request_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % pcp_size


def replica_key(request_id: str, fingerprint: str) -> str:
    """A fresh store key for one attempt at request_id: `<request_id>.<nonce>/<fingerprint prefix>`."""
    return make_key(f"{request_id}.{uuid.uuid4().hex}", fingerprint)
