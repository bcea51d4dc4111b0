"""Attention for a decode-only step: every request brings exactly one query.

Most serving steps are decode-only, and on CPU their attention is a few microseconds of
arithmetic buried under per-op overhead, paid once per layer. The general path
(attention.py) pads queries, gathers K and V separately, and hands SDPA a boolean mask
that SDPA turns into a float one on every call. Here everything that does not depend on
the layer is built once per step (DecodeOnly), and each layer does one gather of K and V
together, a view, and one SDPA call:

* the context is cut to the longest request's length, so a lone request (batch 1, and
  any step whose requests have equal contexts) needs no mask at all;
* otherwise the mask is additive (0 or -inf) in the query dtype, made once per step.

The result equals the general path's: the same kernel over the same keys, the columns
past a request's context masked (or absent) in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from workers.model.attention import GatherWorkspace


@dataclass(frozen=True)
class DecodeOnly:
    """What every layer's decode attention needs, built once per step for B requests.

    block_tables: [B * num_blocks] int64, request b's first num_blocks blocks at
        [b * num_blocks, (b + 1) * num_blocks) (padding: block 0, masked).
    num_blocks: blocks covering the longest context.
    context_len: L, the longest context (its query included).
    mask: [B, 1, 1, L] bool, True where request b may attend to position j; None when
        every request's context is L (nothing to hide).
    """

    block_tables: torch.Tensor
    num_blocks: int
    context_len: int
    mask: torch.Tensor | None
    # The mask as SDPA wants it (additive, in the query dtype), made by the first layer.
    _additive: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """[B, 1, 1, L] of 0 (visible) and -inf, or None; computed once per dtype per step."""
        if self.mask is None:
            return None
        return cached_additive_mask(self.mask, dtype, self._additive)


def cached_additive_mask(mask: torch.Tensor, dtype: torch.dtype, cache: dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
    """A bool mask (True: may attend) as SDPA uses it, 0 or -inf in dtype; made once per
    dtype and kept in `cache` (a step's, so every layer reuses it)."""
    additive = cache.get(dtype)
    if additive is None:
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        additive.masked_fill_(mask.logical_not(), float("-inf"))
        cache[dtype] = additive
    return additive


def build_decode_only(
    starts: Sequence[int], tables: Sequence[Sequence[int]], block_size: int, device: torch.device | str
) -> DecodeOnly:
    """Request b decodes the token at position starts[b] with its blocks tables[b]; its
    context is positions [0, starts[b]] (the new token's K/V is written before attention).

        request 0: start 5, blocks (7, 2)   ->  table row  7 2      context 6
        request 1: start 1, blocks (9,)     ->  table row  9 0      context 2 (block 0: padding)
                                                L = 6, mask row 1 hides positions 2..5
    """
    contexts = [start + 1 for start in starts]
    context_len = max(contexts)
    num_blocks = -(-context_len // block_size)
    flat: list[int] = []
    for table in tables:
        row = list(table[:num_blocks])
        flat.extend(row + [0] * (num_blocks - len(row)))
    mask = None
    if min(contexts) != context_len:
        lengths = torch.tensor(contexts, dtype=torch.int64, device=device)  # [B]
        positions = torch.arange(context_len, dtype=torch.int64, device=device)  # [L]
        mask = (positions[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, L]
    return DecodeOnly(
        block_tables=torch.tensor(flat, dtype=torch.int64, device=device),
        num_blocks=num_blocks,
        context_len=context_len,
        mask=mask,
    )


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    decode: DecodeOnly,
    workspace: GatherWorkspace | None,
    scale: float,
) -> torch.Tensor:
    """One query per request over its cached context (this step's K/V already written).

    q: [B, H, D] (any strides with a unit last one); kv_cache: one layer's
    [2, KVH, num_blocks, block_size, D]. Returns [B, H, D].
    """
    num_requests, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    tables = decode.block_tables
    shape = (2, num_kv_heads, int(tables.shape[0]), block_size, head_dim)
    if workspace is None:
        gathered = torch.index_select(kv_cache, 2, tables)  # [2, KVH, B * nb, bs, D]
    else:
        gathered = torch.index_select(kv_cache, 2, tables, out=workspace.take("kv", shape, q.dtype, q.device))
    padded = decode.num_blocks * block_size
    kv = gathered.view(2, num_kv_heads, num_requests, padded, head_dim)  # [2, KVH, B, nb * bs, D]
    if decode.context_len < padded:
        kv = kv.narrow(3, 0, decode.context_len)  # [2, KVH, B, L, D]
    keys, values = kv.transpose(1, 2).unbind(0)  # [B, KVH, L, D] each, views: SDPA reads the strides
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, D]
        keys,
        values,
        attn_mask=decode.additive_mask(q.dtype),
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [B, H, 1, D]
    return out.squeeze(2)  # [B, H, D]
