"""Attention over a paged KV cache, and the index tensors that describe one step.

A step runs B requests at once. Request b brings num_tokens_b new tokens at positions
start_b .. start_b + num_tokens_b - 1 (a whole prompt, a chunk of one, or a single
decode token) and a block table whose blocks hold its KV for positions
[0, start_b + num_tokens_b). The new tokens of all requests are flattened, in request
order, into T = sum(num_tokens_b) rows; the model runs every projection on those rows
and only attention needs to know which rows belong together.

Attention itself is plain torch: write the new K/V into their slots, gather each
request's context into a padded [B, max_ctx] view, pad queries into [B, max_q], and
run scaled_dot_product_attention under a boolean mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionBatch:
    """Index tensors for one step over B requests with T new tokens in total.

    slot_mapping: [T] int64, the KV cache slot each new token's K/V is written to.
    query_index: [B, max_q] int64, the row in [0, T) holding query q of request b
        (padding points at row 0; its output is thrown away).
    token_index: [T] int64, for each row its index into the flattened [B * max_q]
        padded layout, used to un-pad attention outputs.
    kv_slots: [B, max_ctx] int64, the slot of context position j of request b
        (padding points at slot 0 and is masked out).
    mask: [B, 1, max_q, max_ctx] bool, True where query q of request b may attend
        to position j.
    """

    slot_mapping: torch.Tensor
    query_index: torch.Tensor
    token_index: torch.Tensor
    kv_slots: torch.Tensor
    mask: torch.Tensor

    def __post_init__(self) -> None:
        num_tokens = self.slot_mapping.shape[0]
        num_requests, max_q = self.query_index.shape
        if self.token_index.shape != (num_tokens,):
            raise ValueError(
                f"AttentionBatch.token_index must have shape ({num_tokens},), "
                f"got {tuple(self.token_index.shape)}"
            )
        if self.kv_slots.shape[0] != num_requests:
            raise ValueError(
                f"AttentionBatch.kv_slots must have {num_requests} rows, got {tuple(self.kv_slots.shape)}"
            )
        expected_mask = (num_requests, 1, max_q, self.kv_slots.shape[1])
        if tuple(self.mask.shape) != expected_mask or self.mask.dtype != torch.bool:
            raise ValueError(
                f"AttentionBatch.mask must be bool of shape {expected_mask}, "
                f"got {self.mask.dtype} {tuple(self.mask.shape)}"
            )

    @property
    def num_tokens(self) -> int:
        """T, the number of new tokens (rows) in the step."""
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        sequences: Sequence[tuple[int, int, Sequence[int]]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionBatch:
        """Index tensors for requests given as (start_position, num_tokens, block_table).

        Python touches each request once; every per-token and per-position quantity
        is a tensor op, so the cost does not grow with Python loops over long contexts.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not sequences:
            raise ValueError("sequences must hold at least one request, got none")
        starts: list[int] = []
        counts: list[int] = []
        for b, (start, count, table) in enumerate(sequences):
            if start < 0 or count < 1:
                raise ValueError(
                    f"sequences[{b}] needs start_position >= 0 and num_tokens >= 1, got ({start}, {count})"
                )
            needed = -(-(start + count) // block_size)
            if len(table) < needed:
                raise ValueError(
                    f"sequences[{b}] block_table has {len(table)} blocks, positions up to "
                    f"{start + count - 1} need {needed}"
                )
            starts.append(start)
            counts.append(count)

        num_requests = len(sequences)
        max_q = max(counts)
        max_ctx = max(s + n for s, n in zip(starts, counts))
        max_blocks = -(-max_ctx // block_size)
        padded_tables = [list(table[:max_blocks]) + [0] * (max_blocks - min(len(table), max_blocks))
                         for _, _, table in sequences]

        # Per-token indices are small ([T]) and built on CPU; the [B, max_q, max_ctx]
        # tensors are built on the target device from per-request values, so the big
        # mask is never copied host to device.
        count_cpu = torch.tensor(counts, dtype=torch.int64)  # [B]
        start_cpu = torch.tensor(starts, dtype=torch.int64)  # [B]
        first_row = torch.cumsum(count_cpu, 0) - count_cpu  # [B] row of each request's first token
        row_request = torch.repeat_interleave(torch.arange(num_requests), count_cpu)  # [T]
        row_offset = torch.arange(row_request.shape[0]) - first_row[row_request]  # [T] q within request
        row_position = start_cpu[row_request] + row_offset  # [T]
        # Padded layout: query q of request b lives at b * max_q + q.
        token_index = row_request * max_q + row_offset  # [T]
        block_tables_cpu = torch.tensor(padded_tables, dtype=torch.int64)  # [B, max_blocks]

        # Slots, with block_table = (7, 2, 9) and block_size = 4:
        #
        #   position  0 1 2 3 | 4 5 6 7 | 8 9
        #   block         7   |    2    |  9
        #   slot     28 ... 31| 8 ... 11|36 37
        #
        #   slot = block_table[pos // block_size] * block_size + pos % block_size
        slot_mapping = (block_tables_cpu[row_request, row_position // block_size] * block_size
                        + row_position % block_size)  # [T]

        block_tables = block_tables_cpu.to(device)  # [B, max_blocks]
        start_t = start_cpu.to(device)  # [B]
        count_t = count_cpu.to(device)  # [B]
        ctx_positions = torch.arange(max_ctx, dtype=torch.int64, device=device)  # [max_ctx]
        kv_slots = (block_tables[:, ctx_positions // block_size] * block_size
                    + ctx_positions % block_size)  # [B, max_ctx]
        in_context = ctx_positions[None, :] < (start_t + count_t)[:, None]  # [B, max_ctx]
        kv_slots = torch.where(in_context, kv_slots, 0)  # [B, max_ctx]
        q_offsets = torch.arange(max_q, dtype=torch.int64, device=device)  # [max_q]
        q_valid = q_offsets[None, :] < count_t[:, None]  # [B, max_q]
        query_index = torch.where(
            q_valid, first_row.to(device)[:, None] + q_offsets[None, :], 0
        )  # [B, max_q]

        # Causal within the request: query q sits at start_b + q and sees j <= that,
        # which also keeps it inside the context. A padded query row gets limit 0, so
        # it sees position 0 alone and its softmax stays finite.
        last_visible = torch.where(q_valid, start_t[:, None] + q_offsets[None, :], 0)  # [B, max_q]
        mask = (ctx_positions[None, None, :] <= last_visible[:, :, None])[:, None]  # [B, 1, max_q, max_ctx]

        return cls(
            slot_mapping=slot_mapping.to(device),
            query_index=query_index,
            token_index=token_index.to(device),
            kv_slots=kv_slots,
            mask=mask,
        )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend over each request's context.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim];
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], written in place.
    Returns [T, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_requests, max_q = batch.query_index.shape
    flat_cache = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, num_kv_heads, head_dim]
    flat_cache[0].index_copy_(0, batch.slot_mapping, k)
    flat_cache[1].index_copy_(0, batch.slot_mapping, v)

    keys = flat_cache[0][batch.kv_slots]  # [B, max_ctx, num_kv_heads, head_dim]
    values = flat_cache[1][batch.kv_slots]  # [B, max_ctx, num_kv_heads, head_dim]
    if num_heads != num_kv_heads:
        # Explicit repeat rather than enable_gqa: every SDPA backend accepts it with a mask.
        group = num_heads // num_kv_heads
        keys = keys.repeat_interleave(group, dim=2)  # [B, max_ctx, num_heads, head_dim]
        values = values.repeat_interleave(group, dim=2)  # [B, max_ctx, num_heads, head_dim]
    queries = q[batch.query_index]  # [B, max_q, num_heads, head_dim]

    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=batch.mask, scale=scale,
    )  # [B, num_heads, max_q, head_dim]
    out = out.transpose(1, 2).reshape(num_requests * max_q, num_heads, head_dim)  # [B * max_q, H, D]
    return out[batch.token_index]  # [T, num_heads, head_dim]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention over one sequence, no cache.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]. Returns [T, num_heads, head_dim].
    """
    num_heads = q.shape[1]
    num_kv_heads = k.shape[1]
    if num_heads != num_kv_heads:
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1)  # [T, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)  # [T, num_heads, head_dim]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale,
    )  # [num_heads, T, head_dim]
    return out.transpose(0, 1)  # [T, num_heads, head_dim]
