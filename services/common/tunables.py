"""glibc malloc tunables that make large protobuf bytes fields fast, applied at process start.

Large protobuf bytes fields serialise far faster when glibc serves multi-MiB allocations from a heap it
does not hand back to the kernel after every chunk (each fresh page costs a fault and zeroing): with both
tunables below, building and serialising a 4 MiB chunk message runs ~5x faster here. glibc reads its
tunables only at process start, so an entry point re-executes itself with them when they are missing.
"""

from __future__ import annotations

import os
import sys

GLIBC_TUNABLES = ("glibc.malloc.mmap_threshold=33554432", "glibc.malloc.trim_threshold=1073741824")


def ensure_glibc_tunables() -> None:
    """Re-executes this process with the malloc tunables added to GLIBC_TUNABLES unless every one of them
    is already set (returns only then); tunables the launcher set are kept."""
    present = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t]
    names = {t.split("=", 1)[0] for t in present}
    missing = [t for t in GLIBC_TUNABLES if t.split("=", 1)[0] not in names]
    if missing:
        os.environ["GLIBC_TUNABLES"] = ":".join(present + missing)
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
