"""Which attention kernel runs a step's decodes: FlashInfer where it can, SDPA everywhere.

The SDPA path (attention.py) gathers each request's blocks into a padded tensor and is
the reference. On CUDA with `flashinfer` importable, decodes (one query per request,
the bulk of serving) instead go to FlashInfer's paged decode kernel, which reads the
blocks in place. Prefill chunks always take the SDPA path.

Nothing here imports flashinfer at module import time, so CPU machines and GPUs
without it never notice it exists.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple, Protocol

import torch

from workers.model.attention import AttentionBatch, paged_attention
from workers.model.config import ModelConfig

# FlashInfer's recommended split-k workspace.
_WORKSPACE_BYTES = 128 * 2**20


class BackendChoice(NamedTuple):
    """The decode attention backend and why it was picked (printed at start-up)."""

    name: str  # "sdpa" or "flashinfer"
    reason: str


def _import_flashinfer() -> ModuleType | None:
    try:
        return importlib.import_module("flashinfer")
    except Exception:  # noqa: BLE001 - a broken install (wrong CUDA, missing .so) is "not installed"
        return None


def select_attention_backend(device: torch.device, requested: str = "auto") -> BackendChoice:
    """"auto": FlashInfer on CUDA when importable, else SDPA. "flashinfer" where it cannot
    run is an error naming --attention-backend, never a silent fall back."""
    if requested == "sdpa":
        return BackendChoice("sdpa", "requested")
    if requested not in ("auto", "flashinfer"):
        raise ValueError(f"--attention-backend must be auto, sdpa or flashinfer, got {requested!r}")
    if device.type != "cuda":
        if requested == "flashinfer":
            raise ValueError(f"--attention-backend flashinfer needs a CUDA device, got {device}")
        return BackendChoice("sdpa", f"{device.type} device")
    if _import_flashinfer() is None:
        if requested == "flashinfer":
            raise ValueError("--attention-backend flashinfer: the flashinfer package is not importable")
        return BackendChoice("sdpa", "flashinfer is not installed")
    return BackendChoice("flashinfer", "CUDA and flashinfer importable")


class PlannedDecodeKernel(Protocol):
    """A DecodeKernel (attention.py) that is told each step's decodes before it runs."""

    def plan(self, context_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> None: ...

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor: ...


class FlashInferDecode:
    """FlashInfer's batch decode over the runner's paged pool, planned once per step.

    The pool keeps each layer as [2, num_kv_heads, num_blocks, block_size, head_dim];
    K (or V) transposed to [num_blocks, num_kv_heads, block_size, head_dim] is
    FlashInfer's "HND" layout as a strided view, so nothing is copied.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, scale: float) -> None:
        flashinfer = _import_flashinfer()
        if flashinfer is None:
            raise ValueError("FlashInferDecode needs the flashinfer package")
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper: Any = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, kv_layout="HND", use_tensor_cores=num_heads // num_kv_heads >= 4
        )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device, self.scale = block_size, dtype, device, scale

    def plan(self, context_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> None:
        """Describe this step's decodes: request b attends to positions [0, context_lens[b]).

            indptr        0 |  2  |  5      request b's blocks are indices[indptr[b]:indptr[b+1]]
            indices       7 2 | 9 4 1
            last_page_len  3  |  1          tokens used in each request's last block
        """
        indptr, indices, last = [0], [], []
        for length, table in zip(context_lens, block_tables):
            num_blocks = -(-length // self.block_size)
            indices.extend(table[:num_blocks])
            indptr.append(len(indices))
            last.append(length - (num_blocks - 1) * self.block_size)
        as_int32 = lambda values: torch.tensor(values, dtype=torch.int32, device=self.device)  # noqa: E731
        self._wrapper.plan(
            as_int32(indptr), as_int32(indices), as_int32(last),
            self.num_heads, self.num_kv_heads, self.head_dim, self.block_size,
            q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
        )

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """q: [B, num_heads, head_dim] (one query per request, in plan order);
        kv_cache: one layer's [2, num_kv_heads, num_blocks, block_size, head_dim].
        Returns [B, num_heads, head_dim]."""
        keys = kv_cache[0].transpose(0, 1)  # [num_blocks, KVH, block_size, D], a view
        values = kv_cache[1].transpose(0, 1)
        out: torch.Tensor = self._wrapper.run(q.contiguous(), (keys, values))
        return out



class DecodeKernelChoice(NamedTuple):
    """The kernel the runner will plan each step (None: SDPA) and the name it goes by."""

    kernel: PlannedDecodeKernel | None
    name: str


def make_decode_kernel(name: str, config: ModelConfig, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> DecodeKernelChoice:
    """Build the named backend's decode kernel and check it against SDPA before trusting
    it; a kernel that fails to build or disagrees falls back to SDPA, loudly."""
    if name == "sdpa":
        return DecodeKernelChoice(None, "sdpa")
    try:
        kernel = FlashInferDecode(config.num_heads, config.num_kv_heads, config.head_dim, block_size,
                                  dtype, device, config.head_dim ** -0.5)
        problem = check_decode_kernel(kernel, config, block_size, dtype, device)
    except Exception as error:  # noqa: BLE001 - any failure of an optional kernel means: use SDPA
        problem = f"{type(error).__name__}: {error}"
    if problem is not None:
        print(f"[kvserve] {name} decode attention is off, using SDPA: {problem}", file=sys.stderr)
        return DecodeKernelChoice(None, "sdpa")
    return DecodeKernelChoice(kernel, name)


def check_decode_kernel(kernel: PlannedDecodeKernel, config: ModelConfig, block_size: int,
                        dtype: torch.dtype, device: torch.device) -> str | None:
    """Run `kernel` and the SDPA path on one random batch of three decodes (contexts of
    1 token, a block and a bit, three blocks, in shuffled blocks); None when they agree."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)

    cache = rand(2, kv_heads, 8, block_size, head_dim)  # [2, KVH, 8 blocks, block_size, D]
    tables = ((5,), (2, 7), (0, 6, 3))
    contexts = (1, block_size + 3, 3 * block_size)
    q, k, v = rand(3, heads, head_dim), rand(3, kv_heads, head_dim), rand(3, kv_heads, head_dim)
    sequences = [(length - 1, 1, table) for length, table in zip(contexts, tables)]
    scale = head_dim ** -0.5
    reference = paged_attention(q, k, v, cache.clone(), AttentionBatch.build(sequences, block_size, device), scale)
    kernel.plan(contexts, tables)
    fused_batch = AttentionBatch.build(sequences, block_size, device, decode_kernel=kernel)
    fused = paged_attention(q, k, v, cache.clone(), fused_batch, scale)  # [3, H, D]
    error = (fused.float() - reference.float()).abs().max().item()
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    if not error <= tolerance:
        return f"max difference from SDPA {error:.3g} > {tolerance:g} on a check batch"
    return None
