"""Builds and loads the C kernels of cpu_kernels.c, and calls them on torch tensors.

The library is compiled on first use with the machine's gcc for its own CPU (-march=native) and cached under
`~/.cache/pcpstack/kernels` (or $PCPSTACK_KERNEL_CACHE) by a hash of the source, flags, compiler and CPU
flags, so every process after the first loads it in milliseconds. Where no compiler works, or
PCPSTACK_CPU_KERNELS=0, `library()` is None and the engine runs its plain PyTorch path: same results,
slower decode.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
ENABLE_ENV = "PCPSTACK_CPU_KERNELS"
CACHE_ENV = "PCPSTACK_KERNEL_CACHE"
# libmvec: glibc's vector expf for the softmax.
LIBS = ("-lm", "-lmvec")

_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "q4_1_matmul": (_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _int),
    "q8_0_matmul": (_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _int),
    # q, seqs, heads, kv_heads, dim, k_cache, v_cache, num_blocks, block_size, tables, width, lens, scale,
    # out, threads; returns 0, or -1 for a table or length that lies outside the cache.
    "paged_decode_attention": (_ptr, *[_i64] * 4, _ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _f32, _ptr, _int),
}
_RESTYPES = {"paged_decode_attention": ctypes.c_int}


def _cpu_flags() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return line
    return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join(
            (SOURCE.read_text(), " ".join(FLAGS + LIBS), version, platform.machine(), _cpu_flags())
        ).encode()
    ).hexdigest()[:16]
    return _cache_dir() / f"cpu_kernels-{key}.so"


def _cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    try:
        return Path.home() / ".cache" / "pcpstack" / "kernels"
    except RuntimeError:  # no home directory (a container user without a passwd entry)
        return Path(tempfile.gettempdir()) / f"pcpstack-kernels-{os.getuid()}"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: processes starting together never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", str(partial), str(SOURCE), *LIBS],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, built first if needed; None when disabled or when no compiler can build them."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: decode runs on plain PyTorch kernels (slower)")
        return None
    try:
        path = _library_path(compiler)
        if not path.exists():
            # `progress`: a local stack relays these to its user (a first build takes a while).
            started = time.monotonic()
            log.info("building CPU kernels with %s into %s", compiler, path, extra={"progress": "kernels"})
            _build(compiler, path)
            log.info("CPU kernels built in %.1f s", time.monotonic() - started, extra={"progress": "kernels"})
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("CPU kernels unavailable, decode runs on plain PyTorch kernels (slower): %s", detail)
        return None
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, _RESTYPES.get(name)
    return lib


def block_matmul(
    lib: ctypes.CDLL,
    kind: str,
    x: torch.Tensor,
    qs: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor | None,
) -> torch.Tensor:
    """x [m, k] fp32 @ W^T for W [n, k] in blocks: "q4_1" (qs [n, k/32, 16] uint8, scale and minimum
    [n, k/32]) or "q8_0" (qs [n, k/32, 32] int8, scale [n, k/32], no minimum)."""
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], qs.shape[0], dtype=torch.float32)
    mins = () if minimum is None else (minimum.data_ptr(),)
    getattr(lib, f"{kind}_matmul")(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        qs.data_ptr(),
        scale.data_ptr(),
        *mins,
        qs.shape[0],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def paged_decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """One query per sequence (q [seqs, heads, dim]) over its paged fp32 context -> [seqs, heads, dim]."""
    q = q.contiguous()
    seqs, heads, dim = q.shape
    blocks, block_size, kv_heads, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_decode_attention needs contiguous K/V cache layers")
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
        raise ValueError("paged_decode_attention computes in fp32 only")
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    status = lib.paged_decode_attention(
        q.data_ptr(),
        seqs,
        heads,
        kv_heads,
        dim,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        blocks,
        block_size,
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        dim**-0.5,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise ValueError("paged_decode_attention: block tables or context lengths lie outside the cache")
    return out
