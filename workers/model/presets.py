"""Random-weight models by name, for tests, benchmarks and clusters without checkpoints.

Weights come from a seeded torch.Generator on CPU in float32, in parameter order, and
only then are cast and moved. So every worker that builds ("tiny", seed=0) holds the
same weights whatever its device or dtype, and a request gives the same tokens on any
replica (up to the dtype's rounding).
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch

from workers.model.config import ModelConfig, ModelLoadError, RopeScaling
from workers.model.llama import build_empty_model
from workers.model.loader import LoadedModel
from workers.model.tokenizer import ByteTokenizer

_BYTES = ByteTokenizer()


def _byte_model(
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    tie_word_embeddings: bool,
) -> ModelConfig:
    return ModelConfig(
        vocab_size=_BYTES.vocab_size,  # 258: every id the model can emit decodes
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=_BYTES.bos_token_id,
        eos_token_ids=_BYTES.eos_token_ids,
    )


# Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads over 8 KV heads, vocab 128256,
# tied embeddings, rope theta 500000 with llama3 scaling), for GPU benchmarks without
# downloading it. Its tokenizer is still the byte tokenizer: ids past 257 decode to "".
_LLAMA_3_2_1B = ModelConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192),
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    bos_token_id=_BYTES.bos_token_id,
    eos_token_ids=_BYTES.eos_token_ids,
)

PRESETS: MappingProxyType[str, ModelConfig] = MappingProxyType({
    # ~5.9M parameters, the size of the model in the KV-cache chapter's measurements.
    "tiny": _byte_model(hidden_size=256, intermediate_size=688, num_layers=8, num_heads=4,
                        num_kv_heads=2, tie_word_embeddings=True),
    # ~136M parameters: big enough that a decode step is bound by reading weights.
    "small": _byte_model(hidden_size=1024, intermediate_size=2816, num_layers=12, num_heads=16,
                         num_kv_heads=4, tie_word_embeddings=False),
    # ~1.24B parameters (2.5 GB in bfloat16): the GPU check's model.
    "llama-3.2-1b": _LLAMA_3_2_1B,
    # ~50k parameters, one narrow layer: a step costs the engine's bookkeeping, not
    # arithmetic. bench-router's workers for the router's own ceiling.
    "micro": _byte_model(hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                         num_kv_heads=1, tie_word_embeddings=True),
})


def build_preset(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LoadedModel:
    """The preset `name` with weights drawn from `seed`, cast to `dtype` on `device`.

    Norm weights are ones; every other weight is normal with std 1/sqrt(fan_in), which
    keeps activations near unit scale through the layers and gives logits a spread of
    about one, so sampling at temperature 1 is neither flat nor one-hot.
    """
    config = PRESETS.get(name)
    if config is None:
        raise ModelLoadError(f"unknown preset {name!r} (presets: {', '.join(PRESETS)})")
    # Module.to_empty's empty_like on meta tensors imports sympy (torch's symbolic shapes),
    # 0.5 s of each tiny worker's start; torch.empty, which to_empty amounts to, does not.
    model = build_empty_model(config)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                fan_in = param.shape[-1]
                param.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=generator)
    model = model.to(device=device, dtype=dtype)
    model.requires_grad_(False)
    model.eval()
    model.fuse_projections()
    return LoadedModel(model=model, config=config, tokenizer=_BYTES, name=name)
