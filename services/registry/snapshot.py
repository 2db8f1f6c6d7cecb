"""The registry's optional snapshot file: a JSON picture of sets and generations that makes a restart
faster (never required: nodes re-register carrying their assignments anyway)."""

from __future__ import annotations

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
    tmp.write_text(json.dumps(snapshot))
    os.replace(tmp, path)
