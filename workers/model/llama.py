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

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.attention import AttentionBatch, attend, causal_attention, write_kv
from workers.model.config import ModelConfig
from workers.model.native_decode import NATIVE_DECODE_MAX_ROWS, LayerWeights, NativeDecoder
from workers.model.native_linear import huge_page_tensor, native_linear
from workers.model.packed_linear import PackedLinear
from workers.model.rope import RotaryEmbedding, apply_rotary_


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as HF does, then cast back."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # [hidden]
        self.eps = eps
        self.kernel: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, hidden] -> [T, hidden]; float32 statistics whatever x's dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused op
    x32 = x.to(torch.float32)  # [T, hidden]
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # HF multiplies by the weight after the cast back; the order matters in bf16.
    return weight * x32.to(x.dtype)


def swiglu(x: torch.Tensor, gate_up_t: torch.Tensor, down_t: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) on fused input-major weights: x [T, hidden] -> [T, hidden]."""
    gate, up = (x @ gate_up_t).chunk(2, dim=-1)  # [T, intermediate] each
    return (F.silu(gate) * up) @ down_t


def _plus(out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """out + residual, in out's memory (out is a fresh projection output)."""
    return out if residual is None else out.add_(residual)


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
        # Set by fuse_projections(): one [q_out + 2 * kv_out, hidden] matmul instead of three.
        # Set by fuse_projections(). Non-persistent buffers: they follow .to() but stay
        # out of the state dict.
        self.qkv_t: torch.Tensor | None
        self.qkv_bias: torch.Tensor | None
        self.o_t: torch.Tensor | None
        self.register_buffer("qkv_t", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)
        self.register_buffer("o_t", None, persistent=False)
        # Set by pack_linears() on CPU: the fused matrices reordered for oneDNN.
        self.qkv_packed: PackedLinear | None = None
        self.o_packed: PackedLinear | None = None

    def fuse_projections(self) -> None:
        """q/k/v as one [hidden, q_out + 2 * kv_out] matrix and o as [q_out, hidden], both
        stored input-major; the checkpoint-named parameters become views of them."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_t = _fuse_transposed(projections)
        self.o_t = _fuse_transposed((self.o_proj,))
        if self.q_proj.bias is not None:
            self.qkv_bias = torch.cat([p.bias for p in projections if p.bias is not None])
            _rebind_rows(projections, "bias", self.qkv_bias)

    def pack_linears(self, native: bool = False) -> None:
        """oneDNN copies of the fused q/k/v and o matrices (fuse_projections() first);
        with native, decode-sized calls go to the native kernel."""
        assert self.qkv_t is not None and self.o_t is not None, "pack_linears needs fuse_projections first"
        self.qkv_packed = PackedLinear(self.qkv_t, self.qkv_bias, native)
        self.o_packed = PackedLinear(self.o_t, self.o_proj.bias, native)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBatch | None,
        kv_cache: torch.Tensor | None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """o_proj(attention(hidden)) (+ residual, added by the projection when it can)."""
        num_tokens = hidden.shape[0]
        num_q = self.num_heads
        num_qk = self.num_heads + self.num_kv_heads
        if self.qkv_packed is not None:
            qkv = self.qkv_packed(hidden)  # [T, (H + 2 * KVH) * D]
        elif self.qkv_t is not None:
            qkv = _matmul(hidden, self.qkv_t, self.qkv_bias)  # [T, (H + 2 * KVH) * D]
        else:
            qkv = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        qkv = qkv.view(num_tokens, num_qk + self.num_kv_heads, self.head_dim)  # [T, H + 2 * KVH, D]
        # q and k rotated together, in place: k and v stay adjacent in qkv, so the cache
        # write reads them from there instead of from a stacked copy.
        apply_rotary_(qkv[:, :num_qk], cos, sin)
        q = qkv[:, :num_q]  # [T, H, D]
        if attention is None or kv_cache is None:
            out = causal_attention(q, qkv[:, num_q:num_qk], qkv[:, num_qk:], self.scale)  # [T, H, D]
        else:
            new_kv = qkv[:, num_q:].view(num_tokens, 2, self.num_kv_heads, self.head_dim)  # [T, 2, KVH, D]
            write_kv(kv_cache, new_kv.permute(1, 2, 0, 3), attention.slot_mapping)  # [2, KVH, T, D]
            out = attend(q, kv_cache, attention, self.scale)  # [T, H, D]
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)  # [T, H * D]
        if self.o_packed is not None:
            if residual is not None:
                return self.o_packed.add(out, residual)  # [T, hidden]
            return self.o_packed(out)  # [T, hidden]
        if self.o_t is not None:
            return _plus(_matmul(out, self.o_t, self.o_proj.bias), residual)  # [T, hidden]
        result: torch.Tensor = self.o_proj(out)
        return _plus(result, residual)  # [T, hidden]


def _matmul(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight_t (+ bias). weight_t is [in, out]: on CPU, x @ W with W input-major reads
    the weights faster than F.linear's x @ W.T (measured ~1.5x at batch 1)."""
    if bias is None:
        return x @ weight_t
    return torch.addmm(bias, x, weight_t)


