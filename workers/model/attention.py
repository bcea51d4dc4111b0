"""Attention over a paged KV cache, and the index tensors that describe one step.

A step runs B requests at once. Request b brings num_tokens_b new tokens at positions
start_b .. start_b + num_tokens_b - 1 (a whole prompt, a chunk of one, or a single
decode token) and a block table whose blocks hold its KV for positions
[0, start_b + num_tokens_b). The new tokens of all requests are flattened, in request
order, into T = sum(num_tokens_b) rows; the model runs every projection on those rows
and only attention needs to know which rows belong together.

Attention itself is plain torch: write the new K/V into their slots, gather each
request's context into a padded [B, max_ctx] view, pad queries into [B, max_q], and
run scaled_dot_product_attention under an additive mask made once per step. A
decode-only step (one query per request) takes a leaner path: decode_attention.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from workers.model.decode_attention import DecodeOnly, build_decode_only, cached_additive_mask, decode_attention


class GatherWorkspace:
    """Reusable memory for the per-layer K/V gathers of a step.

    On CPU a fresh multi-megabyte tensor per layer costs more in page faults than the
    copy itself, so gathers write into one buffer per K and V that grows to the largest
    step seen and is reused by every layer. Owned by the model runner.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        # The last view handed out per buffer: every layer of a step asks for the same
        # shape, and making the view again would cost two ops per layer.
        self._views: dict[tuple[str, torch.dtype, torch.device], tuple[tuple[int, ...], torch.Tensor]] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        last = self._views.get(key)
        if last is not None and last[0] == shape:
            return last[1]
        numel = 1
        for size in shape:
            numel *= size
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(max(numel, 2 * (0 if buffer is None else buffer.numel())), dtype=dtype, device=device)
            self._buffers[key] = buffer
        view = buffer[:numel].view(shape)
        self._views[key] = (shape, view)
        return view


@dataclass(frozen=True)
class AttentionGroup:
    """Requests attended together, their queries padded to one length.

    A step's decodes (one query each) form one group; every multi-token chunk forms a
    group of its own, so a long prefill never pads the decodes up to its length.

    rows: [T_g] int64, the step rows (in [0, T)) whose outputs this group produces.
    query_index: [B_g, max_q] int64, the step row of query q of request b (padding
        repeats the request's first row; its output is thrown away).
    token_index: [T_g] int64, for rows[i] its index into the padded [B_g * max_q] layout.
    block_tables: [B_g, max_blocks] int64, each request's blocks (padding: block 0, masked).
    mask: [B_g, 1, max_q, max_blocks * block_size] bool, True where query q of request b
        may attend to context position j (the 1 broadcasts over heads).
    identity: the group is every row of the step, in order, unpadded (a decode-only step
        or a lone prefill), so queries and outputs need no gather.
    """

    rows: torch.Tensor
    query_index: torch.Tensor
    token_index: torch.Tensor
    block_tables: torch.Tensor
    mask: torch.Tensor
    identity: bool = False
    # The mask as SDPA uses it (0 or -inf in the query dtype), made by the first layer
    # instead of by SDPA in every layer.
    _additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """mask as [B_g, 1, max_q, L] of 0 (may attend) and -inf; computed once per dtype per step."""
        return cached_additive_mask(self.mask, dtype, self._additive)


class DecodeKernel(Protocol):
    """A fused kernel for the step's decode group, already planned for this step
    (workers/model/backends.py); None in AttentionBatch means the SDPA path."""

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """q: [B_g, H, D], the decode group's queries in order; kv_cache: one layer's
        [2, KVH, num_blocks, block_size, D]. Returns [B_g, H, D]."""
        ...


