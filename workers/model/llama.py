"""The Llama-family decoder (Llama, Qwen2, Mistral) with HF-compatible parameter names.

Parameter names equal the keys of a Hugging Face checkpoint, so a safetensors state
dict loads without renaming:

    model.embed_tokens.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias when the config says so)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.layers.{i}.{input,post_attention}_layernorm.weight
    model.norm.weight
    lm_head.weight (absent with tied embeddings: the logits reuse embed_tokens)

The model works on flat token rows, [T, hidden], never [batch, seq, hidden]: requests
of different lengths share a step without padding anywhere but inside attention.
Positions are always passed in; nothing is inferred from row order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.attention import AttentionBatch, causal_attention, paged_attention
from workers.model.config import ModelConfig
from workers.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF does, then cast back."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # [hidden]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)  # [T, hidden]
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # HF multiplies by the weight after the cast back; the order matters in bf16.
        return self.weight * x32.to(x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary positions."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        q_out = config.num_heads * config.head_dim
        kv_out = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_out, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_out, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_out, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_out, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBatch | None,
        kv_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if attention is None or kv_cache is None:
            out = causal_attention(q, k, v, self.scale)  # [T, H, D]
        else:
            out = paged_attention(q, k, v, kv_cache, attention, self.scale)  # [T, H, D]
        result: torch.Tensor = self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
        return result  # [T, hidden]


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = F.silu(self.gate_proj(x)) * self.up_proj(x)  # [T, intermediate]
        result: torch.Tensor = self.down_proj(gated)
        return result  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBatch | None,
        kv_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attention, kv_cache)
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden  # [T, hidden]


class LlamaBackbone(nn.Module):
    """Everything under the checkpoint's `model.` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    """A decoder-only Llama-family model over flat token rows.

    forward() returns final hidden states; compute_logits() turns the rows you need
    (usually one per request) into float32 logits, so a prefill of hundreds of tokens
    does not pay for hundreds of vocabulary-sized rows.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBatch | None = None,
        kv_caches: Sequence[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states of the final norm for every row: [T, hidden].

        input_ids, positions: [T] int64. Without `attention` and `kv_caches` the rows
        are one sequence under plain causal attention and nothing is cached. With both,
        rows are the new tokens of the requests `attention` describes, and kv_caches[i]
        is layer i's [2, num_blocks, block_size, num_kv_heads, head_dim] cache, which
        this call writes the new tokens' K/V into.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [T], got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if (attention is None) != (kv_caches is None):
            raise ValueError("attention and kv_caches must be given together or not at all")
        if kv_caches is not None and len(kv_caches) != self.config.num_layers:
            raise ValueError(f"kv_caches must hold {self.config.num_layers} layers, got {len(kv_caches)}")
        if attention is not None and attention.num_tokens != input_ids.shape[0]:
            raise ValueError(
                f"attention describes {attention.num_tokens} tokens, input_ids has {input_ids.shape[0]}"
            )

        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        # One cos/sin table per step, shared by every layer.
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)  # [T, head_dim] each
        for index, layer in enumerate(self.model.layers):
            kv_cache = None if kv_caches is None else kv_caches[index]
            hidden = layer(hidden, cos, sin, attention, kv_cache)
        result: torch.Tensor = self.model.norm(hidden)
        return result  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the given hidden rows: [N, hidden] -> [N, vocab_size]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).to(torch.float32)  # [N, vocab_size]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's KV cache tensor for this model."""
        return (2, num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)


def build_empty_model(config: ModelConfig) -> LlamaModel:
    """A LlamaModel whose parameters live on the meta device: no memory, no init work.

    nn.Linear's default init costs seconds on a 100M-parameter model and every value
    is overwritten anyway; callers fill it with load_state_dict(assign=True) or
    to_empty() followed by their own init.
    """
    with torch.device("meta"):
        return LlamaModel(config)