def _fuse_transposed(modules: Sequence[nn.Linear]) -> torch.Tensor:
    """One contiguous [in, sum(out)] matrix of the modules' weights; each module's weight
    becomes a (transposed) view of its columns, so no memory is doubled."""
    fused = torch.cat([m.weight for m in modules]).t().contiguous()  # [in, sum(out)]
    offset = 0
    for module in modules:
        rows = module.weight.shape[0]
        module.weight = nn.Parameter(fused[:, offset : offset + rows].t(), requires_grad=False)
        offset += rows
    return fused


def _rebind_rows(modules: Sequence[nn.Linear], name: str, fused: torch.Tensor) -> None:
    """Point each module's parameter at its rows of `fused`."""
    offset = 0
    for module in modules:
        rows = getattr(module, name).shape[0]
        setattr(module, name, nn.Parameter(fused[offset : offset + rows], requires_grad=False))
        offset += rows


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_t: torch.Tensor | None
        self.down_t: torch.Tensor | None
        self.register_buffer("gate_up_t", None, persistent=False)  # set by fuse_projections()
        self.register_buffer("down_t", None, persistent=False)
        self.kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = swiglu
        self.gate_up_packed: PackedLinear | None = None  # set by pack_linears()
        self.down_packed: PackedLinear | None = None

    def fuse_projections(self) -> None:
        """gate and up as one input-major [hidden, 2 * intermediate] matrix, down as
        [intermediate, hidden]; the modules' weights become views."""
        self.gate_up_t = _fuse_transposed((self.gate_proj, self.up_proj))
        self.down_t = _fuse_transposed((self.down_proj,))

    def pack_linears(self, native: bool = False) -> None:
        """oneDNN copies of the fused gate/up and down matrices (fuse_projections() first);
        with native, decode-sized calls go to the native kernel."""
        assert self.gate_up_t is not None and self.down_t is not None, "pack_linears needs fuse_projections first"
        self.gate_up_packed = PackedLinear(self.gate_up_t, None, native)
        self.down_packed = PackedLinear(self.down_t, None, native)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)) (+ residual, added by the projection when it can)."""
        if self.gate_up_packed is not None and self.down_packed is not None:
            gate_up = self.gate_up_packed(x)  # [T, 2 * intermediate]
            size = gate_up.shape[1] // 2
            gated = F.silu(gate_up[:, :size]).mul_(gate_up[:, size:])  # [T, intermediate]
            if residual is not None:
                return self.down_packed.add(gated, residual)  # [T, hidden]
            return self.down_packed(gated)  # [T, hidden]
        if self.gate_up_t is not None and self.down_t is not None:
            return _plus(self.kernel(x, self.gate_up_t, self.down_t), residual)  # [T, hidden]
        gated = F.silu(self.gate_proj(x)) * self.up_proj(x)  # [T, intermediate]
        result: torch.Tensor = self.down_proj(gated)
        return _plus(result, residual)  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def native_weights(self) -> LayerWeights:
        """This layer's tensors for the native decode (pack_linears(native=True) first)."""
        attn, mlp = self.self_attn, self.mlp
        qkv, o, gate_up, down = attn.qkv_packed, attn.o_packed, mlp.gate_up_packed, mlp.down_packed
        if qkv is None or o is None or gate_up is None or down is None or qkv.blocked is None or o.blocked is None \
                or gate_up.blocked is None or down.blocked is None:
            raise ValueError("native decode needs pack_linears(native=True) first")
        return LayerWeights(self.input_layernorm.weight, qkv.blocked, qkv.bias, o.blocked, o.bias,
                            self.post_attention_layernorm.weight, gate_up.blocked, down.blocked)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionBatch | None,
        kv_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        # Each residual add rides on the block's last projection (a oneDNN post-op, or an
        # add into the projection's fresh output): no separate op, no new tensor.
        hidden = self.self_attn(self.input_layernorm(hidden), cos, sin, attention, kv_cache, residual=hidden)
        return self.mlp(self.post_attention_layernorm(hidden), residual=hidden)  # [T, hidden]


