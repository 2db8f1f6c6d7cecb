"""The one place that decides which device and dtype the engine runs on, and which device each local rank
process of a set uses."""

import importlib.util
import os

import torch

from pcpstack.common.config import DEVICE_KINDS


def pick_device() -> torch.device:
    """An Ascend NPU when `torch_npu` is installed, else CUDA when available, else the CPU."""
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)

        return torch.device("npu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


# The variable that narrows each accelerator kind to the devices this process may use.
_VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def accelerator_count(kind: str) -> int:
    """Devices of `kind` this process sees (after CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES)."""
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kind == "npu" and importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        return torch.npu.device_count()  # type: ignore[attr-defined]
    return 0


def device_for_rank(local_rank: int, kind: str | None = None) -> torch.device:
    """The device of the `local_rank`-th rank process on this host: `npu:i` / `cuda:i`, or the CPU.

    `kind` is cpu, cuda or npu (default: what `pick_device` finds). Index i counts the visible devices only,
    so CUDA_VISIBLE_DEVICES=4,5 puts local rank 1 on physical GPU 5; a rank beyond them is refused, naming
    the numbers, rather than stacked on device 0.
    """
    kind = kind or pick_device().type
    if kind not in DEVICE_KINDS:
        raise ValueError(f"device={kind!r} is not one of {DEVICE_KINDS}")
    if kind == "cpu":
        return torch.device("cpu")
    count = accelerator_count(kind)
    if local_rank >= count:
        raise ValueError(
            f"local rank {local_rank} needs {kind} device {local_rank}, but this process sees {count} "
            f"{kind} device(s) ({_VISIBLE_DEVICES[kind]}={os.environ.get(_VISIBLE_DEVICES[kind], 'unset')})"
        )
    return torch.device(kind, local_rank)


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on the CPU (exact comparisons against references), bf16 on accelerators."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's short stable name ("float32", "bfloat16"), as used in KV fingerprints."""
    return str(dtype).removeprefix("torch.")
