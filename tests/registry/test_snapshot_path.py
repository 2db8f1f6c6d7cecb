"""The registry's --snapshot path: one it could never write is refused at start-up, and one that turns
unwritable while it serves costs a warning, never the loop that expires leases."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from pcpstack.registry.client import NodeSession, Resolver
from pcpstack.registry.membership import Settings
from pcpstack.registry.server import start_registry
from tests.common.test_startup import refusal
from tests.registry.support import until

pytestmark = pytest.mark.timeout(60)
# Long enough that a live session's heartbeats (a third of it) keep it on a loaded machine.
SETTINGS = Settings(lease_s=2.0, assembly_timeout_s=0.5, restore_grace_s=0.0)


def test_a_folder_given_as_snapshot_is_refused_at_start_up(child_env, tmp_path: Path) -> None:
    line = refusal(child_env, "registry", "--port", "0", "--snapshot", str(tmp_path))
    assert f"--snapshot='{tmp_path}'" in line and "not a folder" in line


def test_a_snapshot_that_turns_unwritable_is_logged_and_leases_still_expire(tmp_path: Path, caplog) -> None:
    path = tmp_path / "registry.snapshot"

    async def written() -> bool:
        return path.is_file()

    async def warned() -> bool:
        return "snapshot not written" in caplog.text

    async def scenario() -> None:
        registry = await start_registry(SETTINGS, snapshot_path=path)
        resolver = Resolver(registry.address)
        sessions = [
            NodeSession(registry.address, f"kv-{i}", "kvstore", f"127.0.0.1:{9600 + i}") for i in range(3)
        ]

        async def silent_store_gone() -> bool:
            found = await resolver.resolve(fresh=True)
            return "127.0.0.1:9601" not in [e.address for e in found.kvstore]

        try:
            await sessions[0].start()
            await sessions[0].wait_registered(timeout=5)
            await until(written)
            # a folder in the way makes every later write fail, even for root
            path.unlink()
            path.mkdir()
            await sessions[1].start()
            await sessions[1].wait_registered(timeout=5)
            await until(warned)
            assert not await silent_store_gone()
            await sessions[1].close()  # no deregistration: its lease lapses
            await until(silent_store_gone)
            path.rmdir()
            await sessions[2].start()
            await sessions[2].wait_registered(timeout=5)
            await until(written)
        finally:
            for session in sessions:
                await session.close()
            await resolver.close()
            await registry.stop()

    with caplog.at_level(logging.INFO, logger="pcpstack.registry.snapshot"):
        asyncio.run(asyncio.wait_for(scenario(), 45))
    failures = [r for r in caplog.records if r.getMessage().startswith("snapshot not written")]
    assert len(failures) == 1
    assert "snapshot written again" in caplog.text
