"""One queue of outgoing Session messages per node; at most one Session stream drains it at a time.

A node's queue outlives its streams, so commands issued while it reconnects are not lost. A newer Session
(or a re-registration) takes the queue over; the older stream gets None and ends.
"""

from __future__ import annotations

import asyncio

from pcpstack.v1 import registry_pb2

Queue = asyncio.Queue[registry_pb2.SessionResponse | None]


class Mailboxes:
    """The registry's per-node outboxes, keyed by node id."""

    def __init__(self) -> None:
        self._queues: dict[str, Queue] = {}

    def post(self, node_id: str, message: registry_pb2.SessionResponse) -> None:
        """Queues a message for the node's current or next Session."""
        self._queues.setdefault(node_id, asyncio.Queue()).put_nowait(message)

    def attach(self, node_id: str) -> Queue:
        """A fresh queue for a new Session, holding what was pending; the previous Session ends."""
        fresh: Queue = asyncio.Queue()
        old = self._queues.get(node_id)
        if old is not None:
            while not old.empty():
                if (message := old.get_nowait()) is not None:
                    fresh.put_nowait(message)
            old.put_nowait(None)
        self._queues[node_id] = fresh
        return fresh

    def detach(self, node_id: str, queue: Queue) -> None:
        """A Session ended: its pending messages stay for the next one."""
        if self._queues.get(node_id) is queue:
            self.attach(node_id)

    def reset(self, node_id: str) -> None:
        """Drops what is pending (a re-registration starts from the response's truth) and ends the node's
        current Session."""
        old = self._queues.pop(node_id, None)
        if old is not None:
            old.put_nowait(None)
