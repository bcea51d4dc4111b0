"""Load a llama.cpp GGUF file (architecture llama or qwen2) as a LoadedModel.

A GGUF is a whole model in one file: the config and the tokenizer are metadata under
llama.cpp's key names, the weights are tensors, often quantized. This module reads the
metadata into a ModelConfig and a tokenizer, and gguf_weights.py turns the tensors into
the dense state dict LlamaModel loads. As with Hugging Face checkpoints, every way a
file can be unusable is a ModelLoadError naming the key or tensor.

Metadata keys read ({arch} is general.architecture):

    {arch}.block_count, .embedding_length, .feed_forward_length, .attention.head_count,
    .attention.layer_norm_rms_epsilon, .context_length                       required
    .attention.head_count_kv (default head_count), .rope.freq_base (default 10000),
    .attention.key_length (default embedding_length / head_count)            optional

Tied embeddings are a file without output.weight; biases are present tensors.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGUFReader

from workers.model.config import ModelConfig, ModelLoadError, RopeScaling
from workers.model.gguf_tokenizer import special_token_ids, tokenizer_from_gguf
from workers.model.gguf_weights import ROPE_FREQS_TENSOR, dequantize_tensor, read_state_dict, torch_shape
from workers.model.llama import build_empty_model
from workers.model.loader import LoadedModel
from workers.model.rope import rope_inv_freq
from workers.model.tokenizer import HFTokenizer

__all__ = ["GGUFFile", "GGUFMetadata", "config_from_gguf", "load_gguf", "load_gguf_tokenizer", "open_gguf"]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
_DEFAULT_ROPE_THETA = 10000.0  # llama.cpp's value when the file states none
# Llama 3.x's "llama3" RoPE scaling, the one per-frequency factor table a file stores as
# rope_freqs.weight; only the factor differs between 3.1 (8) and 3.2 (32).
_LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR, _LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192


@dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's key/value metadata, read with typed accessors that name the key on error.

    values: key -> Python value (arrays as lists). source: the file, for error messages.
    """

    values: Mapping[str, Any]
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.values, Mapping):
            raise ValueError(f"GGUFMetadata.values must be a mapping, got {type(self.values).__name__}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"GGUFMetadata.source must be a non-empty string, got {self.source!r}")

    def _get(self, key: str, required: bool, kind: str, accepts: Callable[[Any], bool]) -> Any:
        if key not in self.values:
            if required:
                raise ModelLoadError(f"missing required metadata key '{key}' in {self.source}")
            return None
        value = self.values[key]
        if not accepts(value):
            raise ModelLoadError(f"metadata key '{key}' in {self.source} must be {kind}, got {_short(value)}")
        return value

    def require_int(self, key: str) -> int:
        return int(self._get(key, True, "an integer", _is_int))

    def optional_int(self, key: str) -> int | None:
        value = self._get(key, False, "an integer", _is_int)
        return None if value is None else int(value)

    def require_float(self, key: str) -> float:
        return float(self._get(key, True, "a number", _is_number))

    def optional_float(self, key: str) -> float | None:
        value = self._get(key, False, "a number", _is_number)
        return None if value is None else float(value)

    def require_str(self, key: str) -> str:
        return str(self._get(key, True, "a string", _is_str))

    def optional_str(self, key: str) -> str | None:
        value = self._get(key, False, "a string", _is_str)
        return None if value is None else str(value)

    def require_strings(self, key: str) -> list[str]:
        return list(self._get(key, True, "an array of strings", _list_of(_is_str)))

    def optional_strings(self, key: str) -> list[str] | None:
        value = self._get(key, False, "an array of strings", _list_of(_is_str))
        return None if value is None else list(value)

    def optional_ints(self, key: str) -> list[int] | None:
        value = self._get(key, False, "an array of integers", _list_of(_is_int))
        return None if value is None else [int(v) for v in value]

    def optional_floats(self, key: str) -> list[float] | None:
        value = self._get(key, False, "an array of numbers", _list_of(_is_number))
        return None if value is None else [float(v) for v in value]


class _Reader(GGUFReader):
    """gguf's reader over a plain ndarray view of its memory map, not the np.memmap itself.

    GGUFReader slices its map once per array element while it reads the metadata, and
    np.memmap's slicing runs Python hooks (__getitem__, __array_finalize__) on each: 4.1 s
    for SmolLM2's 49,152-token vocabulary and 48,900 merges, 1.4 s over the same map as an
    ndarray. The bytes are the same mapping (nothing is copied), the tensors still views.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray[Any, Any]:
        return self._array

    @data.setter
    def data(self, mapped: np.ndarray[Any, Any]) -> None:
        self._array = np.asarray(mapped)  # the base-class view: the map is kept by its .base


class GGUFFile(NamedTuple):
    """An opened GGUF: the reader (tensors memory-mapped, not yet read) and its metadata."""

    reader: GGUFReader
    metadata: GGUFMetadata


def open_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file and read its metadata; ModelLoadError if it is missing or unreadable."""
    file = Path(path)
    if not file.is_file():
        raise ModelLoadError(f"GGUF file {file} not found")
    try:
        reader = _Reader(file)
    except (ValueError, OSError, KeyError, IndexError) as error:
        raise ModelLoadError(f"{file} is not a readable GGUF file: {error}") from error
    values = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return GGUFFile(reader, GGUFMetadata(values, str(file)))


def config_from_gguf(
    metadata: GGUFMetadata,
    tensor_shapes: Mapping[str, tuple[int, ...]],
    rope_freqs: torch.Tensor | None = None,
) -> ModelConfig:
    """The ModelConfig a GGUF file describes.

    tensor_shapes: GGUF tensor name -> torch-order shape (the vocabulary size, biases and
    tied embeddings are read from which tensors exist). rope_freqs: the file's
    rope_freqs.weight, [head_dim // 2] float32, if it has one.
    """
    arch = metadata.require_str("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"general.architecture {arch!r} in {metadata.source} is not supported "
            f"({', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    embedding = tensor_shapes.get("token_embd.weight")
    if embedding is None or len(embedding) != 2:
        raise ModelLoadError(f"missing tensor token_embd.weight in {metadata.source}")
    hidden_size = metadata.require_int(f"{arch}.embedding_length")
    num_heads = metadata.require_int(f"{arch}.attention.head_count")
    num_kv_heads = metadata.optional_int(f"{arch}.attention.head_count_kv") or num_heads
    head_dim = metadata.optional_int(f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = hidden_size // num_heads if num_heads > 0 else 0
    for key in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):
        stated = metadata.optional_int(key)
        if stated is not None and stated != head_dim:
            raise ModelLoadError(
                f"metadata '{key}' {stated} in {metadata.source} differs from the head size {head_dim}, "
                f"which is not supported"
            )
    scaling_type = metadata.optional_str(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise ModelLoadError(
            f"metadata '{arch}.rope.scaling.type' {scaling_type!r} in {metadata.source} is not supported (none)"
        )
    rope_theta = metadata.optional_float(f"{arch}.rope.freq_base") or _DEFAULT_ROPE_THETA
    rope_scaling = None if rope_freqs is None else _llama3_scaling(rope_freqs, head_dim, rope_theta, metadata)
    ids = special_token_ids(metadata)
    try:
        return ModelConfig(
            vocab_size=embedding[0],
            hidden_size=hidden_size,
            intermediate_size=metadata.require_int(f"{arch}.feed_forward_length"),
            num_layers=metadata.require_int(f"{arch}.block_count"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=metadata.require_float(f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=metadata.require_int(f"{arch}.context_length"),
            tie_word_embeddings="output.weight" not in tensor_shapes,
            qkv_bias="blk.0.attn_q.bias" in tensor_shapes,
            o_bias="blk.0.attn_output.bias" in tensor_shapes,
            bos_token_id=ids.bos_token_id,
            eos_token_ids=ids.eos_token_ids,
        )
    except ModelLoadError:
        raise
    except ValueError as error:
        raise ModelLoadError(f"{error} (from the metadata of {metadata.source})") from error


def load_gguf(path: str | Path, device: torch.device, dtype: torch.dtype, name: str | None = None) -> LoadedModel:
    """Load a GGUF file's model and tokenizer, weights dequantized to `dtype` on `device`.

    Like load_checkpoint: eval mode, no gradients, projections fused. `name` is the
    LoadedModel's name (default: the file name without .gguf).
    """
    started = time.perf_counter()
    file = Path(path)
    reader, metadata = open_gguf(file)
    tensors = list(reader.tensors)
    shapes = {t.name: torch_shape(t) for t in tensors}
    rope_freqs = next((dequantize_tensor(t) for t in tensors if t.name == ROPE_FREQS_TENSOR), None)
    config = config_from_gguf(metadata, shapes, rope_freqs)
    tokenizer = tokenizer_from_gguf(metadata)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"the tokenizer in {file} has {tokenizer.vocab_size} tokens, more than the "
            f"{config.vocab_size} rows of token_embd.weight"
        )
    kinds = Counter(t.tensor_type.name for t in tensors)
    print(f"[kvserve] loading {file.name}: {len(tensors)} tensors "
          f"({', '.join(f'{k} {n}' for k, n in kinds.most_common())})", file=sys.stderr, flush=True)

    model = build_empty_model(config)
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    unpermute = metadata.require_str("general.architecture") == "llama"
    state = read_state_dict(tensors, config, expected, unpermute, device, dtype, str(file))
    del reader, tensors
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    model.fuse_projections()
    weight_bytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"[kvserve] loaded {file.name} in {time.perf_counter() - started:.1f}s: "
          f"{weight_bytes / 2**20:.0f} MiB of {dtype} weights on {device}", file=sys.stderr, flush=True)
    loaded_name = name if name is not None else file.name.removesuffix(".gguf")
    return LoadedModel(model=model, config=config, tokenizer=tokenizer, name=loaded_name)


def load_gguf_tokenizer(path: str | Path) -> HFTokenizer:
    """Only the tokenizer of a GGUF file (no tensor is read)."""
    _, metadata = open_gguf(path)
    return tokenizer_from_gguf(metadata)


def _llama3_scaling(rope_freqs: torch.Tensor, head_dim: int, rope_theta: float, metadata: GGUFMetadata) -> RopeScaling:
    """The llama3 RopeScaling whose frequencies rope_freqs.weight encodes, or an error.

    llama.cpp divides each frequency by its factor; the stretched (longest) wavelengths
    are divided by the scaling factor itself, so the largest entry is the factor.
    """
    if tuple(rope_freqs.shape) != (head_dim // 2,):
        raise ModelLoadError(
            f"tensor {ROPE_FREQS_TENSOR} in {metadata.source} has shape {tuple(rope_freqs.shape)}, "
            f"expected ({head_dim // 2},)"
        )
    factors = rope_freqs.to(torch.float32)  # [head_dim // 2]
    scaling = RopeScaling(
        factor=float(factors.max()),
        low_freq_factor=_LLAMA3_LOW_FREQ_FACTOR,
        high_freq_factor=_LLAMA3_HIGH_FREQ_FACTOR,
        original_max_position_embeddings=_LLAMA3_ORIGINAL_CONTEXT,
    )
    wanted = rope_inv_freq(head_dim, rope_theta, None) / factors  # [head_dim // 2]
    if not torch.allclose(rope_inv_freq(head_dim, rope_theta, scaling), wanted, rtol=1e-4, atol=0.0):
        raise ModelLoadError(
            f"tensor {ROPE_FREQS_TENSOR} in {metadata.source} is not Llama 3's RoPE scaling "
            f"(factor {scaling.factor:g}, low 1, high 4, original context 8192); other per-frequency "
            f"factors are not supported"
        )
    return scaling


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _list_of(accepts: Callable[[object], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(accepts(v) for v in value)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
