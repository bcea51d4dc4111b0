"""Model runners: execute a StepPlan on the model and sample. They know nothing of scheduling.

ModelRunner owns the paged KV pool. NaiveRunner is the cache-less baseline: it keeps
only each request's token ids and recomputes the whole sequence at every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.plan import SampledToken, ScheduledChunk, StepPlan
from workers.model.attention import AttentionBatch, GatherWorkspace
from workers.model.backends import make_decode_kernel
from workers.model.config import ModelConfig
from workers.model.device import dtype_bytes
from workers.model.llama import LlamaModel
from workers.model.sampler import sample_next_tokens


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers: block_size x 2 x layers x kv_heads x head_dim x dtype."""
    return block_size * config.kv_bytes_per_token(dtype_bytes(dtype))


class ModelRunner:
    """Runs the model over a plan with a paged KV cache carved from one preallocated pool."""

    def __init__(self, model: LlamaModel, config: ModelConfig, num_blocks: int, block_size: int,
                 attention_backend: str = "sdpa") -> None:
        """attention_backend: a name select_attention_backend() chose; a fused kernel that
        fails its start-up check leaves the runner on SDPA (see self.attention_backend)."""
        self.model = model
        self.config = config
        self.block_size = block_size
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        # One tensor for the whole pool; layer i's cache is a view of it.
        # [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]
        self.kv_pool = torch.zeros(
            (config.num_layers, *model.kv_cache_shape(num_blocks, block_size)), dtype=self.dtype, device=self.device
        )
        self.workspace = GatherWorkspace()
        self.kv_caches = list(self.kv_pool.unbind(0))
        choice = make_decode_kernel(attention_backend, config, block_size, self.dtype, self.device)
        self.decode_kernel, self.attention_backend = choice.kernel, choice.name

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> dict[str, SampledToken]:
        if not plan.chunks:
            return {}
        chunks = plan.chunks
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
        tokens = sample_next_tokens(logits, sample_chunks)
        return {c.request_id: t for c, t in zip(sample_chunks, tokens)}


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
