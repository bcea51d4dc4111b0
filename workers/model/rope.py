"""Rotary position embeddings in Hugging Face's "rotate_half" layout.

Dimension i of a head is rotated together with dimension i + head_dim/2 (not with its
neighbour i+1 as in the interleaved GPT-J form), which is how HF Llama checkpoints store
q_proj and k_proj. The angle of a token is its explicit position times a per-pair
frequency; a cached key carries the rotation of the position it was written at, so the
decode step must be given the true position or attention degrades silently.
"""

from __future__ import annotations

import math

import torch

from workers.model.config import RopeScaling


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequency of each rotated pair, float32 on CPU: [head_dim // 2]."""
    # device="cpu" explicitly: models are built under torch.device("meta") to skip init,
    # and these numbers must be real.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta ** exponents)  # [head_dim // 2]
    if rope_scaling is None:
        return inv_freq
    return _llama3_adjust(inv_freq, rope_scaling)


def _llama3_adjust(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Stretch long wavelengths by `factor`, keep short ones, blend the band between.

        wavelength:  short ........ high_wl ......... low_wl ........ long
        inv_freq:    unchanged      | smooth blend     |   inv_freq / factor
    """
    original = scaling.original_max_position_embeddings
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [head_dim // 2]
    stretched = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    # smooth = 0 at the low-frequency edge (fully stretched), 1 at the high-frequency edge.
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * stretched / scaling.factor + smooth * stretched
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, stretched)  # [head_dim // 2]


class RotaryEmbedding:
    """cos/sin tables for explicit positions.

    Deliberately not an nn.Module: `model.to(torch.bfloat16)` would otherwise round the
    frequencies to bf16, and positions in the thousands would then rotate by visibly
    wrong angles. The float32 frequencies are copied once per device and kept.
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: RopeScaling | None) -> None:
        self.head_dim = head_dim
        self._inv_freq_cpu = rope_inv_freq(head_dim, rope_theta, rope_scaling)  # [head_dim // 2]
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The float32 frequencies on `device`: [head_dim // 2]."""
        cached = self._inv_freq_by_device.get(device)
        if cached is None:
            cached = self._inv_freq_cpu.to(device)
            self._inv_freq_by_device[device] = cached
        return cached

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin of every token's angles, computed in float32, cast to `dtype`.

        positions: [num_tokens] int64. Returns two [num_tokens, 1, head_dim] tensors (the
        1 broadcasts over heads). The sin's first half is negated so that apply_rotary
        needs no negation:  rotate_half(x) * sin == roll(x, half) * signed_sin.
        """
        inv_freq = self.inv_freq(positions.device)
        freqs = positions[:, None].to(torch.float32) * inv_freq[None, :]  # [num_tokens, head_dim // 2]
        cos = freqs.cos()
        sin = freqs.sin()
        cos_full = torch.cat((cos, cos), dim=-1)  # [num_tokens, head_dim]
        signed_sin = torch.cat((-sin, sin), dim=-1)  # [num_tokens, head_dim]
        return cos_full.to(dtype)[:, None, :], signed_sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate every head of x by its token's angles (HF's rotate_half layout).

    x: [num_tokens, num_heads, head_dim]; cos, signed_sin: [num_tokens, 1, head_dim]
    from RotaryEmbedding.cos_sin.

        x = [x1 | x2]            rotate_half(x) = [-x2 | x1]
        roll(x, half) = [x2 | x1], times signed_sin = [-sin | sin]  ->  [-x2 sin | x1 sin]
    """
    rolled = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)  # [num_tokens, num_heads, head_dim]
    return torch.addcmul(x * cos, rolled, signed_sin)


def apply_rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary written back into x (a view of the fused q/k/v projection, any strides),
    so that k and v stay side by side there and go to the KV cache without a copy.
    The same arithmetic, so the same numbers. Returns x."""
    rolled = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)  # [num_tokens, num_heads, head_dim]
    return torch.addcmul(x * cos, rolled, signed_sin, out=x)
