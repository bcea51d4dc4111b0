"""A decode-only step of up to NATIVE_DECODE_MAX_ROWS requests, every layer in one native call
(native_decode.c), instead of ~30 torch ops and 6 ctypes calls per layer.

Why: with the projections already native, a batch-1 step of SmolLM2 (30 layers) still
dispatched ~930 torch ops, and the profile charged ~6 ms of a ~31 ms step to Python
between ops, ~4 ms more to the small ops themselves (rotary, SwiGLU, KV write, SDPA,
views). The layers' arithmetic is the eager path's (the same projection tiles, the
same float32 formulas); attention is a plain softmax over the paged blocks, one
(request, head) at a time, so a request's numbers do not depend on its batch.

Only for float32 CPU models whose projections go through the native kernel
(LlamaModel.pack_linears(native=True)); prefill and mixed steps, and decode steps of
more rows, keep the eager path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from workers.model.config import ModelConfig
from workers.model.decode_attention import DecodeOnly
from workers.model.native_linear import native_linear

_P = ctypes.c_void_p
# Decode-only steps of up to this many requests run natively; larger ones stay eager. Side
# by side on SmolLM2 (2 threads, the same engine stepping in turn): 32 rows 82 against
# 119 ms, 64 rows 150 against 205, 128 rows 271 against 335 (the eager step's projections
# on oneDNN). Not measured past 128 (max_num_seqs defaults to 64).
NATIVE_DECODE_MAX_ROWS = 128
# kvs_decode's phases, in its order (native_decode.c), for profiling (phase_seconds).
PHASES = ("rotary tables", "input norm", "q/k/v projection", "rotary + KV write", "attention", "o projection",
          "post-attention norm", "gate/up projection", "SiLU x up", "down projection", "final norm")


class _Model(ctypes.Structure):
    """native_decode.c's model_t, field by field."""

    _fields_ = [
        *((name, ctypes.c_int) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                            "intermediate")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *((name, _P) for name in ("inv_freq", "input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up",
                                  "down", "final_norm")),
    ]


def _pointers(tensors: Sequence[torch.Tensor | None]) -> ctypes.Array[ctypes.c_void_p] | None:
    """A C array of the tensors' data pointers; None when every entry is None (no biases)."""
    present = [t for t in tensors if t is not None]
    if not present:
        return None
    if len(present) != len(tensors):
        raise ValueError("native decode needs every layer to have the same biases")
    return (_P * len(present))(*(t.data_ptr() for t in present))


class LayerWeights(NamedTuple):
    """One decoder layer's tensors as the native decode reads them: float32, contiguous,
    projections [out, in] in the kernels' blocked layout (PackedLinear.blocked)."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H + 2 KVH) D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 KVH) D]
    o: torch.Tensor  # [hidden, H D]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 I, hidden]: gate rows, then up rows
    down: torch.Tensor  # [hidden, I]


class NativeDecoder:
    """The model's decode step through kvs_decode. Holds pointers into the given tensors:
    they must outlive it and never be replaced (LlamaModel.pack_linears makes it)."""

    def __init__(self, config: ModelConfig, inv_freq: torch.Tensor, layers: Sequence[LayerWeights],
                 final_norm: torch.Tensor) -> None:
        if config.num_heads % config.num_kv_heads or config.head_dim % 2:
            raise ValueError("native decode needs num_heads divisible by num_kv_heads and an even head_dim")
        if len(layers) != config.num_layers:
            raise ValueError(f"native decode needs {config.num_layers} layers' weights, got {len(layers)}")
        for tensor in (inv_freq, final_norm, *(t for layer in layers for t in layer if t is not None)):
            if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
                raise ValueError("native decode needs contiguous float32 CPU weights")
        self._kernel = native_linear()
        self._tensors = (inv_freq, final_norm, layers)  # kept alive with the pointers
        # The per-layer pointer arrays the struct points into, by model_t field.
        self._arrays = {field: _pointers([getattr(layer, field) for layer in layers])
                        for field in LayerWeights._fields}
        self._struct = _Model(
            num_layers=config.num_layers, hidden=config.hidden_size, num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, intermediate=config.intermediate_size,
            eps=config.rms_norm_eps, scale=config.head_dim ** -0.5,
            inv_freq=inv_freq.data_ptr(), final_norm=final_norm.data_ptr(),
            **{name: None if array is None else ctypes.addressof(array) for name, array in self._arrays.items()},
        )
        # The layers' cache pointers by every layer's address: one entry per KV pool.
        self._caches: dict[tuple[int, ...], ctypes.Array[ctypes.c_void_p]] = {}
        # Set to a float64 [len(PHASES)] tensor to have each call add its phases' seconds to it.
        self.phase_seconds: torch.Tensor | None = None

    def _cache_pointers(self, kv_caches: Sequence[torch.Tensor]) -> ctypes.Array[ctypes.c_void_p]:
        """The layers' cache pointers, checked and made once per KV pool (engines may share
        a model, each with its own pool)."""
        first = kv_caches[0]
        # Keyed by every layer's address, not the first's: caches that are freed and
        # allocated again (a test's clones) can reuse one address and not the others, and a
        # stale pointer would read and write freed memory.
        key = tuple(cache.data_ptr() for cache in kv_caches)
        pointers = self._caches.get(key)
        if pointers is None:
            for cache in kv_caches:
                if cache.dtype != torch.float32 or not cache.is_contiguous() or cache.shape != first.shape:
                    raise ValueError("native decode needs contiguous float32 KV caches of one shape")
            if len(self._caches) >= 8:  # pools come and go (tests, benchmarks): keep the last few
                self._caches.clear()
            pointers = (_P * len(kv_caches))(*key)
            self._caches[key] = pointers
        return pointers

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, decode: DecodeOnly,
                kv_caches: Sequence[torch.Tensor]) -> torch.Tensor:
        """hidden: [B, hidden] token embeddings (overwritten: the residual stream);
        positions, slot_mapping: [B] int64, one row per request. Writes the rows' K/V into
        the caches and returns the final norm's output [B, hidden]."""
        caches = self._cache_pointers(kv_caches)
        _, _, num_blocks, block_size, _ = kv_caches[0].shape
        x = hidden.contiguous()
        out = torch.empty_like(x)  # [B, hidden]
        positions = positions.contiguous()
        slot_mapping = slot_mapping.contiguous()
        status = self._kernel.decode(
            ctypes.addressof(self._struct), ctypes.addressof(caches), num_blocks, block_size, x.data_ptr(),
            out.data_ptr(), positions.data_ptr(), slot_mapping.data_ptr(), decode.block_tables.data_ptr(),
            decode.num_blocks, x.shape[0], torch.get_num_threads(),
            None if self.phase_seconds is None else self.phase_seconds.data_ptr(),
        )
        if status != 0:
            raise MemoryError("native decode could not allocate its scratch memory")
        return out
