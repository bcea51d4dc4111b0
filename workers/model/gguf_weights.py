"""GGUF tensors to the Hugging Face state dict LlamaModel loads: rename, dequantize, un-permute.

llama.cpp names tensors per block and stores shapes in ggml order (fastest-moving
dimension first), so a [out, in] matrix is listed as [in, out]:

    token_embd.weight          -> model.embed_tokens.weight
    blk.{i}.attn_norm.weight   -> model.layers.{i}.input_layernorm.weight
    blk.{i}.attn_{q,k,v}.*     -> model.layers.{i}.self_attn.{q,k,v}_proj.*
    blk.{i}.attn_output.*      -> model.layers.{i}.self_attn.o_proj.*
    blk.{i}.ffn_norm.weight    -> model.layers.{i}.post_attention_layernorm.weight
    blk.{i}.ffn_{gate,up,down} -> model.layers.{i}.mlp.{gate,up,down}_proj.weight
    output_norm.weight         -> model.norm.weight
    output.weight              -> lm_head.weight

Every tensor is dequantized to float32 at load, then cast to the requested dtype: the
model runs dense weights, the file's quantization only saves disk and download.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from workers.model.config import ModelConfig, ModelLoadError

__all__ = [
    "ROPE_FREQS_TENSOR",
    "SUPPORTED_TENSOR_TYPES",
    "dequantize_tensor",
    "hf_tensor_name",
    "read_state_dict",
    "torch_shape",
    "unpermute_rope_rows",
]

Q = GGMLQuantizationType
SUPPORTED_TENSOR_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K)
)
# Llama 3.1-style per-frequency RoPE factors: read into the config, not a parameter.
ROPE_FREQS_TENSOR = "rope_freqs.weight"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_PROGRESS_STEPS = 4  # a progress line at every quarter of the tensors


def hf_tensor_name(gguf_name: str) -> str | None:
    """The LlamaModel parameter a GGUF tensor fills, or None if it is not one we know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """The tensor's shape in torch order: GGUF lists dimensions fastest-first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """Float32 values of a supported tensor, in torch order (e.g. [out, in])."""
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        raise ModelLoadError(f"tensor {tensor.name} has type {tensor.tensor_type.name}, which is not supported")
    values: np.ndarray[Any, Any] = dequantize(tensor.data, tensor.tensor_type)
    if not values.flags.writeable:  # F32 comes back as a view of the read-only memory map
        values = values.copy()
    return torch.from_numpy(values.astype(np.float32, copy=False)).reshape(torch_shape(tensor))


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order, back to HF's rotate-half layout.

    llama.cpp's converter reorders each head's rows so its interleaved RoPE pairs
    neighbours; HF pairs row i with row i + head_dim/2. Within one head (D = head_dim):

        HF:   0 1 ... D/2-1 | D/2 ... D-1     (first half, second half)
        GGUF: 0 D/2 1 D/2+1 ... D/2-1 D-1     (the halves interleaved)

    weight: [num_heads * D, in] or a bias [num_heads * D]; returns the same shape.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads) != 0:
        raise ModelLoadError(f"{rows} rows do not split into {num_heads} heads of an even size")
    rest = tuple(weight.shape[1:])
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)  # [H, D/2, 2, ...]
    return per_head.transpose(1, 2).reshape(rows, *rest)  # [H * D, ...] with halves contiguous


def read_state_dict(
    tensors: Sequence[ReaderTensor],
    config: ModelConfig,
    expected: Mapping[str, tuple[int, ...]],
    unpermute_qk: bool,
    device: torch.device,
    dtype: torch.dtype,
    source: str,
) -> dict[str, torch.Tensor]:
    """Every parameter in `expected` (name -> shape) from the file's tensors.

    Types, names and shapes are all checked before anything is dequantized, so a bad
    file fails in milliseconds; then tensors are dequantized one by one (host memory
    peaks at one float32 tensor beyond the result), with progress on stderr.
    unpermute_qk: the file is a llama.cpp "llama" conversion, whose Q/K rows are permuted.
    """
    chosen: list[tuple[str, ReaderTensor]] = []
    for tensor in tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            continue
        name = hf_tensor_name(tensor.name)
        if name is None or name not in expected:
            raise ModelLoadError(f"tensor {tensor.name} in {source} is not one this model uses")
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            raise ModelLoadError(
                f"tensor {tensor.name} in {source} has type {tensor.tensor_type.name}, "
                f"which is not supported ({supported})"
            )
        if torch_shape(tensor) != expected[name]:
            raise ModelLoadError(
                f"tensor {tensor.name} in {source} has shape {torch_shape(tensor)} (torch order), "
                f"the metadata implies {expected[name]} for {name}"
            )
        chosen.append((name, tensor))
    found = {name for name, _ in chosen}
    missing = [name for name in expected if name not in found]
    if missing:
        raise ModelLoadError(f"missing tensors in {source}: {', '.join(_gguf_names(missing[:10]))}"
                             + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""))

    state: dict[str, torch.Tensor] = {}
    every = max(1, -(-len(chosen) // _PROGRESS_STEPS))
    for number, (name, tensor) in enumerate(chosen, start=1):
        values = dequantize_tensor(tensor)  # float32, torch order
        if unpermute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = unpermute_rope_rows(values, config.num_heads)
        elif unpermute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = unpermute_rope_rows(values, config.num_kv_heads)
        state[name] = values.to(device=device, dtype=dtype)
        if number % every == 0 or number == len(chosen):
            print(f"[kvserve] dequantized tensor {number}/{len(chosen)}", file=sys.stderr, flush=True)
    return state


def _gguf_names(hf_names: Sequence[str]) -> list[str]:
    """HF parameter names back to GGUF tensor names, for error messages about the file."""
    by_hf = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()}
    names = []
    for name in hf_names:
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        part = None if match is None else next((g for g, h in _BLOCK_NAMES.items() if h == match.group(2)), None)
        if match is not None and part is not None:
            names.append(f"blk.{match.group(1)}.{part}.{match.group(3)} ({name})")
        else:
            names.append(f"{by_hf.get(name, name)} ({name})")
    return names
