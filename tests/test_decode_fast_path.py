"""The decode-only fast path (workers/model/decode_attention.py) against the general path.

A step where every request brings one query skips the padded groups and the per-layer
mask conversion; these tests hold it to the general path it replaces: the same attention
output for mixed context lengths (a lone request, equal lengths, block boundaries,
shuffled blocks), and on a whole model the same logits and greedy tokens step after step,
with the projections through oneDNN and through torch's matmul. Also the pieces the fast
path leans on: the workspace's reused views and the residual add fused into a projection.
"""

from __future__ import annotations

import random

import pytest
import torch

from workers.model.attention import AttentionBatch, GatherWorkspace, paged_attention
from workers.model.packed_linear import PackedLinear
from workers.model.presets import build_preset

CPU = torch.device("cpu")
BLOCK_SIZE = 4


def _decode_sequences(contexts: list[int], num_blocks: int, seed: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """(start, 1, table) per request: the token at position context - 1, blocks drawn
    without replacement from a shuffled pool."""
    pool = list(range(num_blocks))
    random.Random(seed).shuffle(pool)
    sequences = []
    for length in contexts:
        count = -(-length // BLOCK_SIZE)
        table, pool = tuple(pool[:count]), pool[count:]
        sequences.append((length - 1, 1, table))
    return sequences


@pytest.mark.parametrize("contexts", [[1], [9], [8, 8], [1, 7, 12, 5], [4, 5, 16, 3, 9]])
@pytest.mark.parametrize("use_workspace", [False, True])
def test_decode_attention_equals_general_path(contexts: list[int], use_workspace: bool) -> None:
    generator = torch.Generator().manual_seed(len(contexts))
    num_heads, num_kv_heads, head_dim, num_blocks = 6, 2, 16, 40
    cache = torch.randn(2, num_kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=generator)
    q = torch.randn(len(contexts), num_heads, head_dim, generator=generator)
    k = torch.randn(len(contexts), num_kv_heads, head_dim, generator=generator)
    v = torch.randn(len(contexts), num_kv_heads, head_dim, generator=generator)
    sequences = _decode_sequences(contexts, num_blocks, seed=7)
    workspace = GatherWorkspace() if use_workspace else None

    general = AttentionBatch.build(sequences, BLOCK_SIZE, CPU, workspace, fast_decode=False)
    fast = AttentionBatch.build(sequences, BLOCK_SIZE, CPU, workspace)
    assert general.decode is None and general.groups
    assert fast.decode is not None and not fast.groups
    # No mask at all when every context has the same length (batch 1 included).
    assert (fast.decode.mask is None) == (len(set(contexts)) == 1)
    reference_cache, fast_cache = cache.clone(), cache.clone()
    reference = paged_attention(q, k, v, reference_cache, general, 0.25)  # [B, H, D]
    for _ in range(2):  # the second layer reuses the step's mask and workspace view
        result = paged_attention(q, k, v, fast_cache, fast, 0.25)
        torch.testing.assert_close(result, reference, rtol=1e-6, atol=1e-6)
    assert torch.equal(fast_cache, reference_cache)


def test_fast_path_only_for_decode_only_steps_without_a_kernel() -> None:
    mixed = AttentionBatch.build([(5, 2, (7, 2)), (0, 1, (9,))], BLOCK_SIZE, CPU)
    assert mixed.decode is None and len(mixed.groups) == 2

    class NeverRuns:
        def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
            raise AssertionError("not called")

    with_kernel = AttentionBatch.build([(5, 1, (7, 2))], BLOCK_SIZE, CPU, decode_kernel=NeverRuns())
    assert with_kernel.decode is None and len(with_kernel.groups) == 1
    decode = AttentionBatch.build([(5, 1, (7, 2)), (1, 1, (9,))], BLOCK_SIZE, CPU).decode
    assert decode is not None
    assert decode.block_tables.tolist() == [7, 2, 9, 0]
    assert (decode.num_blocks, decode.context_len) == (2, 6)
    assert decode.mask is not None
    assert decode.mask[:, 0, 0].tolist() == [[True] * 6, [True] * 2 + [False] * 4]


@pytest.mark.parametrize("backend", ["onednn", "aten"])
def test_model_decode_steps_equal_general_path(backend: str) -> None:
    """Requests of mixed lengths decoded together through both paths from equal caches:
    logits within float32 tolerance, greedy tokens equal at every step."""
    model = build_preset("tiny", CPU, torch.float32).model
    if backend == "onednn":
        model.pack_linears()
    config = model.config
    num_blocks = 64
    caches = {path: [torch.zeros(model.kv_cache_shape(num_blocks, BLOCK_SIZE)) for _ in range(config.num_layers)]
              for path in ("fast", "general")}
    rng = random.Random(3)
    prompts = [[rng.randrange(config.vocab_size) for _ in range(n)] for n in (3, 11, 6, 1, 8)]
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = [tuple(pool[i * 8:(i + 1) * 8]) for i in range(len(prompts))]
    workspace = GatherWorkspace()
    with torch.inference_mode():
        # Prefill every prompt in one mixed step (the general path on both sides).
        ids = torch.tensor([t for p in prompts for t in p])
        positions = torch.tensor([i for p in prompts for i in range(len(p))])
        batch = AttentionBatch.build([(0, len(p), t) for p, t in zip(prompts, tables)], BLOCK_SIZE, CPU)
        for path in caches:
            model(ids, positions, batch, caches[path])
        hidden = model(ids, positions, batch, caches["general"])  # rewrites the same K/V
        last = torch.tensor([sum(len(p) for p in prompts[: i + 1]) - 1 for i in range(len(prompts))])
        tokens = model.compute_logits(hidden[last]).argmax(-1)  # [B]
        lengths = [len(p) for p in prompts]
        for _ in range(12):
            sequences = [(n, 1, t) for n, t in zip(lengths, tables)]
            positions = torch.tensor(lengths)
            logits = {}
            for path, fast in (("fast", True), ("general", False)):
                step = AttentionBatch.build(sequences, BLOCK_SIZE, CPU, workspace, fast_decode=fast)
                assert (step.decode is not None) == fast
                logits[path] = model.compute_logits(model(tokens, positions, step, caches[path]))
            torch.testing.assert_close(logits["fast"], logits["general"], rtol=1e-5, atol=1e-5)
            tokens = logits["fast"].argmax(-1)
            assert torch.equal(tokens, logits["general"].argmax(-1))
            lengths = [n + 1 for n in lengths]


def test_workspace_reuses_its_view_until_the_shape_changes() -> None:
    workspace = GatherWorkspace()
    first = workspace.take("kv", (2, 3, 4), torch.float32, CPU)
    assert workspace.take("kv", (2, 3, 4), torch.float32, CPU) is first
    smaller = workspace.take("kv", (2, 3), torch.float32, CPU)
    assert smaller.shape == (2, 3) and smaller.data_ptr() == first.data_ptr()
    larger = workspace.take("kv", (50, 10), torch.float32, CPU)  # grows: a new buffer
    assert larger.shape == (50, 10)
    assert workspace.take("kv", (50, 10), torch.float32, CPU) is larger


def test_packed_linear_add_equals_linear_then_add() -> None:
    generator = torch.Generator().manual_seed(1)
    weight_t = torch.randn(48, 20, generator=generator)  # [in, out]
    for bias in (None, torch.randn(20, generator=generator)):
        packed = PackedLinear(weight_t, bias)
        for rows in (1, 5, 16):
            x = torch.randn(rows, 48, generator=generator)
            residual = torch.randn(rows, 20, generator=generator)
            assert torch.equal(packed.add(x, residual), packed(x) + residual)
