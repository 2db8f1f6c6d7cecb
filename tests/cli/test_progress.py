"""The CLI's progress output: a line redrawn in place with a bar on a terminal, plain lines in a log."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pty
import subprocess
import sys

import pytest

from pcpstack.cli.launch import cli_command
from pcpstack.cli.progress import ProgressPrinter, bar
from pcpstack.cli.stack import Service
from pcpstack.engine.cpu_kernels import CACHE_ENV, ENABLE_ENV


def test_bar_fills_in_proportion_to_the_parts_ready() -> None:
    assert bar(0, 4, width=8) == "[--------] 0/4"
    assert bar(2, 4, width=8) == "[####----] 2/4"
    assert bar(4, 4, width=8) == "[########] 4/4"


def test_a_terminal_gets_the_state_redrawn_in_place_with_steps_printed_above_it() -> None:
    out = io.StringIO()
    printer = ProgressPrinter(out, interactive=True)
    printer.state(1.0, 1, 5, "registry up")
    printer.state(1.5, 2, 5, "registry up, 1/1 KV stores")
    printer.step("decode-0: loading model tiny on cpu")
    printer.finish()
    text = out.getvalue()
    # One visible line per step; the state is rewritten after a carriage return, never on a new line.
    assert text.count("\n") == 2
    assert "\r\x1b[K  [########------------] 2/5    1.5 s  registry up, 1/1 KV stores" in text
    assert "\r\x1b[Kdecode-0: loading model tiny on cpu\n" in text


def test_a_log_gets_plain_lines_when_the_state_changes_and_as_a_reminder() -> None:
    out = io.StringIO()
    printer = ProgressPrinter(out, interactive=False, reminder_s=10)
    printer.state(0.5, 0, 5, "starting")
    printer.state(1.0, 0, 5, "starting")  # unchanged, too soon: nothing
    printer.state(11.0, 0, 5, "starting")  # unchanged, but a reminder is due
    printer.step("prefill-0: model tiny loaded in 3.0 s")
    printer.state(12.0, 3, 5, "registry up")
    lines = out.getvalue().splitlines()
    assert lines == [
        "  ...   0.5 s: 0/5 ready: starting",
        "  ...  11.0 s: 0/5 ready: starting",
        "prefill-0: model tiny loaded in 3.0 s",
        "  ...  12.0 s: 3/5 ready: registry up",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_stack_relays_the_kernel_build_a_service_logs(tmp_path, child_env) -> None:
    """A real first build (gcc, an empty kernel cache) in a service-like process, its JSON log read back
    by the stack's relay as the user sees it."""
    log_path = tmp_path / "decode-0.log"
    script = (
        "from pcpstack.common.logs import setup_logging\n"
        "from pcpstack.engine import cpu_kernels\n"
        "setup_logging('decode')\n"
        "assert cpu_kernels.library() is not None\n"
    )
    env = {**child_env, CACHE_ENV: str(tmp_path / "kernels"), ENABLE_ENV: "1"}
    with log_path.open("w") as log:
        run = subprocess.run([sys.executable, "-c", script], stderr=log, env=env, timeout=300)
    assert run.returncode == 0, log_path.read_text()
    service = Service("decode-0", "127.0.0.1:1", None, log_path)  # type: ignore[arg-type]
    messages = service.progress_lines()
    assert messages[0].startswith("building CPU kernels with ")
    assert messages[1].startswith("CPU kernels built in ")
    assert service.progress_lines() == []  # each message is relayed once


@pytest.mark.slow
def test_generate_local_on_a_terminal_draws_a_progress_bar_in_place(tmp_path, child_env) -> None:
    """stderr on a pseudo-terminal, as a user at a shell has it: the waiting state is redrawn with a bar,
    the models' loading steps are lines of their own, and the answer still comes on stdout."""
    controller, terminal = pty.openpty()
    try:
        run = subprocess.Popen(
            cli_command(
                "generate",
                "--local",
                "--pcp",
                "1",
                "--model",
                "tiny",
                "--log-dir",
                str(tmp_path),
                "--max-tokens",
                "3",
                "--ignore-eos",
                "--json",
                "hi",
            ),
            stdout=subprocess.PIPE,
            stderr=terminal,
            env=child_env,
        )
        os.close(terminal)
        shown = b""
        with contextlib.suppress(OSError):  # EIO once the child closes its end
            while chunk := os.read(controller, 4096):
                shown += chunk
        answer = json.loads(run.communicate(timeout=300)[0])
    finally:
        os.close(controller)
    text = shown.decode(errors="replace")
    assert run.returncode == 0 and len(answer["token_ids"]) == 3
    assert "\r\x1b[K  [" in text and "/5  " in text  # the bar of 5 parts, redrawn in place
    assert "decode-0: loading model tiny on cpu" in text and "stack ready in " in text
