"""The shape of a Llama-family model, read from a Hugging Face config.json or a preset.

One ModelConfig describes every model this package runs: Llama, Qwen2 and Mistral are
the same decoder (RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP) and
differ only in which projections carry a bias. Anything the decoder cannot reproduce
exactly (another activation, another RoPE scaling, a sliding window) is refused at load
time rather than run with silently different numerics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class ModelLoadError(ValueError):
    """A checkpoint or model name cannot be loaded; the message names the file and field."""


@dataclass(frozen=True)
class RopeScaling:
    """The "llama3" RoPE frequency adjustment (Llama 3.1 and later).

    Wavelengths longer than original_max_position_embeddings / low_freq_factor are
    stretched by `factor`, those shorter than original / high_freq_factor are kept, and
    the band in between is interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"RopeScaling.{name} must be a positive number, got {value!r}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor must exceed low_freq_factor "
                f"({self.low_freq_factor!r}), got {self.high_freq_factor!r}"
            )
        _check_positive_int("RopeScaling.original_max_position_embeddings",
                            self.original_max_position_embeddings)


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and numerics of one decoder-only model.

    qkv_bias: q_proj, k_proj and v_proj carry a bias (Qwen2; Llama with attention_bias).
    o_bias: o_proj carries a bias (Llama with attention_bias only).
    tie_word_embeddings: the output projection reuses model.embed_tokens.weight.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            _check_positive_int(f"ModelConfig.{name}", getattr(self, name))
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads, got num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            # rotate_half pairs dimension i with i + head_dim / 2.
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"ModelConfig.rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
            )
        for name in ("tie_word_embeddings", "qkv_bias", "o_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.bos_token_id is not None:
            _check_token_id("ModelConfig.bos_token_id", self.bos_token_id, self.vocab_size)
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError(f"ModelConfig.eos_token_ids must be a tuple, got {self.eos_token_ids!r}")
        for token_id in self.eos_token_ids:
            _check_token_id("ModelConfig.eos_token_ids", token_id, self.vocab_size)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_parameters(self) -> int:
        """Parameter count from the sizes alone (equals the built module's count)."""
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_out + 2 * kv_out) + q_out * self.hidden_size
        if self.qkv_bias:
            attention += q_out + 2 * kv_out
        if self.o_bias:
            attention += self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return embeddings + self.num_layers * (attention + mlp + norms) + self.hidden_size + lm_head

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Read a Hugging Face config.json of model_type llama, qwen2 or mistral.

        Both the transformers<5 form (rope_theta, rope_scaling) and the transformers 5
        form (rope_parameters holding rope_type and rope_theta) are accepted. `source`
        is the file path used in error messages.
        """
        return _parse_hf_config(d, source)


_SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


def _parse_hf_config(d: dict[str, Any], source: str) -> ModelConfig:
    def fail(message: str) -> ModelLoadError:
        return ModelLoadError(f"{message} in {source}")

    def required(key: str) -> Any:
        if key not in d or d[key] is None:
            raise fail(f"missing required field '{key}'")
        return d[key]

    model_type = d.get("model_type")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model_type {model_type!r} in {source} is not supported ({', '.join(_SUPPORTED_MODEL_TYPES)})"
        )
    hidden_act = d.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise fail(f"hidden_act {hidden_act!r} is not supported (silu)")
    if d.get("mlp_bias", False):
        raise fail("mlp_bias true is not supported")
    if model_type == "mistral" and d.get("sliding_window") is not None:
        raise fail(f"sliding_window {d['sliding_window']!r} is not supported (null)")
    if model_type == "qwen2" and d.get("use_sliding_window", False):
        raise fail("use_sliding_window true is not supported")

    hidden_size = required("hidden_size")
    num_heads = required("num_attention_heads")
    head_dim = d.get("head_dim")
    if head_dim is None:
        if not isinstance(hidden_size, int) or not isinstance(num_heads, int) or num_heads < 1:
            raise fail(f"hidden_size {hidden_size!r} / num_attention_heads {num_heads!r} is not a head_dim")
        head_dim = hidden_size // num_heads
    num_kv_heads = d.get("num_key_value_heads")
    if num_kv_heads is None:
        num_kv_heads = num_heads  # HF's default: plain multi-head attention

    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        attention_bias = bool(d.get("attention_bias", False))
        qkv_bias, o_bias = attention_bias, attention_bias

    rope_theta, rope_scaling = _parse_rope(d, fail)
    eos = d.get("eos_token_id")
    if eos is None:
        eos_token_ids: tuple[int, ...] = ()
    elif isinstance(eos, list):
        eos_token_ids = tuple(eos)
    else:
        eos_token_ids = (eos,)

    try:
        return ModelConfig(
            vocab_size=required("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=required("intermediate_size"),
            num_layers=required("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
        )
    except ModelLoadError:
        raise
    except ValueError as error:
        raise fail(str(error)) from error


def _parse_rope(
    d: dict[str, Any], fail: Callable[[str], ModelLoadError]
) -> tuple[float, RopeScaling | None]:
    """rope_theta and llama3 scaling from either config.json form."""
    params = d.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise fail(f"rope_parameters {params!r} is not an object")
    legacy = d.get("rope_scaling")
    if legacy is not None and not isinstance(legacy, dict):
        raise fail(f"rope_scaling {legacy!r} is not an object")
    # transformers 5 writes rope_parameters; older files write rope_theta + rope_scaling.
    scaling = params if params is not None else legacy
    rope_theta = d.get("rope_theta")
    if params is not None and params.get("rope_theta") is not None:
        rope_theta = params["rope_theta"]
    if rope_theta is None:
        rope_theta = 10000.0
    if not isinstance(rope_theta, (int, float)) or isinstance(rope_theta, bool):
        raise fail(f"rope_theta {rope_theta!r} is not a number")
    if scaling is None:
        return float(rope_theta), None

    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    partial = scaling.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise fail(f"partial_rotary_factor {partial!r} is not supported (1.0)")
    if rope_type == "default":
        return float(rope_theta), None
    if rope_type != "llama3":
        raise fail(f"rope_scaling type {rope_type!r} is not supported (llama3, default)")
    try:
        return float(rope_theta), RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(
                scaling.get("original_max_position_embeddings", d.get("max_position_embeddings", 0))
            ),
        )
    except KeyError as error:
        raise fail(f"rope_scaling is missing field {error.args[0]!r}") from error
    except (TypeError, ValueError) as error:
        raise fail(f"rope_scaling is invalid: {error}") from error


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_token_id(name: str, value: object, vocab_size: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(f"{name} must be a token id in [0, {vocab_size}), got {value!r}")

