"""How big the KV pool may be on a GPU: measure once, then plain arithmetic.

Like vLLM: load the weights, run one step as large as the scheduler can ever plan
(max_num_batched_tokens new tokens, max_num_seqs sampled rows), and give the KV pool
what is left of `gpu_memory_utilization` of the device once everything else is
counted. The arithmetic (kv_budget_from_profile) is a pure function of the measured
numbers, tested on CPU; only profile_cuda_memory() talks to CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from workers.model.attention import AttentionBatch
from workers.model.llama import LlamaModel


@dataclass(frozen=True)
class MemoryProfile:
    """What one device looked like after the weights loaded and the profiling step ran.

    total_bytes: the device's memory.
    used_bytes: in use on the device after the step, as the driver sees it: every
        process, the CUDA context, cuBLAS workspaces, and this process's torch cache.
    torch_reserved_bytes: of used_bytes, what this process's torch allocator holds.
    weight_bytes: torch-allocated after loading, before the step (weights, buffers).
    peak_torch_bytes: torch's peak allocation over the step, weights included.
    profiled_tokens: the step's size, for the start-up line.
    """

    total_bytes: int
    used_bytes: int
    torch_reserved_bytes: int
    weight_bytes: int
    peak_torch_bytes: int
    profiled_tokens: int

    def __post_init__(self) -> None:
        for name in ("total_bytes", "used_bytes", "torch_reserved_bytes", "weight_bytes",
                     "peak_torch_bytes", "profiled_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"MemoryProfile.{name} must be >= 0, got {getattr(self, name)}")
        if self.used_bytes > self.total_bytes:
            raise ValueError(
                f"MemoryProfile.used_bytes ({self.used_bytes}) must not exceed total_bytes ({self.total_bytes})"
            )
        if self.weight_bytes > self.peak_torch_bytes:
            raise ValueError(
                f"MemoryProfile.peak_torch_bytes ({self.peak_torch_bytes}) must be at least "
                f"weight_bytes ({self.weight_bytes})"
            )


class KVBudget(NamedTuple):
    """The KV pool's share of one device, and every term it was computed from."""

    kv_bytes: int
    allowed_bytes: int  # utilization x total
    non_torch_bytes: int  # other processes, CUDA context, cuBLAS: used - torch reserved
    weight_bytes: int
    activation_bytes: int  # peak of the profiled step above the weights


def kv_budget_from_profile(profile: MemoryProfile, utilization: float) -> KVBudget:
    """Bytes the KV pool may take, never negative.

        |<--------------------------- total ---------------------------->|
        |<------------- utilization x total ------------->|              |
        | non-torch | weights | peak activations | KV pool |  headroom    |

    non-torch is what the driver reports in use minus what torch holds, so it counts
    other processes on the same GPU and this process's CUDA context; torch's share is
    counted at its peak (weights + the profiled step), not at what happens to be cached.
    """
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization!r}")
    allowed = int(utilization * profile.total_bytes)
    non_torch = max(0, profile.used_bytes - profile.torch_reserved_bytes)
    activation = profile.peak_torch_bytes - profile.weight_bytes
    kv = max(0, allowed - non_torch - profile.peak_torch_bytes)
    return KVBudget(
        kv_bytes=kv,
        allowed_bytes=allowed,
        non_torch_bytes=non_torch,
        weight_bytes=profile.weight_bytes,
        activation_bytes=activation,
    )


def describe_budget(budget: KVBudget, profile: MemoryProfile, utilization: float) -> str:
    """The start-up line: the KV pool's size and where the rest of the device went."""
    gib = 2**30
    return (
        f"[kvserve] GPU memory: {utilization:g} x {profile.total_bytes / gib:.2f} GiB = "
        f"{budget.allowed_bytes / gib:.2f} GiB; - {budget.non_torch_bytes / gib:.2f} GiB not torch "
        f"(CUDA context, other processes) - {budget.weight_bytes / gib:.2f} GiB weights - "
        f"{budget.activation_bytes / gib:.2f} GiB peak activations (profiled step of "
        f"{profile.profiled_tokens} tokens) = {budget.kv_bytes / gib:.2f} GiB for the KV pool"
    )


@torch.inference_mode()
def run_profiling_step(model: LlamaModel, num_tokens: int, num_sampled: int, block_size: int) -> None:
    """One forward as large as the scheduler can plan: a num_tokens prefill chunk through
    the paged path (into a throwaway cache just big enough), then logits for num_sampled
    rows. Runs on any device; on CUDA its peak allocation is what the KV pool must leave."""
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    num_blocks = -(-num_tokens // block_size)
    caches = [
        torch.zeros(model.kv_cache_shape(num_blocks, block_size), dtype=dtype, device=device)
        for _ in range(model.config.num_layers)
    ]  # num_layers x [2, num_kv_heads, num_blocks, block_size, head_dim]
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)  # [num_tokens]
    positions = torch.arange(num_tokens, dtype=torch.int64, device=device)  # [num_tokens]
    batch = AttentionBatch.build([(0, num_tokens, tuple(range(num_blocks)))], block_size, device)
    hidden = model(input_ids, positions, batch, caches)  # [num_tokens, hidden]
    rows = min(num_sampled, num_tokens)
    model.compute_logits(hidden[-rows:])  # [rows, vocab_size] float32


def profile_cuda_memory(model: LlamaModel, num_tokens: int, num_sampled: int, block_size: int) -> MemoryProfile:
    """Measure a CUDA device around one profiling step (the thin wrapper over torch.cuda)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"profile_cuda_memory needs a model on a CUDA device, got {device}")
    torch.cuda.synchronize(device)
    weight_bytes = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_profiling_step(model, num_tokens, num_sampled, block_size)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()  # what the step cached is free for the KV pool
    free, total = torch.cuda.mem_get_info(device)
    return MemoryProfile(
        total_bytes=int(total),
        used_bytes=int(total - free),
        torch_reserved_bytes=int(torch.cuda.memory_reserved(device)),
        weight_bytes=int(weight_bytes),
        peak_torch_bytes=int(max(peak, weight_bytes)),
        profiled_tokens=num_tokens,
    )
