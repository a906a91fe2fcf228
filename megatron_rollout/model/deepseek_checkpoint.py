"""The DeepSeek-V3 family's Hugging Face checkpoints (`DeepseekV3ForCausalLM`) in Megatron names.

`model.checkpoint` owns reading, validating and writing; this module says what is DeepSeek's:
the config mapping (MLA widths, YaRN, sigmoid group-limited routing, first dense layers, shared
experts) and which HF tensor makes each MLA, router-bias and shared-expert tensor.

HF <-> Megatron, per layer (`self_attn.` -> `self_attention.`):
  q_a_proj / q_a_layernorm / q_b_proj (q_proj)    -> linear_q_down_proj / q_layernorm / linear_q_up_proj (linear_q_proj)
  kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj -> linear_kv_down_proj / kv_layernorm / linear_kv_up_proj
  o_proj                                          -> linear_proj
  mlp.gate.e_score_correction_bias                -> mlp.router.expert_bias
  mlp.shared_experts.{gate,up,down}_proj          -> mlp.shared_experts.linear_fc1 (gate; up) / linear_fc2
All are plain copies: both sides lay rows out per head, and both rotate DeepSeek's interleaved RoPE
pairs the same way.

MTP layers are stored as decoder layers `model.layers.<num_hidden_layers + K>` with `enorm`,
`hnorm`, `eh_proj` and `shared_head.norm` besides the usual layer tensors; `load_pretrained` loads
as many as the checkpoint holds (`with_mtp_layers`; transformers itself has no MTP modules).

Left out (refused with an error, not approximated): `rope_interleave=False` checkpoints, an explicit
YaRN `attention_factor`, and group scores other than the top-2 sum transformers uses.
The latent norms use `rms_norm_eps` (transformers fixes 1e-6, DeepSeek's own value).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Collection

import torch

from megatron_rollout.model.config import ModelConfig

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _refuse(what: str) -> ValueError:
    return ValueError(f"{DEEPSEEK_V3}: {what}")


def _rope_fields(c) -> dict:
    params = dict(getattr(c, "rope_parameters", None) or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = params.get("rope_theta", getattr(c, "rope_theta", None))
    if theta is None:
        raise _refuse("config.json gives no rope_theta")
    if kind == "default":
        return dict(rotary_base=float(theta), rope_type="rope")
    if kind != "yarn":
        raise _refuse(f"RoPE type {kind!r} is not supported (only 'default' and 'yarn')")
    if params.get("attention_factor") is not None:
        raise _refuse(f"an explicit YaRN attention_factor ({params['attention_factor']}) is not supported; "
                      "remove it so the factor follows from mscale and mscale_all_dim")
    if params.get("truncate", True) is False:
        raise _refuse("YaRN with truncate=False is not supported")
    orig = params.get("original_max_position_embeddings")
    if not orig:
        raise _refuse("YaRN rope_parameters need original_max_position_embeddings")
    factor = params.get("factor") or c.max_position_embeddings / orig
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # transformers then scales cos/sin by mscale(factor, 1)
        if mscale_all_dim:
            raise _refuse(f"YaRN mscale={mscale} with mscale_all_dim={mscale_all_dim} is not supported")
        mscale, mscale_all_dim = 1.0, 0.0
    return dict(rotary_base=float(theta), rope_type="yarn", rotary_scaling_factor=float(factor),
                original_max_position_embeddings=int(orig), beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1), mscale=float(mscale),
                mscale_all_dim=float(mscale_all_dim))


def deepseek_config_from_hf(c) -> ModelConfig:
    """The `ModelConfig` of a transformers `DeepseekV3Config`."""
    if getattr(c, "hidden_act", "silu") != "silu":
        raise _refuse(f"hidden_act {c.hidden_act!r} is not supported (only SwiGLU with 'silu')")
    if getattr(c, "attention_bias", False):
        raise _refuse("attention_bias=True is not supported (the native model has no biases)")
    if getattr(c, "rope_interleave", True) is False:
        raise _refuse("rope_interleave=False is not supported (Megatron's MLA rotates interleaved pairs)")
    layers, dense = c.num_hidden_layers, min(c.first_k_dense_replace or 0, c.num_hidden_layers)
    groups, group_topk, topk = c.n_group or 1, c.topk_group or 1, c.num_experts_per_tok
    if groups > 1 and topk // group_topk != 2:
        raise _refuse(f"group-limited routing ranks groups by their top-2 sum in transformers, Megatron by their "
                      f"top num_experts_per_tok/topk_group = {topk}/{group_topk}; these differ here")
    moe = (0,) * dense + (1,) * (layers - dense)
    dtype = getattr(c, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, torch.float32)
    return ModelConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=layers,
        num_attention_heads=c.num_attention_heads, num_query_groups=c.num_attention_heads,
        kv_channels=c.qk_nope_head_dim + c.qk_rope_head_dim, ffn_hidden_size=c.intermediate_size if dense else 0,
        num_moe_experts=c.n_routed_experts if any(moe) else 0, moe_router_topk=topk,
        moe_ffn_hidden_size=c.moe_intermediate_size,
        moe_shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
        moe_layer_freq=moe if dense and any(moe) else (), moe_renormalize_topk=bool(c.norm_topk_prob),
        layernorm_epsilon=float(c.rms_norm_eps), tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        max_position_embeddings=c.max_position_embeddings, dtype=_DTYPE_NAMES.get(dtype, "float32"),
        multi_latent_attention=True, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
        qk_head_dim=c.qk_nope_head_dim, qk_pos_emb_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups if groups > 1 else 0, moe_router_group_topk=group_topk if groups > 1 else 0,
        moe_router_topk_scaling_factor=float(c.routed_scaling_factor), **_rope_fields(c))


def deepseek_hf_config(cfg: ModelConfig):
    """The transformers `DeepseekV3Config` of `cfg` (raises when DeepSeek-V3 cannot express it)."""
    import transformers

    moe = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    dense = moe.index(True) if any(moe) else cfg.num_layers
    shared, e_ffn = cfg.moe_shared_expert_intermediate_size, cfg.moe_ffn_hidden_size
    problems = []
    if not cfg.multi_latent_attention:
        problems.append("multi_latent_attention=False")
    if moe != [False] * dense + [True] * (cfg.num_layers - dense):
        problems.append(f"MoE layers {moe} are not all after the first dense ones")
    if cfg.moe_router_score_function != "sigmoid" or not cfg.moe_router_enable_expert_bias:
        problems.append("routing is not sigmoid scores with an expert bias")
    if e_ffn and shared % e_ffn:
        problems.append(f"shared expert size {shared} is not a multiple of moe_ffn_hidden_size {e_ffn}")
    if cfg.qk_layernorm:
        problems.append("qk_layernorm=True (per-head q/k norms)")
    if problems:
        raise ValueError(f"cannot express this ModelConfig as {DEEPSEEK_V3}: " + "; ".join(problems))
    rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=cfg.rotary_scaling_factor, beta_fast=cfg.beta_fast,
                    beta_slow=cfg.beta_slow, mscale=cfg.mscale, mscale_all_dim=cfg.mscale_all_dim,
                    original_max_position_embeddings=cfg.original_max_position_embeddings)
    return transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        intermediate_size=cfg.ffn_hidden_size or e_ffn, moe_intermediate_size=e_ffn,
        n_shared_experts=shared // e_ffn if e_ffn else 0, n_routed_experts=cfg.num_moe_experts or 1,
        num_experts_per_tok=cfg.moe_router_topk, n_group=cfg.moe_router_num_groups or 1,
        topk_group=cfg.moe_router_group_topk or 1, first_k_dense_replace=dense,
        routed_scaling_factor=cfg.moe_router_topk_scaling_factor, norm_topk_prob=cfg.moe_renormalize_topk,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
        qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim, rope_interleave=True,
        rope_parameters=rope, hidden_act="silu", rms_norm_eps=cfg.layernorm_epsilon,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        num_nextn_predict_layers=cfg.mtp_num_layers, architectures=[DEEPSEEK_V3], dtype=cfg.dtype)


# The plan's two callables (see `checkpoint._plan`): `part(hf_name, shape)` declares an HF tensor,
# `put(megatron_name, kind, *parts)` says how a Megatron tensor is made of them.
Part = Callable[..., object]
Put = Callable[..., None]


def mla_recipes(cfg: ModelConfig, m: str, p: str, part: Part, put: Put) -> None:
    """Layer prefix `m` (Megatron) / `p` (HF): the attention's tensors."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    r, dr, dn, dv = cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim, cfg.qk_head_dim, cfg.v_head_dim
    a, s = p + "self_attn.", m + "self_attention."
    if cfg.q_lora_rank is None:
        put(s + "linear_q_proj.weight", "copy", part(a + "q_proj.weight", (heads * (dn + dr), h)))
    else:
        put(s + "linear_q_down_proj.weight", "copy", part(a + "q_a_proj.weight", (cfg.q_lora_rank, h)))
        put(s + "q_layernorm.weight", "copy", part(a + "q_a_layernorm.weight", (cfg.q_lora_rank,)))
        put(s + "linear_q_up_proj.weight", "copy", part(a + "q_b_proj.weight", (heads * (dn + dr), cfg.q_lora_rank)))
    put(s + "linear_kv_down_proj.weight", "copy", part(a + "kv_a_proj_with_mqa.weight", (r + dr, h)))
    put(s + "kv_layernorm.weight", "copy", part(a + "kv_a_layernorm.weight", (r,)))
    put(s + "linear_kv_up_proj.weight", "copy", part(a + "kv_b_proj.weight", (heads * (dn + dv), r)))
    put(s + "linear_proj.weight", "copy", part(a + "o_proj.weight", (h, heads * dv)))


