"""Decode-only steps replayed from CUDA graphs, one graph per (batch, context) bucket.

On a GPU a small decode step is bound by launches: every layer's norms, projections,
rotary, cache write and attention are separate kernels, each issued from Python. A CUDA
graph records one step's kernels once and replays them with one launch. A graph fixes
every shape and address, so a step runs in the graph of the smallest bucket that holds
it, over static buffers that the step's inputs are copied into:

    batch buckets     1 2 4 8 16 32 ... max_num_seqs      (requests, padded up)
    context buckets   1 2 4 8 ... max blocks per request  (blocks of the longest context)

    static buffer     rows 0..B-1: the step's requests     rows B..Bp-1: padding
    input_ids         their last tokens                    0
    positions         their positions                      0
    slots             where their new K/V goes             the pad slot
    context_lens      positions + 1                        1
    block_tables      their blocks, padded with block 0    block 0

Padding rows write their K/V into the pad slot, a block the runner keeps out of the
allocator's pool, and read block 0 under a one-position mask: they never touch another
request's cache, and their outputs are dropped. Attention is the SDPA decode path of
decode_attention.py over the padded context, with the per-request mask built inside the
graph from context_lens.

`capture` does the device-specific part: `CudaCapture` records a torch.cuda.CUDAGraph
(one memory pool shared by every graph, captured largest first at start-up); on CPU,
where graphs do not exist, `replay_capture` re-runs the same function on the same static
buffers, which is how the suite checks everything here except the recording itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from workers.model.attention import AttentionBatch
from workers.model.decode_attention import DecodeOnly

# fn -> (replay, output): replay() recomputes output in place from the static buffers.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def buckets(limit: int) -> tuple[int, ...]:
    """Powers of two below `limit`, then `limit` itself: 1, 2, 4, ..., limit."""
    if limit < 1:
        raise ValueError(f"a bucket limit must be >= 1, got {limit}")
    sizes = []
    size = 1
    while size < limit:
        sizes.append(size)
        size *= 2
    sizes.append(limit)
    return tuple(sizes)


def bucket_of(value: int, sizes: Sequence[int]) -> int | None:
    """The smallest size >= value, or None when value is past the last."""
    for size in sizes:
        if size >= value:
            return size
    return None


def replay_capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """Graphs without a device that records them: each replay runs fn again and copies its
    result into the output the capture returned (the caller cannot tell the difference)."""
    output = fn()

    def replay() -> None:
        output.copy_(fn())

    return replay, output


class CudaCapture:
    """Records CUDA graphs into one memory pool (graphs replay one at a time, so they can
    share their intermediates' memory; capturing the largest first lets the rest fit in
    what it took)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: Any = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()  # warm-up outside the graph: torch.compile, cuBLAS workspaces, the allocator
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay, output


class DecodeGraphs:
    """One graph per (batch bucket, context bucket) of a decode-only step: the model's
    forward and its logits. Sampling stays outside (it is per request, in Python).

    model: the runner's LlamaModel; kv_caches: its per-layer cache views, whose pool has
    a spare block past the allocator's that holds `pad_slot`; max_batch: max_num_seqs;
    max_blocks: blocks of the longest context a graph covers (a step past it runs eagerly).
    """

    def __init__(
        self,
        model: Any,
        kv_caches: Sequence[torch.Tensor],
        block_size: int,
        max_batch: int,
        max_blocks: int,
        pad_slot: int,
        device: torch.device,
        capture: Capture = replay_capture,
    ) -> None:
        self.model = model
        self.kv_caches = list(kv_caches)
        self.block_size = block_size
        self.batch_sizes = buckets(max_batch)
        self.block_counts = buckets(max_blocks)
        self.pad_slot = pad_slot
        self.device = device
        self._capture = capture
        # [4, max_batch]: input_ids, positions, slots, context_lens, the padding values in place.
        self._rows = torch.tensor([[0], [0], [pad_slot], [1]], dtype=torch.int64, device=device).repeat(1, max_batch)
        self._tables = torch.zeros((max_batch, max_blocks), dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor]] = {}

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def key(self, num_requests: int, num_blocks: int) -> tuple[int, int] | None:
        """The bucket a step of num_requests requests, the longest over num_blocks blocks,
        replays in; None when it is past the largest (it then runs eagerly)."""
        batch = bucket_of(num_requests, self.batch_sizes)
        blocks = bucket_of(num_blocks, self.block_counts)
        return None if batch is None or blocks is None else (batch, blocks)

    def capture_all(self, log: Callable[[str], None] | None = None) -> None:
        """Record every bucket's graph now (at start-up), the largest first."""
        keys = sorted(((b, n) for b in self.batch_sizes for n in self.block_counts), reverse=True)
        for index, key in enumerate(keys):
            self._graph(key)
            if log is not None and (index + 1) % 16 == 0:
                log(f"captured {index + 1}/{len(keys)} decode graphs")

    def run(self, starts: Sequence[int], token_ids: Sequence[int], tables: Sequence[Sequence[int]],
            key: tuple[int, int]) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step: request b decodes token_ids[b] at
        position starts[b] with blocks tables[b]; `key` from key()."""
        batch, blocks = key
        num_requests = len(starts)
        rows = [[0] * batch, [0] * batch, [self.pad_slot] * batch, [1] * batch]
        table_rows = [[0] * blocks for _ in range(batch)]
        block_size = self.block_size
        for b, (start, token, table) in enumerate(zip(starts, token_ids, tables)):
            rows[0][b] = token
            rows[1][b] = start
            rows[2][b] = table[start // block_size] * block_size + start % block_size
            rows[3][b] = start + 1
            used = -(-(start + 1) // block_size)
            table_rows[b][:used] = table[:used]
        self._rows[:, :batch].copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)
        self._tables[:batch, :blocks].copy_(torch.tensor(table_rows, dtype=torch.int64), non_blocking=True)
        replay, logits = self._graph(key)
        replay()
        return logits[:num_requests]

    def _graph(self, key: tuple[int, int]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(self._step_fn(*key))
            self._graphs[key] = graph
        return graph

    def _step_fn(self, batch: int, blocks: int) -> Callable[[], torch.Tensor]:
        input_ids, positions, slots, context_lens = self._rows[:, :batch].unbind(0)  # [batch] each
        tables = self._tables[:batch, :blocks]  # [batch, blocks]
        context_len = blocks * self.block_size
        model, kv_caches = self.model, self.kv_caches

        def step() -> torch.Tensor:
            visible = torch.arange(context_len, dtype=torch.int64, device=self.device)[None, :] < context_lens[:, None]
            decode = DecodeOnly(block_tables=tables.reshape(-1), num_blocks=blocks, context_len=context_len,
                                mask=visible[:, None, None, :])  # [batch, 1, 1, L]
            attention = AttentionBatch(slot_mapping=slots, groups=(), decode=decode)
            hidden = model(input_ids, positions, attention, kv_caches, native_decode=False)  # [batch, hidden]
            logits: torch.Tensor = model.compute_logits(hidden)  # [batch, vocab] float32
            return logits

        return step
