"""Helpers for the KV store service tests: a real store on 127.0.0.1 port 0, run inside asyncio.run."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from pcpstack.kvstore.server import KvStoreServer, KvStoreServerConfig, serve


@contextlib.asynccontextmanager
async def running_store(capacity_bytes: int = 1 << 30, **config) -> AsyncIterator[KvStoreServer]:
    """A started store; stopped (and every segment freed) on exit."""
    server = await serve(KvStoreServerConfig(capacity_bytes=capacity_bytes, **config))
    try:
        yield server
    finally:
        await server.stop(grace=0)


def segment_files(server: KvStoreServer) -> list[Path]:
    """The store's segment files (not its lock file) in its shm directory."""
    segments = server.servicer.segments
    return sorted(segments.directory.glob(f"pcpkv-{segments.token}-*"))