def moe_extra_recipes(cfg: ModelConfig, m: str, block: str, part: Part, put: Put) -> None:
    """An MoE layer's router bias and shared expert; `block` is the HF MoE module's prefix."""
    if cfg.moe_router_enable_expert_bias:
        put(m + "mlp.router.expert_bias", "copy", part(block + "gate.e_score_correction_bias", (cfg.num_moe_experts,)))
    f, h = cfg.moe_shared_expert_intermediate_size, cfg.hidden_size
    if f:
        sh = block + "shared_experts."
        put(m + "mlp.shared_experts.linear_fc1.weight", "gate_up", part(sh + "gate_proj.weight", (f, h)),
            part(sh + "up_proj.weight", (f, h)))
        put(m + "mlp.shared_experts.linear_fc2.weight", "copy", part(sh + "down_proj.weight", (h, f)))


def mtp_layer_prefixes(cfg: ModelConfig) -> list[tuple[int, str, str]]:
    """(layer, Megatron prefix, HF prefix) of the MTP layers' transformer layers: DeepSeek stores
    MTP layer K as decoder layer num_hidden_layers + K."""
    return [(cfg.num_layers + k, f"mtp.layers.{k}.transformer_layer.", f"model.layers.{cfg.num_layers + k}.")
            for k in range(cfg.mtp_num_layers)]


