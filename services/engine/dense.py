"""Which library runs the engine's fp32 dense matmuls (a prompt's projections in prefill) on this CPU.

PyTorch's CPU matmul is MKL's sgemm, and MKL runs its AVX2 code on AMD CPUs even where they have AVX-512:
on an AMD EPYC with AVX-512 it reached 95-100 GFLOP/s a core against 205-220 for oneDNN's matmul, which
torch ships too and which picks its code by the CPU's instruction sets (a 2,048-token prefill on one thread:
7.1-7.5 s against 4.8-5.4 s). Neither wins everywhere, so the engine takes whichever is faster here: when it
first loads a model for fp32 on the CPU, both are timed on a prefill-shaped product, and the verdict is kept
in the kernel cache under a key of torch's version and the CPU's flags, so every process on the machine
makes the same choice. oneDNN builds code for each new shape it meets (1-4 ms, once per prompt length and
projection shape in a process), well under what it saves on any prompt long enough to take this path.

PCPSTACK_DENSE_MATMUL: unset (default) picks the faster; `torch` always PyTorch's own; `onednn` always
oneDNN's (a ConfigError when the engine loads where this torch has none). Both compute in fp32 and give the
same values up to summation order (a 2,048-token prompt's logits within 6e-5 of each other, same token).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import torch

from pcpstack.common import native
from pcpstack.common.config import DENSE_MATMUL_CHOICES, DENSE_MATMUL_ENV, ConfigError, env_choice

log = logging.getLogger(__name__)

# oneDNN must beat torch's own matmul by this much to be chosen: a verdict that flips with every moment of
# contention on a shared machine would make one machine's processes disagree for nothing.
MIN_SPEEDUP = 1.1
# The product timed: a 512-token chunk through a SmolLM2-sized up projection.
_ROWS, _IN, _OUT = 512, 576, 1536


def setting() -> str:
    """PCPSTACK_DENSE_MATMUL: "", "torch" or "onednn"; a ConfigError naming it and its values otherwise."""
    return env_choice(DENSE_MATMUL_ENV, DENSE_MATMUL_CHOICES)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T on oneDNN (fp32 CPU tensors; a weight that is not contiguous is far slower)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@functools.cache
def onednn_available() -> bool:
    """Whether this torch has oneDNN's fp32 matmul and it runs here."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        out = onednn_linear(torch.ones(2, 3), torch.ones(4, 3))
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.equal(out, torch.full((2, 4), 3.0)))


@functools.cache
def use_onednn() -> bool:
    """The engine's choice (PCPSTACK_DENSE_MATMUL, else the verdict for this machine)."""
    chosen = setting()
    if chosen == "onednn" and not onednn_available():
        raise ConfigError.broken(DENSE_MATMUL_ENV, chosen, "needs oneDNN, which this torch build lacks")
    if chosen:
        return chosen == "onednn"
    if not onednn_available():
        return False
    verdict = _verdict()
    if verdict["use_onednn"]:
        log.info(
            "dense fp32 matmuls run on oneDNN: %.0f GFLOP/s against torch's %.0f on one thread here",
            verdict["onednn_gflops"],
            verdict["torch_gflops"],
        )
    return verdict["use_onednn"]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T, by the chosen library for fp32 on the CPU, by torch's for anything else."""
    if x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu" and use_onednn():
        return onednn_linear(x.contiguous(), weight.contiguous())
    return torch.nn.functional.linear(x, weight)


def _verdict_path() -> Path:
    parts = (torch.__version__, native.cpu_flags())
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return native.cache_dir() / f"dense-matmul-{key}.json"


def _verdict() -> dict:
    """Whether oneDNN beats torch's own matmul here: read from the cache, else measured once and written
    there (atomically: processes starting together may both measure; either answer stands)."""
    path = _verdict_path()
    kept = native.kept_verdict(path, MIN_SPEEDUP)
    if kept is not None:
        return kept
    torch_s, onednn_s, agree = measure()
    verdict = {
        "use_onednn": agree and torch_s >= onednn_s * MIN_SPEEDUP,
        "torch_gflops": 2 * _ROWS * _IN * _OUT / torch_s / 1e9,
        "onednn_gflops": 2 * _ROWS * _IN * _OUT / onednn_s / 1e9,
        "agree": agree,
        "min_speedup": MIN_SPEEDUP,
        "threads": 1,
    }
    if not agree:
        log.warning("oneDNN's matmul disagrees with torch's here: dense matmuls stay on torch's")
    native.keep_verdict(path, verdict)
    return verdict


def measure(repeats: int = 5) -> tuple[float, float, bool]:
    """(torch, oneDNN) seconds of one prefill-shaped matmul on one thread, each the fastest of `repeats`
    rounds (a preempted round does not decide), and whether their results agree to fp32 rounding."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_ROWS, _IN, generator=generator)
    weights = [torch.randn(_OUT, _IN, generator=generator) for _ in range(4)]
    best = {"torch": float("inf"), "onednn": float("inf")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        agree = torch.allclose(
            onednn_linear(x, weights[0]), torch.nn.functional.linear(x, weights[0]), rtol=1e-4, atol=1e-3
        )
        for _ in range(repeats):
            for name, matmul in (("torch", torch.nn.functional.linear), ("onednn", onednn_linear)):
                started = time.perf_counter()
                for weight in weights:
                    matmul(x, weight)
                best[name] = min(best[name], (time.perf_counter() - started) / len(weights))
    finally:
        torch.set_num_threads(threads)
    return best["torch"], best["onednn"], agree
