"""The CLI's progress output: a line redrawn in place with a bar on a terminal, plain lines in a log."""

from __future__ import annotations

import io

from pcpstack.cli.progress import ProgressPrinter, bar


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
