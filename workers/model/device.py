"""Device and dtype choice, and how much memory the KV cache may take.

The sizing is plain arithmetic on numbers passed in, so it is tested on CPU; only
cuda_memory_info() talks to the GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def select_device(name: str = "auto") -> torch.device:
    """The torch device for "auto", "cpu", "cuda" or "cuda:N".

    "auto" is CUDA when available, else CPU. Asking for CUDA on a machine without it is
    an error rather than a silent fall back to a CPU that would be ~100x slower.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} was requested but CUDA is not available")
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r} does not exist ({torch.cuda.device_count()} CUDA devices)"
            )
        return device
    raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")


def resolve_dtype(device: torch.device, name: str = "auto") -> torch.dtype:
    """The activation and weight dtype for `device`.

    "auto" is float32 on CPU (half precision matmuls are slow there) and bfloat16 on
    CUDA when the GPU supports it, else float16. An explicit name is always honoured,
    half precision on CPU included.
    """
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {name!r}")
    return dtype


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`."""
    return int(dtype.itemsize)


def kv_budget_from_device_memory(
    free_bytes: int,
    total_bytes: int,
    utilization: float,
    weight_bytes: int,
    activation_bytes: int,
) -> int:
    """Bytes the KV cache may use on one device, never negative.

    free_bytes and total_bytes are measured before this worker loads anything, so
    total - free is memory other processes hold. The worker may use `utilization` of
    the device in all; weights and peak activations come out of that first:

        |<------------------ total ------------------>|
        |<-- utilization * total -->|                  |
        | others | weights | activ. | KV budget |      |
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    for field, value in (("free_bytes", free_bytes), ("total_bytes", total_bytes),
                         ("weight_bytes", weight_bytes), ("activation_bytes", activation_bytes)):
        if value < 0:
            raise ValueError(f"{field} must be >= 0, got {value!r}")
    if free_bytes > total_bytes:
        raise ValueError(f"free_bytes ({free_bytes}) must not exceed total_bytes ({total_bytes})")
    used_by_others = total_bytes - free_bytes
    budget = int(utilization * total_bytes) - used_by_others - weight_bytes - activation_bytes
    return max(0, budget)


class DeviceMemory(NamedTuple):
    """What torch.cuda.mem_get_info reports for one device."""

    free_bytes: int
    total_bytes: int


def cuda_memory_info(device: torch.device) -> DeviceMemory:
    """Free and total bytes of a CUDA device (as seen by the driver, all processes)."""
    if device.type != "cuda":
        raise ValueError(f"cuda_memory_info needs a CUDA device, got {device}")
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(free_bytes=int(free), total_bytes=int(total))
