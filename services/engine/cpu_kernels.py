"""Builds and loads the C kernels of cpu_kernels.c, checks they beat plain PyTorch here, and calls them.

The library is compiled on first use with the machine's gcc for its own CPU (-march=native, or
$PCPSTACK_KERNEL_ARCH, e.g. `haswell` to build the AVX2 code on an AVX-512 machine) and cached under
`~/.cache/pcpstack/kernels` (or $PCPSTACK_KERNEL_CACHE) by a hash of the source, flags, compiler and CPU
flags, so every process after the first loads it in milliseconds.

A first build makes two libraries, one tuned as -march implies and one with GCC's generic tuning (TUNINGS),
times the same decode-shaped block matmuls in both and keeps the faster, its choice written beside them: the
vector code is the same, but the CPU's own tuning is not always the faster schedule for it.

The engine never takes a path slower than its fallback: right after the first build, the kernels' block
matmul is timed against torch's dense fp32 matmul of the same shape on this CPU, and the verdict is kept
beside the library (so every process on the machine makes the same choice). Kernels that lose are not used,
with a log line saying so. `library()` is the engine's choice; `build_library()` the kernels themselves.

PCPSTACK_CPU_KERNELS: unset (default) uses the kernels when they win; `1` uses them without the check; `0`
never; another value is a ConfigError (a node refuses it at start-up). Where no compiler works, or they
lose, or are off, `library()` is None and the engine runs its plain PyTorch path: same results up to
summation order.
"""

import contextlib
import ctypes
import functools
import json
import logging
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from pcpstack.common import native
from pcpstack.common.config import (
    CPU_KERNELS_CHOICES,
    CPU_KERNELS_ENV,
    KERNEL_MIN_SPEEDUP_ENV,
    env_choice,
    env_positive_float,
)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
ENABLE_ENV = CPU_KERNELS_ENV
CACHE_ENV = native.CACHE_ENV
ARCH_ENV = "PCPSTACK_KERNEL_ARCH"
# How much faster than torch's dense matmul the kernels must be to be used (1.0: at least as fast).
MIN_SPEEDUP_ENV = KERNEL_MIN_SPEEDUP_ENV
# GCC tunings a first build tries (-mtune; "": the one -march implies), the faster kept (_chosen_tuning). On
# an AMD EPYC without AVX-512 (Zen 3: -march=native is znver3) the batch-16 Q4_1 matmul took 560 us with the
# CPU's own tuning against 430 with the generic one, batch 1 equal (117 / 118 us), and decode at 16 streams
# ran 212-236 against 263-289 tokens/s; elsewhere the CPU's own may win, so both are timed.
TUNINGS = ("", "generic")
# Rows of the block matmuls that choose the tuning: one stream's decode and a batch of 16's.
TUNING_ROWS = (1, 16)
# libmvec: glibc's vector expf for the softmax.
LIBS = ("-lm", "-lmvec")

_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "q4_1_matmul": (_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _int),
    "q8_0_matmul": (_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _int),
    "q6_k_matmul": (_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _int),
    # q, seqs, heads, kv_heads, dim, k_cache, v_cache, num_blocks, block_size, tables, width, lens, scale,
    # out, threads; returns 0, -1 for a table or length that lies outside the cache, -2 when out of memory.
    "paged_decode_attention": (_ptr, *[_i64] * 4, _ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _f32, _ptr, _int),
    # weights, x, m, out, cos, sin, k_cache, v_cache, num_blocks, block_size, slots, tables, width, lens,
    # threads; returns 0, -1 for a slot, table or length outside the cache, -2 when out of memory.
    "decode_layer": (_ptr, _ptr, _i64, *[_ptr] * 5, _i64, _i64, _ptr, _ptr, _i64, _ptr, _int),
    # weights, x, m, logits, cos, sin, kv_cache, num_blocks, block_size, slots, tables, width, lens, threads;
    # returns as decode_layer.
    "decode_model": (_ptr, _ptr, _i64, *[_ptr] * 4, _i64, _i64, _ptr, _ptr, _i64, _ptr, _int),
}
_RESTYPES = {name: ctypes.c_int for name in ("paged_decode_attention", "decode_layer", "decode_model")}
# Block kinds as cpu_kernels.c numbers them.
KIND_CODES = {"q4_1": 0, "q8_0": 1, "q6_k": 2}


