"""Scheduler configuration: frozen, validated, never written back to at run time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine step.

    block_size: tokens per KV block.
    max_num_seqs: most requests running (holding KV) at once.
    max_num_batched_tokens: token budget of one step, prefill and decode together.
    max_model_len: the longest sequence (prompt plus output) a request may reach.
    enable_prefix_caching: reuse the KV of full blocks an earlier request computed for the
        same tokens (workers/engine/prefix_cache.py). False schedules exactly as an engine
        without a prefix cache; a runner that keeps no paged KV cache needs False.
    """

    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"SchedulerConfig.enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens tokens of KV."""
    return -(-num_tokens // block_size)