def mtp_recipes(cfg: ModelConfig, part: Part, put: Put) -> None:
    """The MTP layers' own tensors besides their transformer layer (`shared_head.norm` is Megatron's
    `final_layernorm`; their `embed_tokens` and `shared_head.head` repeat the model's and are not read)."""
    h = cfg.hidden_size
    for k in range(cfg.mtp_num_layers):
        m, p = f"mtp.layers.{k}.", f"model.layers.{cfg.num_layers + k}."
        put(m + "enorm.weight", "copy", part(p + "enorm.weight", (h,)))
        put(m + "hnorm.weight", "copy", part(p + "hnorm.weight", (h,)))
        put(m + "eh_proj.weight", "copy", part(p + "eh_proj.weight", (h, 2 * h)))
        put(m + "final_layernorm.weight", "copy", part(p + "shared_head.norm.weight", (h,)))


def with_mtp_layers(cfg: ModelConfig, names: Collection[str]) -> ModelConfig:
    """`cfg` with as many MTP layers as the checkpoint holds (transformers' config counts them in
    `num_nextn_predict_layers` whether or not the weights were saved)."""
    k = 0
    while f"model.layers.{cfg.num_layers + k}.eh_proj.weight" in names:
        k += 1
    return cfg.replace(mtp_num_layers=k)


def ignored_names(names: Collection[str], cfg: ModelConfig) -> set[str]:
    """Tensors a DeepSeek-V3 checkpoint may carry that are not loaded: MTP layers beyond
    `cfg.mtp_num_layers`, and the loaded ones' copies of the embedding and output layer."""
    layer = re.compile(r"^model\.layers\.(\d+)\.")
    first_unloaded = cfg.num_layers + cfg.mtp_num_layers
    copies = {f"model.layers.{cfg.num_layers + k}.{n}" for k in range(cfg.mtp_num_layers)
              for n in ("embed_tokens.weight", "shared_head.head.weight")}
    return {n for n in names if (hit := layer.match(n)) and int(hit.group(1)) >= first_unloaded} | (copies & set(names))
