"""Full (unsharded) parameter names and shapes, and how each maps onto one rank's shard.

Full names are Megatron's with *global* expert numbers (`local_experts.E` for expert E), as in a
single-rank Megatron checkpoint; a rank with EP > 1 holds experts `first..first+num_local-1` and
names them `local_experts.0..` locally, as Megatron does. Attention and dense MLPs split over
ATP; routed experts over EP; everything else is replicated.
"""
from __future__ import annotations

import re

import torch

from megatron_rollout.comm.facade import Shard
from megatron_rollout.model.config import ModelConfig

_EXPERT = re.compile(r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.mlp\.experts\.local_experts\.)"
                     r"(\d+)(\..*)$")


def layer_shapes(cfg: ModelConfig, i: int, p: str) -> dict[str, tuple[int, ...]]:
    """Transformer layer `i`'s parameters under the name prefix `p`."""
    h, d = cfg.hidden_size, cfg.kv_channels
    shapes: dict[str, tuple[int, ...]] = {}
    shapes[p + "input_layernorm.weight"] = (h,)
    if cfg.multi_latent_attention:
        shapes.update(mla_shapes(cfg, p + "self_attention."))
    else:
        shapes[p + "self_attention.linear_qkv.weight"] = (cfg.num_query_groups * (cfg.heads_per_group + 2) * d, h)
        shapes[p + "self_attention.linear_proj.weight"] = (h, cfg.num_attention_heads * d)
    if cfg.qk_layernorm and not cfg.multi_latent_attention:
        shapes[p + "self_attention.q_layernorm.weight"] = (d,)
        shapes[p + "self_attention.k_layernorm.weight"] = (d,)
    shapes[p + "pre_mlp_layernorm.weight"] = (h,)
    if cfg.is_moe_layer(i):
        shapes[p + "mlp.router.weight"] = (cfg.num_moe_experts, h)
        if cfg.moe_router_enable_expert_bias:
            shapes[p + "mlp.router.expert_bias"] = (cfg.num_moe_experts,)
        for e in range(cfg.num_moe_experts):
            shapes[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (2 * cfg.moe_ffn_hidden_size, h)
            shapes[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, cfg.moe_ffn_hidden_size)
        if cfg.moe_shared_expert_intermediate_size:
            f = cfg.moe_shared_expert_intermediate_size
            shapes[p + "mlp.shared_experts.linear_fc1.weight"] = (2 * f, h)
            shapes[p + "mlp.shared_experts.linear_fc2.weight"] = (h, f)
    else:
        shapes[p + "mlp.linear_fc1.weight"] = (2 * cfg.ffn_hidden_size, h)
        shapes[p + "mlp.linear_fc2.weight"] = (h, cfg.ffn_hidden_size)
    return shapes


def full_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the unsharded model, in module order."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        shapes.update(layer_shapes(cfg, i, f"decoder.layers.{i}."))
    shapes["decoder.final_layernorm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["output_layer.weight"] = (cfg.vocab_size, h)
    for k in range(cfg.mtp_num_layers):  # Megatron's MultiTokenPredictionLayer
        p = f"mtp.layers.{k}."
        shapes.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h)})
        shapes.update(layer_shapes(cfg, cfg.num_layers + k, p + "transformer_layer."))
        shapes[p + "final_layernorm.weight"] = (h,)
    return shapes


def mla_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Multi-latent attention's parameters (Megatron's MLASelfAttention, local spec)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    r, dr, dn, dv = cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim, cfg.qk_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        shapes = {prefix + "linear_q_proj.weight": (heads * (dn + dr), h)}
    else:
        shapes = {prefix + "linear_q_down_proj.weight": (cfg.q_lora_rank, h),
                  prefix + "linear_q_up_proj.weight": (heads * (dn + dr), cfg.q_lora_rank),
                  prefix + "q_layernorm.weight": (cfg.q_lora_rank,)}
    shapes.update({prefix + "linear_kv_down_proj.weight": (r + dr, h),
                   prefix + "linear_kv_up_proj.weight": (heads * (dn + dv), r),
                   prefix + "kv_layernorm.weight": (r,),
                   prefix + "linear_proj.weight": (h, heads * dv)})
    return shapes


# MLA tensors whose rows are whole heads: a contiguous row block is one ATP shard
_HEAD_ROWS = ("self_attention.linear_q_proj.weight", "self_attention.linear_q_up_proj.weight",
              "self_attention.linear_kv_up_proj.weight")


def local_name(full_name: str, cfg: ModelConfig, shard: Shard) -> str | None:
    """This rank's name for a full parameter, or None when another rank holds it."""
    m = _EXPERT.match(full_name)
    if not m:
        return full_name
    per_rank = cfg.num_moe_experts // shard.ep_size
    expert = int(m.group(2))
    if expert // per_rank != shard.ep_rank:
        return None
    return f"{m.group(1)}{expert % per_rank}{m.group(3)}"


def _chunk(t: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    return t.chunk(parts, dim=dim)[rank]


def shard_tensor(full_name: str, full: torch.Tensor, cfg: ModelConfig, shard: Shard) -> torch.Tensor:
    """The slice of a full tensor that this rank holds (call only where `local_name` is not None)."""
    r, p = shard.atp_rank, shard.atp_size
    if p == 1:
        return full
    if full_name.endswith(("self_attention.linear_qkv.weight",) + _HEAD_ROWS):
        return _chunk(full, 0, r, p)  # per-group (per-head) layout: a contiguous block of groups
    if full_name.endswith("self_attention.linear_proj.weight"):
        return _chunk(full, 1, r, p)
    dense = ".experts." not in full_name and "shared_experts" not in full_name
    if full_name.endswith("mlp.linear_fc1.weight") and dense:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([_chunk(gate, 0, r, p), _chunk(up, 0, r, p)])
    if full_name.endswith("mlp.linear_fc2.weight") and dense:
        return _chunk(full, 1, r, p)
    return full


def local_shapes(cfg: ModelConfig, shard: Shard) -> dict[str, tuple[int, ...]]:
    """Names and shapes this rank holds (what its `state_dict()` must contain)."""
    out = {}
    for name, shape in full_shapes(cfg).items():
        local = local_name(name, cfg, shard)
        if local is not None:
            out[local] = tuple(shard_tensor(name, torch.empty(shape, device="meta"), cfg, shard).shape)
    return out


def full_name(local: str, cfg: ModelConfig, shard: Shard) -> str:
    """Inverse of `local_name`: the full (global-expert) name of this rank's parameter."""
    m = _EXPERT.match(local)
    if not m:
        return local
    per_rank = cfg.num_moe_experts // shard.ep_size
    return f"{m.group(1)}{shard.ep_rank * per_rank + int(m.group(2))}{m.group(3)}"


def unshard_tensor(full_name_: str, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """Inverse of `shard_tensor` over ATP: `parts[r]` is ATP rank r's slice of the full tensor."""
    if len(parts) == 1:
        return parts[0]
    dense = ".experts." not in full_name_ and "shared_experts" not in full_name_
    if full_name_.endswith(("self_attention.linear_qkv.weight",) + _HEAD_ROWS):
        return torch.cat(parts, dim=0)
    if full_name_.endswith("self_attention.linear_proj.weight") or \
            (dense and full_name_.endswith("mlp.linear_fc2.weight")):
        return torch.cat(parts, dim=1)
    if dense and full_name_.endswith("mlp.linear_fc1.weight"):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return parts[0]  # replicated over ATP