@dataclass(frozen=True)
class AttentionBatch:
    """Index tensors for one step over B requests with T new tokens in total.

    slot_mapping: [T] int64, the KV cache slot each new token's K/V is written to.
    groups: the requests split into attention groups (see AttentionGroup); empty when
        `decode` is set.
    workspace: reusable gather memory (None: allocate per layer).
    decode_kernel: runs the decode group (one query per request) instead of SDPA.
    decode: set for a decode-only step without a decode kernel: the lean path of
        decode_attention.py replaces the groups.
    """

    slot_mapping: torch.Tensor
    groups: tuple[AttentionGroup, ...]
    workspace: GatherWorkspace | None = None
    decode_kernel: DecodeKernel | None = None
    decode: DecodeOnly | None = None

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
        workspace: GatherWorkspace | None = None,
        decode_kernel: DecodeKernel | None = None,
        fast_decode: bool = True,
    ) -> AttentionBatch:
        """Index tensors for requests given as (start_position, num_tokens, block_table).

        Python touches each request once and each new token once; nothing loops over
        a request's whole context. fast_decode=False keeps a decode-only step on the
        general path (the reference the fast path is tested against).
        """
        if block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not sequences:
            raise ValueError("sequences must hold at least one request, got none")
        first_rows: list[int] = []
        row = 0
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
            first_rows.append(row)
            row += count

        # Slots, with block_table = (7, 2, 9) and block_size = 4:
        #
        #   position  0 1 2 3 | 4 5 6 7 | 8 9
        #   block         7   |    2    |  9
        #   slot     28 ... 31| 8 ... 11|36 37
        #
        #   slot = block_table[pos // block_size] * block_size + pos % block_size
        slots: list[int] = []
        for start, count, table in sequences:
            for position in range(start, start + count):
                slots.append(table[position // block_size] * block_size + position % block_size)
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)  # [T]

        if fast_decode and decode_kernel is None and row == len(sequences):  # every request: one token
            decode = build_decode_only([start for start, _, _ in sequences], [table for _, _, table in sequences],
                                       block_size, device)
            return cls(slot_mapping=slot_mapping, groups=(), workspace=workspace, decode=decode)
        decodes = [b for b, (_, count, _) in enumerate(sequences) if count == 1]
        chunks = [[b] for b, (_, count, _) in enumerate(sequences) if count > 1]
        members = ([decodes] if decodes else []) + chunks
        groups = tuple(_build_group(sequences, first_rows, m, block_size, device, len(members) == 1) for m in members)
        return cls(slot_mapping=slot_mapping, groups=groups, workspace=workspace, decode_kernel=decode_kernel)


def _build_group(
    sequences: Sequence[tuple[int, int, Sequence[int]]],
    first_rows: Sequence[int],
    members: Sequence[int],
    block_size: int,
    device: torch.device | str,
    alone: bool,
) -> AttentionGroup:
    starts = [sequences[b][0] for b in members]
    counts = [sequences[b][1] for b in members]
    max_q = max(counts)
    max_blocks = max(-(-(s + n) // block_size) for s, n in zip(starts, counts))
    tables = [list(sequences[b][2][:max_blocks]) for b in members]
    tables = [t + [0] * (max_blocks - len(t)) for t in tables]
    rows = [first_rows[b] + q for b, n in zip(members, counts) for q in range(n)]
    token_index = [i * max_q + q for i, n in enumerate(counts) for q in range(n)]

    start_t = torch.tensor(starts, dtype=torch.int64, device=device)  # [B_g]
    count_t = torch.tensor(counts, dtype=torch.int64, device=device)  # [B_g]
    first_t = torch.tensor([first_rows[b] for b in members], dtype=torch.int64, device=device)  # [B_g]
    q_offsets = torch.arange(max_q, dtype=torch.int64, device=device)  # [max_q]
    q_valid = q_offsets[None, :] < count_t[:, None]  # [B_g, max_q]
    query_index = first_t[:, None] + torch.where(q_valid, q_offsets[None, :], 0)  # [B_g, max_q]
    # Causal within the request: query q sits at start_b + q and sees j <= that, which
    # also keeps it inside the context. A padded query row repeats the first query.
    last_visible = start_t[:, None] + torch.where(q_valid, q_offsets[None, :], 0)  # [B_g, max_q]
    ctx_positions = torch.arange(max_blocks * block_size, dtype=torch.int64, device=device)  # [L]
    mask = (ctx_positions[None, None, :] <= last_visible[:, :, None])[:, None]  # [B_g, 1, max_q, L]
    return AttentionGroup(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        query_index=query_index,
        token_index=torch.tensor(token_index, dtype=torch.int64, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
        mask=mask,
        identity=alone and (max_q == 1 or len(members) == 1),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend over each request's blocks.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim];
    kv_cache: [2, num_kv_heads, num_blocks, block_size, head_dim], written in place.
    Heads come first in the cache so that gathering a request's blocks yields each KV
    head's context as one contiguous [L, head_dim] matrix, ready for a matmul.
    Returns [T, num_heads, head_dim]. (The model writes K/V straight from its fused
    projection with write_kv and calls attend; this is the same for separate k and v.)
    """
    write_kv(kv_cache, torch.stack((k, v)).transpose(1, 2), batch.slot_mapping)  # [2, KVH, T, D]
    return attend(q, kv_cache, batch, scale)


def write_kv(kv_cache: torch.Tensor, new_kv: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Write new_kv [2, KVH, T, D] (any strides) into the slots slot_mapping [T] names.

    kv_cache: one layer's [2, KVH, num_blocks, block_size, D]. Returns kv_cache."""
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    slots = kv_cache.view(2, num_kv_heads, num_blocks * block_size, head_dim)  # [2, KVH, num_slots, D]
    slots.index_copy_(2, slot_mapping, new_kv)
    return kv_cache


def attend(q: torch.Tensor, kv_cache: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """Attention of q [T, H, D] over each request's cached context (this step's K/V written
    already): the decode-only path when the batch has one, else group by group.
    Returns [T, H, D]."""
    if batch.decode is not None:
        return decode_attention(q, kv_cache, batch.decode, batch.workspace, scale)
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, num_blocks, block_size, _ = kv_cache.shape
    out: torch.Tensor | None = None
    for group in batch.groups:
        num_requests, max_q = group.query_index.shape
        if max_q == 1 and batch.decode_kernel is not None:
            decoded = batch.decode_kernel.run(q if group.identity else q[group.rows], kv_cache)  # [B_g, H, D]
            if group.identity:
                return decoded
            if out is None:
                out = q.new_empty(num_tokens, num_heads, head_dim)  # [T, H, D]
            out.index_copy_(0, group.rows, decoded)
            continue
        num_ctx_blocks = group.block_tables.shape[1]
        context = num_ctx_blocks * block_size
        flat_tables = group.block_tables.view(-1)  # [B_g * max_blocks]
        shape = (num_kv_heads, num_requests * num_ctx_blocks, block_size, head_dim)
        keys = _gather(kv_cache[0], flat_tables, shape, "k", batch.workspace)
        values = _gather(kv_cache[1], flat_tables, shape, "v", batch.workspace)
        queries = q.view(num_requests, max_q, num_heads, head_dim) if group.identity else q[group.query_index]
        result = grouped_attention(
            queries,  # [B_g, max_q, H, D]
            keys.view(num_kv_heads, num_requests, context, head_dim),
            values.view(num_kv_heads, num_requests, context, head_dim),
            group.additive_mask(q.dtype),
            scale,
        )  # [B_g, max_q, H, D]
        flat = result.reshape(num_requests * max_q, num_heads, head_dim)  # [B_g * max_q, H, D]
        if group.identity:
            return flat
        if out is None:
            out = q.new_empty(num_tokens, num_heads, head_dim)  # [T, H, D]
        out.index_copy_(0, group.rows, flat[group.token_index])
    assert out is not None
    return out


def _gather(
    cache: torch.Tensor,
    flat_tables: torch.Tensor,
    shape: tuple[int, int, int, int],
    name: str,
    workspace: GatherWorkspace | None,
) -> torch.Tensor:
    """cache [KVH, num_blocks, block_size, D] -> [KVH, len(flat_tables), block_size, D]."""
    if workspace is None:
        return torch.index_select(cache, 1, flat_tables)
    buffer = workspace.take(name, shape, cache.dtype, cache.device)
    return torch.index_select(cache, 1, flat_tables, out=buffer)


def grouped_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked attention with grouped KV heads: one SDPA call, no K/V repeated per head.

    queries: [B, Q, H, D]; keys, values: [KVH, B, L, D] (as gathered: each KV head's
    context contiguous); mask: [B, 1, Q, L], bool (True where a query may attend) or
    additive (0 or -inf in the query dtype). Query
    head h reads KV head h // (H // KVH), HF's GQA layout. Returns [B, Q, H, D].
    """
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),  # [B, H, Q, D]
        keys.transpose(0, 1),  # [B, KVH, L, D]
        values.transpose(0, 1),  # [B, KVH, L, D]
        attn_mask=mask,
        scale=scale,
        enable_gqa=queries.shape[2] != keys.shape[0],
    )  # [B, H, Q, D]
    return out.transpose(1, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention over one sequence, no cache.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]. Returns [T, num_heads, head_dim].
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )  # [num_heads, T, head_dim]
    return out.transpose(0, 1)  # [T, num_heads, head_dim]
