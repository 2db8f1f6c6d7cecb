"""Children end when the process that started them is SIGKILLed: ranks at once, services after a drain.

Each test runs a small parent process that starts the child and prints its pid, kills the parent with
SIGKILL (nothing runs in it afterwards) and waits, bounded, for the child to be gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pcpstack.cli.launch import child_env
from pcpstack.common.lifetime import PARENT_PID_ENV

# Far above the one-second poll: only a child that never notices runs into it.
GONE_WITHIN_S = 30.0

RANK_PARENT = """
import multiprocessing as mp, sys, time
from tests.common.test_lifetime import rank_like_child
if __name__ == "__main__":
    child = mp.get_context("spawn").Process(target=rank_like_child, daemon=True)
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)
"""

SERVICE_PARENT = f"""
import os, subprocess, sys, time
from pcpstack.cli.launch import child_env, spawn_service
env = child_env(extra={{"{PARENT_PID_ENV}": str(os.getpid())}})
log = open(sys.argv[1], "w")
child = spawn_service("kvstore", ["--port", "0"], env=env, stdout=subprocess.DEVNULL, stderr=log)
print(child.pid, flush=True)
time.sleep(600)
"""


def rank_like_child() -> None:
    """What a rank process does first, then work that never ends on its own."""
    from pcpstack.common.lifetime import exit_with_spawning_process

    assert exit_with_spawning_process("test rank")
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _kill_parent_and_wait_for_child(script: str, *args: str) -> tuple[int, bool]:
    parent = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=Path(__file__).parents[2],
    )
    child = int(parent.stdout.readline())
    try:
        time.sleep(2.0)  # the child is up and watching
        assert _alive(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + GONE_WITHIN_S
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        return child, not _alive(child)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_rank_process_exits_when_its_spawning_process_is_killed() -> None:
    _, gone = _kill_parent_and_wait_for_child(RANK_PARENT)
    assert gone


@pytest.mark.slow
def test_a_local_stack_service_stops_when_the_stack_process_is_killed(tmp_path) -> None:
    log = tmp_path / "kvstore.log"
    _, gone = _kill_parent_and_wait_for_child(SERVICE_PARENT, str(log))
    assert gone
    assert "its parent process is gone; stopping" in log.read_text()


def test_a_service_started_by_hand_is_not_tied_to_anyone() -> None:
    from pcpstack.common.lifetime import exit_service_with_parent

    os.environ.pop(PARENT_PID_ENV, None)
    assert not exit_service_with_parent("kvstore")
    # A pid that is not this process's parent (a launcher stood between them) is not watched either.
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    assert not exit_service_with_parent("kvstore")
    assert PARENT_PID_ENV not in os.environ
