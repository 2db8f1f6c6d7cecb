"""The registry's optional snapshot file: a JSON picture of sets and generations that makes a restart
faster (never required: nodes re-register carrying their assignments anyway)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


def read_snapshot(path: Path) -> dict | None:
    """The snapshot at path, or None when there is none or it cannot be read (a restart never depends on
    it)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("snapshot unreadable; starting without it", extra={"path": str(path), "error": str(exc)})
        return None


def write_snapshot(path: Path, snapshot: dict) -> None:
    """Writes atomically (temp file + rename), so a crash never leaves half a snapshot."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(snapshot))
        os.replace(tmp, path)
    except OSError:
        # a full disk may have left part of the temp file: give the space back
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


class SnapshotFile:
    """The snapshot file a running registry keeps fresh. A write that fails (disk full, folder removed) is
    logged, once per distinct error, and never raised: the registry's loops must outlive its disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # the error of the last failed write, logged already (None: the last write succeeded)
        self._failure: str | None = None

    def save(self, snapshot: dict) -> bool:
        """Writes snapshot; False when it could not be written (the caller tries again later)."""
        try:
            write_snapshot(self.path, snapshot)
        except OSError as exc:
            if str(exc) != self._failure:
                self._failure = str(exc)
                log.warning(
                    "snapshot not written; serving on without it",
                    extra={"path": str(self.path), "error": self._failure},
                )
            return False
        if self._failure is not None:
            self._failure = None
            log.info("snapshot written again", extra={"path": str(self.path)})
        return True