class BlockWeightC(ctypes.Structure):
    """cpu_kernels.c's block_weight: one projection in blocks (pointers into tensors its owner keeps), and
    `next`, the rows that follow in another kind (a fused projection of mixed parts), or NULL."""


# Declared after the class: the structure points to its own type.
BlockWeightC._fields_ = [
    ("kind", _i64),
    ("n", _i64),
    ("k", _i64),
    ("qs", _ptr),
    ("scale", _ptr),
    ("min", _ptr),
    ("bias", _ptr),
    ("next", ctypes.POINTER(BlockWeightC)),
]


class DecodeLayerWeightsC(ctypes.Structure):
    """cpu_kernels.c's decode_layer_weights: one decoder layer as `decode_layer` reads it."""

    _fields_ = [
        ("qkv", BlockWeightC),
        ("wo", BlockWeightC),
        ("w13", BlockWeightC),
        ("w2", BlockWeightC),
        ("attn_norm", _ptr),
        ("ffn_norm", _ptr),
        ("eps", ctypes.c_double),
        ("dim", _i64),
        ("heads", _i64),
        ("kv_heads", _i64),
        ("head_dim", _i64),
        ("hidden", _i64),
    ]


class DecodeModelWeightsC(ctypes.Structure):
    """cpu_kernels.c's decode_model_weights: a whole model's decode step as `decode_model` reads it."""

    _fields_ = [
        ("layers", ctypes.POINTER(ctypes.POINTER(DecodeLayerWeightsC))),
        ("num_layers", _i64),
        ("norm", _ptr),
        ("eps", ctypes.c_double),
        ("head", BlockWeightC),
    ]


def _flags(tuning: str = "") -> tuple[str, ...]:
    arch = os.environ.get(ARCH_ENV) or "native"
    tune = (f"-mtune={tuning}",) if tuning else ()
    return ("-O3", f"-march={arch}", *tune, "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")


def _library_path(compiler: str, tuning: str = "") -> Path:
    flags = _flags(tuning) + LIBS
    return native.library_path(compiler, SOURCE, flags, platform.machine(), native.cpu_flags())


def _built(compiler: str, tuning: str) -> ctypes.CDLL:
    """The library of one tuning, compiled first if the cache lacks it; raises OSError or SubprocessError
    where it cannot be built or loaded."""
    path = _library_path(compiler, tuning)
    if not path.exists():
        # `progress`: a local stack relays these to its user (a first build takes a while).
        started = time.monotonic()
        log.info("building CPU kernels with %s into %s", compiler, path, extra={"progress": "kernels"})
        native.build(compiler, SOURCE, _flags(tuning), LIBS, path, timeout_s=300)
        log.info("CPU kernels built in %.1f s", time.monotonic() - started, extra={"progress": "kernels"})
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, _RESTYPES.get(name)
    lib._pcpstack_path = path  # type: ignore[attr-defined]  (where its verdict is kept)
    lib._pcpstack_tuning = tuning  # type: ignore[attr-defined]  (what tuned_as reports)
    return lib


def tuned_as(lib: ctypes.CDLL) -> str:
    """The -mtune a library of build_library was compiled with ("": the one its -march implies)."""
    return lib._pcpstack_tuning  # type: ignore[attr-defined]


def enable_setting() -> str:
    """PCPSTACK_CPU_KERNELS: "", "0" or "1"; a ConfigError naming it, its value and the values it takes
    otherwise."""
    return env_choice(ENABLE_ENV, CPU_KERNELS_CHOICES)


@functools.cache
def build_library() -> ctypes.CDLL | None:
    """The kernels, built first if needed; None when switched off or when no compiler can build them."""
    if enable_setting() == "0":
        return None
    compiler = native.compiler()
    if compiler is None:
        log.warning("no C compiler found: decode runs on plain PyTorch kernels (slower)")
        return None
    libs, failure = {}, None
    for tuning in TUNINGS:
        try:
            libs[tuning] = _built(compiler, tuning)
        except (OSError, subprocess.SubprocessError) as error:
            failure = getattr(error, "stderr", "") or error
            log.info("CPU kernels tuned as %s could not be built: %s", tuning or "-march implies", failure)
    if not libs:
        log.warning("CPU kernels unavailable, decode runs on plain PyTorch kernels (slower): %s", failure)
        return None
    return libs[_chosen_tuning(compiler, libs)]


