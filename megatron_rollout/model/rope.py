"""Rotary tables for a model config: plain RoPE, or YaRN context extension (DeepSeek-V3).

YaRN keeps high frequencies (many rotations over the original context) as they are, interpolates
low ones by `rotary_scaling_factor`, ramps linearly between, and scales cos/sin by a magnitude
factor; MLA then also scales its softmax (`softmax_scale`). The formulas are the YaRN paper's as
Megatron-core and transformers implement them, with the correction range rounded outward.
Left out: dynamic (length-dependent) scaling and the other scaled RoPE variants.
"""
from __future__ import annotations

import math

import torch

from megatron_rollout.model.config import ModelConfig


def rope_dim(cfg: ModelConfig) -> int:
    """Width of each head's rotated part."""
    return cfg.qk_pos_emb_head_dim if cfg.multi_latent_attention else cfg.kv_channels


def _yarn_mscale(factor: float, coefficient: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * coefficient * math.log(factor) + 1.0


def yarn_inv_freq(cfg: ModelConfig, dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[dim / 2] fp32 inverse frequencies, interpolated where a frequency turns fewer than
    `beta_slow` times over the original context and kept where it turns more than `beta_fast`.
    Built on `device` (no host-to-device copy: a CUDA graph may be capturing)."""
    base, factor, orig = cfg.rotary_base, cfg.rotary_scaling_factor, cfg.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / max(high - low, 1e-3)).clamp(0, 1)
    extrapolated = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp)


def cos_sin_scale(cfg: ModelConfig) -> float:
    """Magnitude factor YaRN applies to cos and sin (1 for plain RoPE)."""
    if cfg.rope_type != "yarn":
        return 1.0
    f = cfg.rotary_scaling_factor
    return _yarn_mscale(f, cfg.mscale) / _yarn_mscale(f, cfg.mscale_all_dim)


def softmax_scale(cfg: ModelConfig, head_dim: int) -> float:
    """Attention logit scale: 1/sqrt(head_dim), times YaRN's mscale(all_dim) squared."""
    scale = 1.0 / math.sqrt(head_dim)
    if cfg.rope_type == "yarn" and cfg.mscale_all_dim:
        scale *= _yarn_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim) ** 2
    return scale


def rope_for(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [N, rope_dim(cfg)] for rotate-half RoPE at `positions`, computed in fp32."""
    dim = rope_dim(cfg)
    if cfg.rope_type == "yarn":
        inv_freq = yarn_inv_freq(cfg, dim, positions.device)
    else:
        inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, device=positions.device,
                                                             dtype=torch.float32) / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = cos_sin_scale(cfg)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
