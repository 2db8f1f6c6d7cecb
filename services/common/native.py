"""Building the project's C sources on first use: one cache folder, a cache key per source, flags and
compiler, and a build that never lets another process load a half-written library; beside the libraries,
the speed verdicts that decide which code a machine runs (kept_verdict, keep_verdict). Torch-free, so the KV
store's copy (kvstore/copy_crc.c) and the engine's kernels (engine/cpu_kernels.c) share it.

The cache is `~/.cache/pcpstack/kernels`, or $PCPSTACK_KERNEL_CACHE (a temporary folder of the user's when
there is no home directory)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

CACHE_ENV = "PCPSTACK_KERNEL_CACHE"

log = logging.getLogger(__name__)


def compiler() -> str | None:
    """The C compiler: $CC, else gcc, else cc; None when there is none."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def cpu_flags() -> str:
    """The CPU's flags line from /proc/cpuinfo (what it can run), else the platform's processor name: part
    of the cache keys of whatever is built or measured for this CPU."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return line
    return platform.processor()


def cache_dir() -> Path:
    """Where built libraries are kept."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    try:
        return Path.home() / ".cache" / "pcpstack" / "kernels"
    except RuntimeError:  # no home directory (a container user without a passwd entry)
        return Path(tempfile.gettempdir()) / f"pcpstack-kernels-{os.getuid()}"


def library_path(cc: str, source: Path, command: Sequence[str], *more_keys: str) -> Path:
    """The cached library of `source` built by `cc` with `command` (flags and libraries): named by a hash
    of the source text, the command, the compiler's version and any `more_keys` (e.g. the CPU's flags)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    parts = (source.read_text(), " ".join(command), version, *more_keys)
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{key}.so"


def build(
    cc: str, source: Path, flags: Sequence[str], libs: Sequence[str], target: Path, timeout_s: float
) -> None:
    """Compiles `source` into `target`: beside it first, then renamed, so processes starting together never
    load a half-written file. subprocess.CalledProcessError (with the compiler's stderr) when it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        subprocess.run(
            [cc, *flags, "-o", str(partial), str(source), *libs],
            capture_output=True,
            text=True,
            check=True,
            timeout=timeout_s,
        )
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)


def kept_verdict(path: Path, min_speedup: float) -> dict | None:
    """A speed verdict kept at `path` (keep_verdict) if it was judged by the same `min_speedup`, else None."""
    try:
        verdict = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return verdict if verdict.get("min_speedup") == min_speedup else None


def keep_verdict(path: Path, verdict: dict) -> None:
    """Writes a speed verdict for every later process on the machine: atomically (processes starting together
    may both measure; either answer stands), and not at all where the cache is read-only (measured again
    next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".json", delete=False) as tmp:
            json.dump(verdict, tmp)
        Path(tmp.name).replace(path)
    except OSError as error:
        log.debug("could not keep the verdict in %s: %s", path, error)
