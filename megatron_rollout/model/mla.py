"""Multi-head latent attention (DeepSeek-V2/V3) with Megatron-core's MLA parameter names.

Keys and values are low-rank: every token stores one normalised latent `c` [kv_lora_rank] and one
RoPE key `k_pe` [qk_pos_emb_head_dim] shared by all heads; head h's key is `[W_UK[h] c ; k_pe]`
and its value `W_UV[h] c`, where `linear_kv_up_proj` stacks, per head, W_UK's rows then W_UV's.
The attention runs in the *absorbed* form, for prefill and decode alike: the query's no-RoPE part
is multiplied into latent space (`q_nope W_UK[h]`), so every head attends over the cached rows
`[c ; k_pe]` directly (multi-query attention with one KV head of width kv_lora_rank +
qk_pos_emb_head_dim), and the output's latent part is projected by W_UV afterwards. The cache
therefore holds the latent and the RoPE key only, and the backend is the ordinary
`AttentionBackend` with the cached row as both key and value (the value's trailing RoPE columns
are dropped from the output; a paged MLA cache stores the row once, `kv.paged`; on CUDA the
Triton kernels of `kernels.mla_attention` read it). The backend's 1/sqrt(width) scale is folded
into the query so the logits carry MLA's own scale.

RoPE follows Megatron's MLA convention (and DeepSeek's interleaved checkpoints): the rotated
dimensions come in pairs, de-interleaved before the rotate-half rotation.

Heads split over ATP (`linear_q_up_proj`/`linear_q_proj`, `linear_kv_up_proj` by rows,
`linear_proj` by columns); the down projections and their norms are replicated, so every ATP
rank caches the whole latent. Left out: FP8 for the up projections (the absorbed form reads
`linear_kv_up_proj.weight` directly) and a decompressed (non-absorbed) prefill.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megatron_rollout.comm.facade import Comm, Shard
from megatron_rollout.forward import BoundaryPoint, Forward, Site
from megatron_rollout.model.attention import AttentionBackend
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.layers import Linear, RMSNorm, apply_rope, linear
from megatron_rollout.model.rope import softmax_scale
from megatron_rollout.types import Axis, Phase


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] pairs (x0, x1), (x2, x3), ... -> [x0, x2, ..., x1, x3, ...] (rotate-half layout)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, heads, a], w [heads, b, a] -> [N, heads, b], head i's rows times w[i].T. On CPU through
    `layers.linear`, so a row's result does not depend on the rows computed beside it."""
    if x.device.type != "cpu":
        return torch.einsum("nha,hba->nhb", x, w)
    return torch.stack([linear(x[:, i], w[i]) for i in range(x.shape[1])], dim=1)


class MLASelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, device=None) -> None:
        super().__init__()
        if cfg.num_attention_heads % shard.atp_size:
            raise ValueError(f"num_attention_heads ({cfg.num_attention_heads}) must divide by ATP ({shard.atp_size})")
        self.layer, self.cfg = layer, cfg
        self.heads = cfg.num_attention_heads // shard.atp_size
        h, dt, eps = cfg.hidden_size, cfg.torch_dtype, cfg.layernorm_epsilon
        r, dr, dn, dv = cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim, cfg.qk_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank is None:
            self.linear_q_proj = Linear(h, self.heads * (dn + dr), dt, device)
        else:
            self.linear_q_down_proj = Linear(h, cfg.q_lora_rank, dt, device)
            self.q_layernorm = RMSNorm(cfg.q_lora_rank, eps, dt, device)
            self.linear_q_up_proj = Linear(cfg.q_lora_rank, self.heads * (dn + dr), dt, device)
        self.linear_kv_down_proj = Linear(h, r + dr, dt, device)
        self.kv_layernorm = RMSNorm(r, eps, dt, device)
        self.linear_kv_up_proj = Linear(r, self.heads * (dn + dv), dt, device)
        self.linear_proj = Linear(self.heads * dv, h, dt, device)
        # the backend divides logits by sqrt(r + dr); MLA's scale is over the per-head query width
        self.query_scale = softmax_scale(cfg, dn + dr) * math.sqrt(r + dr)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank is None:
            return self.linear_q_proj(x)
        return self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend,
                comm: Comm, phase: Phase) -> Forward:
        cfg, n = self.cfg, x.shape[0]
        r, dr, dn, dv = cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim, cfg.qk_head_dim, cfg.v_head_dim
        q_nope, q_pe = self.query(x).view(n, self.heads, dn + dr).split([dn, dr], dim=-1)  # [N, heads, dn | dr]
        latent, k_pe = self.linear_kv_down_proj(x).split([r, dr], dim=-1)  # [N, r], [N, dr]
        latent = self.kv_layernorm(latent)
        q_pe = apply_rope(deinterleave(q_pe), *rope)
        k_pe = apply_rope(deinterleave(k_pe)[:, None, :], *rope)  # [N, 1, dr]
        w_uk, w_uv = self.linear_kv_up_proj.weight.view(self.heads, dn + dv, r).split([dn, dv], dim=1)
        q_latent = per_head(q_nope, w_uk.transpose(1, 2))  # absorbed: [N, heads, r]
        query = torch.cat([q_latent, q_pe], dim=-1) * self.query_scale  # [N, heads, r + dr]
        row = torch.cat([latent[:, None, :], k_pe], dim=-1)  # the cached row: [N, 1, r + dr]
        heads = attn.attend(self.layer, query, row, row)[..., :r]  # [N, heads, r]
        out = self.linear_proj(per_head(heads, w_uv).reshape(n, self.heads * dv))
        if comm.size(Axis.ATP) > 1:
            yield BoundaryPoint(self.layer, Site.ATTN_REDUCE)
            out = comm.all_reduce(out, Axis.ATP, phase)
        return out
