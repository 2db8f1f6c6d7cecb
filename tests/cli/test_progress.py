"""The CLI's progress output: a line redrawn in place with a bar on a terminal, plain lines in a log."""

from __future__ import annotations

import io
import subprocess
import sys

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
