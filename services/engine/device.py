"""The one place that decides which device and dtype the engine runs on."""

import importlib.util

import torch


def pick_device() -> torch.device:
    """An Ascend NPU when `torch_npu` is installed, else CUDA when available, else the CPU."""
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers the "npu" device with torch)

        return torch.device("npu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on the CPU (exact comparisons against references), bf16 on accelerators."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype's short stable name ("float32", "bfloat16"), as used in KV fingerprints."""
    return str(dtype).removeprefix("torch.")
