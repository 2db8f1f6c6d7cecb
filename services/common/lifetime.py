"""Child processes that end when the process that started them is gone.

A prefill node's rank processes, a decode worker's TP followers and the services of a local stack are
children that make no sense alone: when their parent is killed with SIGKILL (an operator's kill -9, an OOM
kill, a test runner stopped) nothing tells them to stop, and they live on holding ports, memory and cores.
Linux's PR_SET_PDEATHSIG would do it, but it fires when the parent *thread* that forked exits, which is not
the process's end when the fork came from a worker thread. So a child watches instead: a daemon thread checks
once a second whether its parent pid is still its parent (an orphan is re-parented, to init or a
subreaper) and ends the process when it is not.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

# Set by a parent that wants its service children to end with it (the local stack); holds its pid.
PARENT_PID_ENV = "PCPSTACK_EXIT_WITH_PARENT"
POLL_S = 1.0
# A service asked to stop because its parent is gone gets this long to drain before it is ended outright.
SERVICE_GRACE_S = 20.0


def _exit_now(what: str) -> None:
    print(f"{what}: its parent process is gone; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_with_parent(
    parent_pid: int, what: str, *, on_orphan: Callable[[], None] | None = None, poll_s: float = POLL_S
) -> bool:
    """Ends this process once `parent_pid` stops being its parent: `on_orphan()` if given (e.g. a graceful
    stop), else at once with exit status 1. Returns False (and watches nothing) when parent_pid is not this
    process's parent now: a launcher stands between them, and its end would say nothing about the parent.
    A parent that died before this process got here counts as gone."""
    already_gone = os.getppid() != parent_pid
    if already_gone and _exists(parent_pid):
        return False

    def watch() -> None:
        while not already_gone and os.getppid() == parent_pid:
            time.sleep(poll_s)
        (on_orphan or (lambda: _exit_now(what)))()

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
    return True


def exit_with_spawning_process(what: str) -> bool:
    """For a multiprocessing child (a rank process): exit at once when the process that spawned it is gone.
    False when this process was not started by multiprocessing."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    return parent is not None and parent.pid is not None and exit_with_parent(parent.pid, what)


def exit_service_with_parent(service: str) -> bool:
    """For a service process: when the environment names a parent pid (PARENT_PID_ENV, taken out of the
    environment so this process's own children do not inherit it), stop gracefully once that parent is gone
    (SIGTERM to itself: the usual drain), and exit outright if the drain takes longer than SERVICE_GRACE_S."""
    value = os.environ.pop(PARENT_PID_ENV, "")
    if not value.isdigit():
        return False

    def stop() -> None:
        print(f"pcpstack serve {service}: its parent process is gone; stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(SERVICE_GRACE_S)
        _exit_now(f"pcpstack serve {service}")

    return exit_with_parent(int(value), f"pcpstack serve {service}", on_orphan=stop)
