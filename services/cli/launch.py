"""Starting pcpstack processes: the one place that builds a `pcpstack serve ...` command line and the
environment a child service runs in. The local stack, the tests and the benchmarks all start services here.

A child runs `python -m pcpstack.cli` with this interpreter, so it uses the same installed package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pcpstack.common.telemetry import TRACE_FILE_ENV
from pcpstack.common.tunables import GLIBC_TUNABLES


def cli_command(*args: str) -> list[str]:
    """The command line of `pcpstack ARGS` run by this interpreter."""
    return [sys.executable, "-m", "pcpstack.cli", *args]


def service_command(service: str, *args: str) -> list[str]:
    """The command line of `pcpstack serve SERVICE ARGS`."""
    return cli_command("serve", service, *args)


def child_env(
    *,
    inherit_telemetry: bool = True,
    trace_file: str | Path | None = None,
    extra: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a child service: this process's (or `base`), output unbuffered, the glibc
    tunables set up front (so the child need not re-execute itself for them).

    inherit_telemetry=False drops the parent's OpenTelemetry exporters and span file (tests keep their
    children quiet unless they ask for spans); trace_file sends the child's spans to that file; extra is
    applied last.
    """
    env = dict(os.environ if base is None else base)
    if not inherit_telemetry:
        for name in list(env):
            if name.startswith("OTEL_") or name == TRACE_FILE_ENV:
                del env[name]
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("GLIBC_TUNABLES", ":".join(GLIBC_TUNABLES))
    if trace_file is not None:
        env[TRACE_FILE_ENV] = str(trace_file)
    env.update(extra or {})
    return env


def spawn_service(
    service: str,
    args: Sequence[str] = (),
    *,
    log: Path | None = None,
    env: Mapping[str, str] | None = None,
    prefix: Sequence[str] = (),
    **popen: Any,
) -> subprocess.Popen:
    """Starts `pcpstack serve SERVICE ARGS` and returns its process.

    log: a file that gets the child's stdout and stderr (otherwise pass stdout=/stderr= as for Popen).
    env: the child's environment (default child_env()). prefix: words run before the interpreter, e.g.
    `ip netns exec NS`. Other keywords go to Popen (start_new_session, text, ...).
    """
    command = [*prefix, *service_command(service, *args)]
    env = dict(child_env() if env is None else env)
    if log is None:
        return subprocess.Popen(command, env=env, **popen)
    with open(log, "w") as out:
        # The child holds its own copy of the descriptor; this one closes when Popen returns.
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, **popen)


def spawn_and_wait_listening(
    service: str, args: Sequence[str] = (), *, env: Mapping[str, str] | None = None, **popen: Any
) -> tuple[subprocess.Popen, str]:
    """Starts a service that announces `... listening on HOST:PORT` as its first stdout line (kvstore,
    prefill, decode: handy with --port 0) and returns the process with that address. stderr is discarded
    unless given; a service that exits or prints something else first is killed and reported."""
    popen.setdefault("stderr", subprocess.DEVNULL)
    process = spawn_service(service, args, env=env, stdout=subprocess.PIPE, text=True, **popen)
    line = process.stdout.readline()
    _, announced, address = line.strip().rpartition(" listening on ")
    if not announced:
        process.kill()
        process.wait()
        raise RuntimeError(f"pcpstack serve {service} did not start: {line!r}")
    return process, address
