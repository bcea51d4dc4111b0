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

from workers.config import LINEAR_BACKENDS
from workers.model.native_linear import NativeLinear, blocked, native_linear, native_linear_problem

LinearBackend = Literal["native", "onednn", "aten"]

# oneDNN picks the blocked layout for a batch size; 16 rows served 1 to 64 best when measured.
_PACK_BATCH_HINT = 16
# Up to this many rows a call goes to the native kernel (when the backend is "native"): it
# streams the weights once per call, which wins while the work is memory-bound. Measured
# side by side over SmolLM2's projections (2 threads): 28 against 39 ms at 1 row, 57
# against 59 at 16, 168 against 144 at 64 (oneDNN's blocked GEMM wins once compute-bound).
NATIVE_MAX_ROWS = 16


def select_linear_backend(device: torch.device, dtype: torch.dtype, requested: str = "auto") -> LinearBackend:
    """"auto": for float32 on CPU, oneDNN when torch has it, with the native kernel for
    decode-sized calls when it builds here (native_linear.py); else aten. "native" or
    "onednn" where it cannot run is an error naming --linear-backend, never a silent
    fall back."""
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
    if problem is None and requested in ("auto", "native"):
        problem = native_linear_problem()
        if problem is None:
            return "native"
        if requested == "native":
            raise ValueError(f"--linear-backend native: {problem}")
        problem = None  # auto: oneDNN alone
    if problem is None:
        return "onednn"
    if requested in ("onednn", "native"):
        raise ValueError(f"--linear-backend {requested}: {problem}")
    return "aten"


class PackedLinear:
    """x @ W.T (+ bias) by oneDNN with W reordered once: x [T, in] -> [T, out]; calls of
    at most NATIVE_MAX_ROWS rows go to the native kernel when one is given.

    weight_t is the model's input-major [in, out] fused matrix; the packed copy is made
    from it and shares nothing with it. With the native kernel the blocked [out, in] copy
    it reads (native_linear.blocked) is kept too: one more weight's worth of memory, a
    tied head's included."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None, native: bool = False) -> None:
        if weight_t.device.type != "cpu" or weight_t.dtype != torch.float32:
            raise ValueError(f"PackedLinear needs a float32 CPU weight, got {weight_t.dtype} on {weight_t.device}")
        self.in_features, self.out_features = weight_t.shape
        dense = weight_t.t().contiguous()  # [out, in], the layout oneDNN reorders from
        self.packed = torch.ops.mkldnn._reorder_linear_weight(dense, _PACK_BATCH_HINT)  # opaque, [out, in]
        self.bias = None if bias is None else bias.detach().contiguous()  # [out]
        self.native: NativeLinear | None = native_linear() if native else None
        self.blocked: torch.Tensor | None = blocked(dense) if native else None  # [out, in], blocked

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.shape[0] <= NATIVE_MAX_ROWS:
            assert self.blocked is not None
            return self.native.linear(x, self.blocked, self.bias)  # [T, out]
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out  # [T, out]

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x @ W.T (+ bias) + residual in one call (oneDNN: a post-op on the float32
        accumulator; native: added to the accumulator; so the same numbers as the separate
        add): x [T, in], residual [T, out]."""
        if self.native is not None and x.shape[0] <= NATIVE_MAX_ROWS:
            assert self.blocked is not None
            return self.native.linear(x, self.blocked, self.bias, residual)  # [T, out]
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
        return out  # [T, out]

    @property
    def num_bytes(self) -> int:
        return self.in_features * self.out_features * 4