class LlamaBackbone(nn.Module):
    """Everything under the checkpoint's `model.` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # An initial weight given: Embedding's own init (normal_) has no meta kernel of its
        # own, and on the meta device (build_empty_model) it imported torch._dynamo, 1.4 s
        # of every model load; the weight is always loaded or initialised afterwards.
        weight = torch.empty(config.vocab_size, config.hidden_size)  # [vocab, hidden]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
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
        self.head_t: torch.Tensor | None
        self.register_buffer("head_t", None, persistent=False)  # set by fuse_projections()
        self.head_packed: PackedLinear | None = None  # set by pack_linears()
        # Set by pack_linears(native=True): decode-only steps in one native call (native_decode.py).
        self.native_decoder: NativeDecoder | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBatch | None = None,
        kv_caches: Sequence[torch.Tensor] | None = None,
        native_decode: bool = True,
    ) -> torch.Tensor:
        """Hidden states of the final norm for every row: [T, hidden].

        input_ids, positions: [T] int64. Without `attention` and `kv_caches` the rows
        are one sequence under plain causal attention and nothing is cached. With both,
        rows are the new tokens of the requests `attention` describes, and kv_caches[i]
        is layer i's [2, num_kv_heads, num_blocks, block_size, head_dim] cache, which
        this call writes the new tokens' K/V into. native_decode=False keeps a decode-only
        step off the native decoder (the layers below run it, as in a recorded step graph).
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
        if (native_decode and self.native_decoder is not None and attention is not None and attention.decode is not None
                and kv_caches is not None and hidden.shape[0] <= NATIVE_DECODE_MAX_ROWS):
            return self.native_decoder.forward(hidden, positions, attention.slot_mapping, attention.decode, kv_caches)
        # One cos/sin table per step, shared by every layer.
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)  # [T, 1, head_dim] each
        for index, layer in enumerate(self.model.layers):
            kv_cache = None if kv_caches is None else kv_caches[index]
            hidden = layer(hidden, cos, sin, attention, kv_cache)
        result: torch.Tensor = self.model.norm(hidden)
        return result  # [T, hidden]

    def fuse_projections(self) -> None:
        """Fewer, larger, input-major matmuls (q/k/v as one, gate/up as one). Call once the
        weights are loaded and on their device; parameter names and the state dict are
        unchanged (the parameters become views of the fused matrices)."""
        for layer in self.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        if self.lm_head is not None:
            # Tied heads stay as F.linear on the embedding: a transposed copy would double it.
            self.head_t = _fuse_transposed((self.lm_head,))

    def pack_linears(self, native: bool = False) -> None:
        """Every projection and the output head through oneDNN on reordered copies of the
        weights (packed_linear.py; float32 on CPU), and with native, calls of a few rows
        through the native kernel (native_linear.py) on copies in its blocked layout. Call
        after fuse_projections(); the parameters and the state dict are unchanged, the
        copies cost one more weight's worth of memory each (a tied head's too: the
        embedding stays row-major for its lookups). With native the RMSNorms run natively
        too, and decode-only steps of up to NATIVE_DECODE_MAX_ROWS requests run every layer
        in one native call (native_decode.py)."""
        for layer in self.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn.pack_linears(native)
            layer.mlp.pack_linears(native)
        head_t = self.head_t if self.head_t is not None else self.model.embed_tokens.weight.t()  # [hidden, vocab]
        self.head_packed = PackedLinear(head_t, None, native)
        if native:
            kernel = native_linear()
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.kernel = kernel.rms_norm
            self._blocked_onto_huge_pages()
            layers = [layer.native_weights() for layer in self.model.layers]  # type: ignore[operator]
            self.native_decoder = NativeDecoder(self.config, self.rotary.inv_freq(torch.device("cpu")), layers,
                                                self.model.norm.weight)

    def _blocked_onto_huge_pages(self) -> None:
        """Move the native kernel's blocked weight copies into one tensor on 2 MiB pages
        (huge_page_tensor says why), each 64-byte aligned."""
        packs: list[PackedLinear] = []
        for layer in self.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            packs += [p for p in (attn.qkv_packed, attn.o_packed, mlp.gate_up_packed, mlp.down_packed) if p is not None]
        assert self.head_packed is not None
        packs.append(self.head_packed)
        copies = [p.blocked for p in packs if p.blocked is not None]
        assert len(copies) == len(packs), "_blocked_onto_huge_pages needs pack_linears(native=True)"
        sizes = [-(-c.numel() // 16) * 16 for c in copies]  # 64-byte multiples
        arena = huge_page_tensor(sum(sizes))
        offset = 0
        for pack, copy, size in zip(packs, copies, sizes):
            moved = arena[offset: offset + copy.numel()].view(copy.shape)
            moved.copy_(copy)
            pack.blocked = moved
            offset += size

    @property
    def packed(self) -> bool:
        """Whether pack_linears() has run: the projections go through oneDNN."""
        return self.head_packed is not None

    @property
    def native_linear(self) -> bool:
        """Whether decode-sized projections go through the native kernel."""
        return self.head_packed is not None and self.head_packed.native is not None

    def compile_dense(self, backend: str = "inductor") -> None:
        """torch.compile the element-wise work between the matmuls (RMSNorm, SiLU x up)
        into fused kernels. One compiled function serves every layer (weights are its
        arguments) and dynamic=True keeps one graph for every step size, so steps never
        recompile. Attention stays eager: its shapes change every step."""
        norm = torch.compile(rms_norm, dynamic=True, backend=backend)
        mlp = torch.compile(swiglu, dynamic=True, backend=backend)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = norm
            elif isinstance(module, LlamaMLP):
                module.kernel = mlp

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the given hidden rows: [N, hidden] -> [N, vocab_size]."""
        if self.head_packed is not None:
            return self.head_packed(hidden)  # [N, vocab_size], already float32
        if self.head_t is not None:
            return (hidden @ self.head_t).to(torch.float32)  # [N, vocab_size]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).to(torch.float32)  # [N, vocab_size]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer's KV cache tensor: [2, num_kv_heads, num_blocks, block_size, head_dim]."""
        return (2, self.config.num_kv_heads, num_blocks, block_size, self.config.head_dim)


def build_empty_model(config: ModelConfig) -> LlamaModel:
    """A LlamaModel whose parameters live on the meta device: no memory, no init work.

    nn.Linear's default init costs seconds on a 100M-parameter model and every value
    is overwritten anyway; callers fill it with load_state_dict(assign=True) or
    to_empty() followed by their own init.
    """
    with torch.device("meta"):
        return LlamaModel(config)
