"""CPU matmuls through oneDNN on weights reordered once at start-up.

Why not torch's default: on this torch build a CPU matmul goes to MKL, and on the AMD
EPYC (Zen 5) this project benchmarks on, MKL runs the decode shapes far from the memory
floor: one 576-wide row against SmolLM2's 513 MiB of weights read at ~15 GB/s, and 16
rows ran ~10x slower than oneDNN on the same weights (the profile is in
docs/benchmarks/bench_decode/README.md). oneDNN picks its kernels by instruction set,
and a weight reordered into its blocked layout is read near bandwidth at batch 1 and
compute-efficiently at batch 64, by one packed copy for every batch size.

The packed copy is extra memory (one more copy of each projection); the checkpoint-named
parameters stay as they are, so state dicts, loaders and the eager path see no change.
"""

from __future__ import annotations

from typing import Literal

import torch

LinearBackend = Literal["onednn", "aten"]
from workers.config import LINEAR_BACKENDS

# oneDNN picks the blocked layout for a batch size; 16 rows served 1 to 64 best when measured.
_PACK_BATCH_HINT = 16


def select_linear_backend(device: torch.device, dtype: torch.dtype, requested: str = "auto") -> LinearBackend:
    """"auto": oneDNN for float32 on CPU when torch has it, else aten. "onednn" where it
    cannot run is an error naming --linear-backend, never a silent fall back."""
    if requested not in LINEAR_BACKENDS:
        raise ValueError(f"--linear-backend must be one of {', '.join(LINEAR_BACKENDS)}, got {requested!r}")
    if requested == "aten":
        return "aten"
    problem = None
    if device.type != "cpu":
        problem = f"it runs on CPU only, the model is on {device}"
    elif dtype != torch.float32:
        problem = f"it packs float32 weights only, the model is {dtype}"
    elif not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        problem = "this torch build has no oneDNN (mkldnn)"
    if problem is None:
        return "onednn"
    if requested == "onednn":
        raise ValueError(f"--linear-backend onednn: {problem}")
    return "aten"


class PackedLinear:
    """x @ W.T (+ bias) by oneDNN with W reordered once: x [T, in] -> [T, out].

    weight_t is the model's input-major [in, out] fused matrix; the packed copy is made
    from it and shares nothing with it."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight_t.device.type != "cpu" or weight_t.dtype != torch.float32:
            raise ValueError(f"PackedLinear needs a float32 CPU weight, got {weight_t.dtype} on {weight_t.device}")
        self.in_features, self.out_features = weight_t.shape
        dense = weight_t.t().contiguous()  # [out, in], the layout oneDNN reorders from
        self.packed = torch.ops.mkldnn._reorder_linear_weight(dense, _PACK_BATCH_HINT)  # opaque, [out, in]
        self.bias = None if bias is None else bias.detach().contiguous()  # [out]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out  # [T, out]

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x @ W.T (+ bias) + residual in one oneDNN call (a post-op on the float32
        accumulator, so the same numbers as the separate add): x [T, in], residual [T, out]."""
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
        return out  # [T, out]

    @property
    def num_bytes(self) -> int:
        return self.in_features * self.out_features * 4
