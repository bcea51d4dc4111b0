"""Model runners: execute a StepPlan on the model and sample. They know nothing of scheduling.

ModelRunner owns the paged KV pool. NaiveRunner is the cache-less baseline: it keeps
only each request's token ids and recomputes the whole sequence at every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from workers.engine.plan import SampledToken, ScheduledChunk, StepPlan
from workers.model.attention import AttentionBatch, GatherWorkspace
from workers.model.backends import make_decode_kernel
from workers.model.config import ModelConfig
from workers.model.device import dtype_bytes
from workers.model.llama import LlamaModel
from workers.model.sampler import sample_next_tokens
from workers.model.step_graphs import Capture, CudaCapture, DecodeGraphs, replay_capture


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers: block_size x 2 x layers x kv_heads x head_dim x dtype."""
    return block_size * config.kv_bytes_per_token(dtype_bytes(dtype))


class StepGraphLimits(NamedTuple):
    """The largest decode-only step a runner's graphs cover."""

    max_batch: int  # max_num_seqs
    max_context: int  # tokens; a longer step runs eagerly


class ModelRunner:
    """Runs the model over a plan with a paged KV cache carved from one preallocated pool."""

    def __init__(self, model: LlamaModel, config: ModelConfig, num_blocks: int, block_size: int,
                 attention_backend: str = "sdpa", step_graphs: StepGraphLimits | None = None) -> None:
        """attention_backend: a name select_attention_backend() chose; a fused kernel that
        fails its start-up check leaves the runner on SDPA (see self.attention_backend).
        step_graphs: decode-only steps replay from graphs (step_graphs.py) up to these
        limits; on CUDA they are recorded at once (capture_graphs), elsewhere replayed
        eagerly (what the tests check)."""
        self.model = model
        self.config = config
        self.block_size = block_size
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        # One tensor for the whole pool; layer i's cache is a view of it. With step graphs
        # one more block past the allocator's: the padding rows' K/V go there.
        # [num_layers, 2, num_kv_heads, num_blocks (+1), block_size, head_dim]
        pool_blocks = num_blocks + (step_graphs is not None)
        self.kv_pool = torch.zeros(
            (config.num_layers, *model.kv_cache_shape(pool_blocks, block_size)), dtype=self.dtype, device=self.device
        )
        self.workspace = GatherWorkspace()
        self.kv_caches = list(self.kv_pool.unbind(0))
        choice = make_decode_kernel(attention_backend, config, block_size, self.dtype, self.device)
        self.decode_kernel, self.attention_backend = choice.kernel, choice.name
        self.graphs: DecodeGraphs | None = None
        if step_graphs is not None and self.decode_kernel is None:
            capture: Capture = CudaCapture(self.device) if self.device.type == "cuda" else replay_capture
            self.graphs = DecodeGraphs(model, self.kv_caches, block_size, step_graphs.max_batch,
                                       -(-step_graphs.max_context // block_size), num_blocks * block_size,
                                       self.device, capture)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> dict[str, SampledToken]:
        if not plan.chunks:
            return {}
        chunks = plan.chunks
        if self.graphs is not None and all(c.num_tokens == 1 for c in chunks):
            key = self.graphs.key(len(chunks), -(-max(c.context_len for c in chunks) // self.block_size))
            if key is not None:
                logits = self.graphs.run([c.start_position for c in chunks], [c.token_ids[0] for c in chunks],
                                         [c.block_table for c in chunks], key)  # [B, vocab]
                return self._sample_rows(logits, [(row, c) for row, c in enumerate(chunks) if c.sample])
        flat_ids = [t for c in chunks for t in c.token_ids]
        flat_positions = [p for c in chunks for p in range(c.start_position, c.context_len)]
        input_ids = torch.tensor(flat_ids, dtype=torch.int64, device=self.device)  # [num_tokens]
        positions = torch.tensor(flat_positions, dtype=torch.int64, device=self.device)  # [num_tokens]
        kernel = self.decode_kernel
        decodes = [c for c in chunks if c.num_tokens == 1]
        if kernel is not None and decodes:
            kernel.plan([c.context_len for c in decodes], [c.block_table for c in decodes])
        batch = AttentionBatch.build(
            [(c.start_position, c.num_tokens, c.block_table) for c in chunks], self.block_size, self.device,
            self.workspace, kernel if decodes else None,
        )
        hidden = self.model(input_ids, positions, batch, self.kv_caches)  # [num_tokens, hidden_size]
        return self._sample(hidden, chunks)

    def _sample(self, hidden: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> dict[str, SampledToken]:
        sample_chunks: list[ScheduledChunk] = []
        last_rows: list[int] = []
        end = 0
        for c in chunks:
            end += c.num_tokens
            if c.sample:
                sample_chunks.append(c)
                last_rows.append(end - 1)
        if not sample_chunks:
            return {}
        if len(last_rows) == hidden.shape[0]:  # every row samples (a decode-only step): no gather
            logits = self.model.compute_logits(hidden)  # [num_tokens, vocab_size] float32
        else:
            rows = torch.tensor(last_rows, dtype=torch.int64, device=hidden.device)
            logits = self.model.compute_logits(hidden[rows])  # [num_sampled, vocab_size] float32
        return _pick(logits, sample_chunks)

    def _sample_rows(self, logits: torch.Tensor, rows: Sequence[tuple[int, ScheduledChunk]]) -> dict[str, SampledToken]:
        """Sample the chunks that sample from their rows of a step's logits [B, vocab]."""
        if not rows:
            return {}
        if len(rows) < logits.shape[0]:
            logits = logits[torch.tensor([row for row, _ in rows], dtype=torch.int64, device=logits.device)]
        return _pick(logits, [c for _, c in rows])

    @torch.inference_mode()
    def capture_graphs(self, log: Callable[[str], None] | None = None) -> int:
        """Record every step graph now (start-up, on CUDA); returns how many."""
        if self.graphs is None:
            return 0
        self.graphs.capture_all(log)
        return self.graphs.num_graphs


def _pick(logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> dict[str, SampledToken]:
    """Each chunk's token from its row of logits [len(chunks), vocab], by request id."""
    tokens = sample_next_tokens(logits, chunks)
    return {c.request_id: t for c, t in zip(chunks, tokens)}


class NaiveRunner:
    """The cache-less baseline: every sampled step recomputes the request's whole sequence."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self._token_ids: dict[str, list[int]] = {}

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> dict[str, SampledToken]:
        for request_id in plan.finished_ids:
            self._token_ids.pop(request_id, None)
        results: dict[str, SampledToken] = {}
        for c in plan.chunks:
            history = self._token_ids.setdefault(c.request_id, [])
            if c.start_position == 0:
                history.clear()
            history.extend(c.token_ids)
            assert len(history) == c.context_len, "the naive runner lost track of a request's tokens"
            if not c.sample:
                continue
            input_ids = torch.tensor(history, dtype=torch.int64, device=self.device)  # [seq_len]
            positions = torch.arange(len(history), dtype=torch.int64, device=self.device)  # [seq_len]
            hidden = self.model(input_ids, positions)  # [seq_len, hidden_size], no cache
            logits = self.model.compute_logits(hidden[-1:])  # [1, vocab_size]
            results[c.request_id] = sample_next_tokens(logits, [c])[0]
        return results
