"""Megatron-core's tensor-parallel layout of full-named tensors (ETP = 1), as a trainer shards them.

The rollout's own layout (`model.sharding`) splits only attention and the dense MLP over ATP and
keeps embeddings replicated; a Megatron trainer also splits the vocabulary and the shared expert.
Hot swap from such a trainer joins its TP slices with `join_tp` before resharding (rl's Megatron
trainer, the hot-swap benchmark). `transformer_config` is the Megatron `TransformerConfig` of the
native model's architecture, for every Megatron model built to match it (rl's trainer on the local
spec, `benchmarks.te_megatron` on the Transformer Engine spec); `megatron_config` reads it back.
Left out: expert tensor parallelism (ETP > 1).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.router import uses_scored_router

# MLA's projections are column parallel under the local spec (the down projections gather their
# output; the Transformer Engine spec duplicates them instead, which `join_tp` does not handle)
_MLA_COLUMN = ("linear_q_proj.weight", "linear_q_down_proj.weight", "linear_q_up_proj.weight",
               "linear_kv_down_proj.weight", "linear_kv_up_proj.weight")


def tp_split_dim(name: str) -> int | None:
    """The dimension Megatron splits `name` along over TP (ETP = 1: routed experts are whole), or None."""
    if ".experts.local_experts." in name or name.endswith("layernorm.weight") or name.endswith("router.weight"):
        return None
    if name.endswith(("linear_qkv.weight", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")
                     + _MLA_COLUMN):
        return 0  # column parallel (and the vocab-parallel embedding)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1  # row parallel
    return None


def join_tp(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Full tensor from TP rank r's slices `parts[r]` (a SwiGLU fc1 slice is [gate_r; up_r])."""
    dim = tp_split_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=dim)


def transformer_config(cfg: ModelConfig, **overrides: Any):
    """Megatron `TransformerConfig` of the same architecture as the native model."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = cfg.num_moe_experts > 0
    kwargs: dict[str, Any] = dict(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels,
        ffn_hidden_size=cfg.ffn_hidden_size or cfg.moe_ffn_hidden_size, normalization="RMSNorm",
        layernorm_epsilon=cfg.layernorm_epsilon, qk_layernorm=cfg.qk_layernorm, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, params_dtype=cfg.torch_dtype,
        bf16=cfg.dtype == "bfloat16", fp16=cfg.dtype == "float16", use_cpu_initialization=True,
        sequence_parallel=False, hidden_dropout=0.0, attention_dropout=0.0)
    if moe:
        kwargs.update(
            num_moe_experts=cfg.num_moe_experts, moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size or None,
            moe_layer_freq=list(cfg.moe_layer_freq) if cfg.moe_layer_freq else 1,
            # top-k of the full softmax, renormalised == softmax over the top-k logits (Megatron default)
            moe_router_pre_softmax=not cfg.moe_renormalize_topk, moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    if moe and uses_scored_router(cfg):
        kwargs.update(
            moe_router_score_function=cfg.moe_router_score_function,
            moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
            moe_router_num_groups=cfg.moe_router_num_groups or None,
            moe_router_group_topk=cfg.moe_router_group_topk or None,
            moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor, moe_router_pre_softmax=False,
            moe_router_dtype="fp32")
    kwargs.update(overrides)
    if not cfg.multi_latent_attention:
        return TransformerConfig(**kwargs)
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    # Megatron builds MLA's latent norms only with qk_layernorm; DeepSeek has them always
    kwargs.update(qk_layernorm=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                  qk_head_dim=cfg.qk_head_dim, qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim,
                  v_head_dim=cfg.v_head_dim, rope_type=cfg.rope_type, rotary_base=cfg.rotary_base,
                  rotary_scaling_factor=cfg.rotary_scaling_factor, beta_fast=cfg.beta_fast, beta_slow=cfg.beta_slow,
                  original_max_position_embeddings=cfg.original_max_position_embeddings, mscale=cfg.mscale,
                  mscale_all_dim=cfg.mscale_all_dim)
    return MLATransformerConfig(**{k: v for k, v in kwargs.items() if k != "kv_channels"} | overrides)