def _chosen_tuning(compiler: str, libs: dict[str, ctypes.CDLL]) -> str:
    """The tuning whose library decodes faster here: read from beside the default tuning's library, else
    timed once (measure_tunings) and written there, so every process on the machine loads the same one."""
    if len(libs) == 1:
        return next(iter(libs))
    path = Path(f"{_library_path(compiler)}.tuning.json")
    with contextlib.suppress(OSError, ValueError, KeyError):
        kept = json.loads(path.read_text())["tuning"]
        if kept in libs:
            return kept
    micros = measure_tunings(libs)
    chosen = min(libs, key=lambda tuning: micros[tuning])
    log.info(
        "CPU kernels: -mtune=%s chosen (block matmuls of %s rows: %s us)",
        chosen or "(-march's own)",
        " and ".join(map(str, TUNING_ROWS)),
        ", ".join(f"{tuning or '-march'} {us:.0f}" for tuning, us in micros.items()),
    )
    native.keep_verdict(path, {"tuning": chosen, "micros": micros})
    return chosen


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels the engine uses: built, and faster than plain PyTorch on this CPU (or forced with
    PCPSTACK_CPU_KERNELS=1); None otherwise, and the engine runs its plain path."""
    lib = build_library()
    if lib is None or enable_setting() == "1":
        return lib
    verdict = _verdict(lib)
    if not verdict["use"]:
        log.warning(
            "CPU kernels are slower than plain PyTorch on this CPU (block matmul %.0f us, dense fp32 "
            "%.0f us): decode runs on plain PyTorch kernels; PCPSTACK_CPU_KERNELS=1 uses them anyway",
            verdict["kernel_us"],
            verdict["dense_us"],
        )
        return None
    return lib


def _verdict(lib: ctypes.CDLL) -> dict:
    """Whether the kernels beat torch's dense matmul here: read from beside the library, else measured once
    and written there (atomically: processes starting together may both measure; either answer stands)."""
    min_speedup = env_positive_float(MIN_SPEEDUP_ENV, 1.0)
    path = Path(f"{lib._pcpstack_path}.speed.json")  # type: ignore[attr-defined]
    kept = native.kept_verdict(path, min_speedup)
    if kept is not None:
        return kept
    kernel_us, dense_us = measure_against_dense(lib)
    if dense_us < kernel_us * min_speedup:
        # A loss is kept for good: only one that a second measurement confirms (a moment of contention on
        # a shared machine once slowed both sides alike, 547 against 529 us, and switched the kernels off).
        again = measure_against_dense(lib)
        kernel_us, dense_us = min(kernel_us, again[0]), min(dense_us, again[1])
    verdict = {
        "use": dense_us >= kernel_us * min_speedup,
        "kernel_us": kernel_us,
        "dense_us": dense_us,
        "min_speedup": min_speedup,
        "threads": 1,
    }
    log.info("CPU kernels: block matmul %.0f us against dense fp32 %.0f us", kernel_us, dense_us)
    native.keep_verdict(path, verdict)
    return verdict


def measure_against_dense(
    lib: ctypes.CDLL, k: int = 576, n: int = 1536, dense_bytes: int = 96 << 20, repeats: int = 4
) -> tuple[float, float]:
    """(kernel, dense) microseconds of one decode-shaped matmul, 1 x k by n x k, as a decode step meets it:
    cycling through enough weight matrices (`dense_bytes` of fp32) that they stream from memory rather than
    sit in the CPU's cache, as a model's weights do. Each call is timed on its own and the fastest counts, so
    a process preempted mid-run (a busy shared machine) does not decide the verdict; both run on one thread,
    since a call on two waits for whichever thread the machine delays (the kernels' per-byte speed is what is
    compared, and it holds at every thread count). Q4_1 is the slower of the block kinds and the one the
    default model mostly uses."""
    generator = torch.Generator().manual_seed(0)
    count = max(1, dense_bytes // (n * k * 4))
    blocks = _random_q4_1(n, k, count, generator)
    dense = [torch.rand(n, k, generator=generator) for _ in range(count)]
    x = torch.rand(1, k, generator=generator)
    best_kernel = best_dense = float("inf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            for (qs, scale, minimum), weight in zip(blocks, dense, strict=True):
                started = time.perf_counter()
                block_matmul(lib, "q4_1", x, qs, scale, minimum)
                best_kernel = min(best_kernel, time.perf_counter() - started)
                started = time.perf_counter()
                torch.matmul(x, weight.T)
                best_dense = min(best_dense, time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return best_kernel * 1e6, best_dense * 1e6


def _random_q4_1(
    n: int, k: int, count: int, generator: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`count` random Q4_1 matrices of n x k as block_matmul takes them: (qs, scale, minimum)."""
    return [
        (
            torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=generator),
            torch.rand(n, k // 32, generator=generator),
            torch.rand(n, k // 32, generator=generator),
        )
        for _ in range(count)
    ]


def measure_tunings(
    libs: dict[str, ctypes.CDLL], k: int = 576, n: int = 1536, count: int = 16, repeats: int = 3
) -> dict[str, float]:
    """Per tuning, microseconds of decode-shaped Q4_1 block matmuls (TUNING_ROWS x k by n x k: the fastest
    call of each size, summed), on one thread, the libraries taking turns over the same `count` matrices so
    a machine's drift meets them alike."""
    generator = torch.Generator().manual_seed(0)
    blocks = _random_q4_1(n, k, count, generator)
    inputs = [torch.rand(rows, k, generator=generator) for rows in TUNING_ROWS]
    best = {(tuning, i): float("inf") for tuning in libs for i in range(len(inputs))}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):
            for tuning, lib in libs.items():
                for i, x in enumerate(inputs):
                    for qs, scale, minimum in blocks:
                        started = time.perf_counter()
                        block_matmul(lib, "q4_1", x, qs, scale, minimum)
                        best[tuning, i] = min(best[tuning, i], time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return {tuning: round(sum(best[tuning, i] for i in range(len(inputs))) * 1e6, 1) for tuning in libs}


def block_matmul(
    lib: ctypes.CDLL,
    kind: str,
    x: torch.Tensor,
    qs: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor | None,
) -> torch.Tensor:
    """x [m, k] fp32 @ W^T for W [n, k] in blocks: "q4_1" (qs [n, k/32, 16] uint8, scale and minimum
    [n, k/32]), "q8_0" (qs [n, k/32, 32] int8, scale [n, k/32], no minimum) or "q6_k" (qs [n, k/32, 32]
    int8, scale [n, k/16], no minimum)."""
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
    _check_step("paged_decode_attention", status)
    return out


def decode_layer(
    lib: ctypes.CDLL,
    weights: DecodeLayerWeightsC,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """One decoder layer's step for x [m, dim] fp32, one new token per sequence (cos, sin [m, head_dim]),
    its K/V rows written to the fp32 caches at `slots` [m] -> the layer's output [m, dim]."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode_layer needs contiguous K/V cache layers")
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    slots, tables, lens = (t.to(torch.int64).contiguous() for t in (slots, block_tables, context_lens))
    out = torch.empty_like(x)
    status = lib.decode_layer(
        ctypes.byref(weights),
        x.data_ptr(),
        x.shape[0],
        out.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[0],
        k_cache.shape[1],
        slots.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        torch.get_num_threads(),
    )
    _check_step("decode_layer", status)
    return out


def _check_step(name: str, status: int) -> None:
    """Raises for a decode kernel's failure status: -1 for tables that lie outside the cache (nothing
    written), any other non-zero for scratch memory it could not get."""
    if status == -1:
        raise ValueError(f"{name}: slots, block tables or context lengths lie outside the cache")
    if status != 0:
        raise MemoryError(f"{name}: no memory for its scratch buffers")


def decode_model(
    lib: ctypes.CDLL,
    weights: DecodeModelWeightsC,
    vocab: int,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """A whole model's decode step after the embedding for x [m, dim] fp32, one new token per sequence (cos,
    sin [m, head_dim]): every layer, its K/V rows written to the fp32 cache [layers, 2, blocks, block_size,
    kv_heads, head_dim] at `slots` [m], the final norm and the logits projection (`vocab` rows) -> logits
    [m, vocab]."""
    if not kv_cache.is_contiguous():
        raise ValueError("decode_model needs a contiguous K/V cache")
    x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
    slots, tables, lens = (t.to(torch.int64).contiguous() for t in (slots, block_tables, context_lens))
    logits = torch.empty(x.shape[0], vocab, dtype=torch.float32)
    status = lib.decode_model(
        ctypes.byref(weights),
        x.data_ptr(),
        x.shape[0],
        logits.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        kv_cache.data_ptr(),
        kv_cache.shape[2],
        kv_cache.shape[3],
        slots.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        lens.data_ptr(),
        torch.get_num_threads(),
    )
    _check_step("decode_model", status)
    return logits
