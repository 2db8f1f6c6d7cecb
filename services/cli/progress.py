"""Progress of the CLI's long waits (a local stack starting, models loading, kernels building) on stderr.

On a terminal the current state is one line redrawn in place, with a bar of the parts that are ready, and
each finished step is printed above it; in a log (stderr not a terminal) every step is a plain line and
the state is a plain line when it changes, plus a reminder every `reminder_s` seconds of waiting.
"""

from __future__ import annotations

import sys
from typing import TextIO

BAR_WIDTH = 20
# Erases the terminal line the cursor is on, after a carriage return.
_CLEAR_LINE = "\r\x1b[K"


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    """A text bar `[#####-----] done/total`."""
    filled = width * min(done, total) // total if total > 0 else width
    return f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total}"


class ProgressPrinter:
    """Writes steps and a waiting state to a stream; see the module docstring for the two modes."""

    def __init__(
        self, stream: TextIO | None = None, *, interactive: bool | None = None, reminder_s: float = 10.0
    ) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self.interactive = self._stream.isatty() if interactive is None else interactive
        self._reminder_s = reminder_s
        self._state_on_screen = False
        self._last_state: str | None = None
        self._last_state_at = 0.0

    def _write(self, text: str) -> None:
        self._stream.write(text)
        self._stream.flush()

    def step(self, message: str) -> None:
        """One finished step or event, always on a line of its own."""
        self._write(f"{_CLEAR_LINE if self._state_on_screen else ''}{message}\n")
        self._state_on_screen = False
        if self.interactive and self._last_state is not None:
            # Keep the state visible under the step that was printed above it.
            self._write(self._last_state)
            self._state_on_screen = True

    def state(self, elapsed_s: float, done: int, total: int, what: str) -> None:
        """The waiting state: `done` of `total` parts ready, `what` in words, after `elapsed_s` seconds."""
        if self.interactive:
            self._last_state = f"  {bar(done, total)}  {elapsed_s:5.1f} s  {what}"
            self._write(_CLEAR_LINE + self._last_state)
            self._state_on_screen = True
            return
        if what != self._last_state or elapsed_s - self._last_state_at >= self._reminder_s:
            self._write(f"  ... {elapsed_s:5.1f} s: {done}/{total} ready: {what}\n")
            self._last_state, self._last_state_at = what, elapsed_s

    def finish(self) -> None:
        """Ends the redrawn line, if any, so later output starts on a fresh line."""
        if self._state_on_screen:
            self._write("\n")
        self._state_on_screen = False
        self._last_state = None
