"""The rollout's `ModelConfig` read from a Megatron-core `TransformerConfig` (and its `GPTModel`).

The inverse of `megatron_layout.transformer_config`: a trainer's config is the one source of the
architecture, so nothing is written twice by hand. Every field the native model depends on is read;
every Megatron option the native model does not implement is checked and refused by name, with the
value to build with instead. Works with megatron-core 0.16 and 0.19 (fields absent from one version
read as their off default). DeepSeek-V3's routing (sigmoid scores, expert bias, groups, scaling) is
read. Left out: multi-latent attention, MTP, learned or YaRN positions, partial or interleaved RoPE,
biases, LayerNorm, non-SwiGLU MLPs.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_rollout.model.config import ModelConfig

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

_REFUSED: tuple[tuple[str, Any, str], ...] = (  # (field, the value the native model implements, what it is)
    ("multi_latent_attention", False, "multi-latent attention"),
    ("add_bias_linear", False, "linear biases"),
    ("add_qkv_bias", False, "QKV biases"),
    ("gated_linear_unit", True, "the SwiGLU MLP (gate and up fused in linear_fc1)"),
    ("normalization", "RMSNorm", "RMSNorm"),
    ("rotary_interleaved", False, "rotate-half RoPE"),
    ("qk_l2_norm", False, "RMSNorm (not L2) query/key norms"),
    ("softmax_scale", None, "1/sqrt(kv_channels) attention scaling"),
    ("mtp_num_layers", None, "no multi-token-prediction layers"),
    ("moe_shared_expert_gate", False, "an ungated shared expert"),
    ("moe_expert_capacity_factor", None, "dropless MoE"),
    ("num_layers_in_first_pipeline_stage", None, "one pipeline stage"),
)


def _refusals(tc: Any) -> list[str]:
    bad = [f"{field}={getattr(tc, field)!r} (the rollout implements {what}: build with {field}={want!r})"
           for field, want, what in _REFUSED if hasattr(tc, field) and getattr(tc, field) != want]
    if getattr(tc, "activation_func", F.silu) is not F.silu:
        bad.append(f"activation_func={tc.activation_func!r} (the rollout implements SiLU: build with F.silu)")
    if getattr(tc, "pipeline_model_parallel_size", 1) != 1:
        bad.append(f"pipeline_model_parallel_size={tc.pipeline_model_parallel_size} (the rollout builds from one "
                   "stage holding every layer: gather the stages' weights and use update_weights)")
    if getattr(tc, "expert_tensor_parallel_size", 1) not in (None, 1):
        bad.append(f"expert_tensor_parallel_size={tc.expert_tensor_parallel_size} (routed experts must be whole: "
                   "build with expert_tensor_parallel_size=1)")
    return bad


def _moe_layer_freq(tc: Any) -> tuple[int, ...]:
    """Megatron's `moe_layer_freq` (an int N: every N-th layer from 0 is MoE; or a 0/1 list) as a tuple."""
    if not tc.num_moe_experts:
        return ()
    freq = tc.moe_layer_freq
    pattern = tuple(int(i % freq == 0) for i in range(tc.num_layers)) if isinstance(freq, int) else tuple(freq)
    return () if all(pattern) else pattern


def model_config_from_megatron(tc: Any, vocab_size: int, max_position_embeddings: int, *,
                               rotary_base: float = 10000.0, tie_word_embeddings: bool = False) -> ModelConfig:
    """The `ModelConfig` of a Megatron model built from `tc` (a `TransformerConfig`); the other
    arguments are `GPTModel`'s constructor arguments of the same names (`max_sequence_length` is
    `max_position_embeddings`, `share_embeddings_and_output_weights` is `tie_word_embeddings`).
    Raises ValueError naming every option the rollout cannot run, with the value to build with."""
    bad = _refusals(tc)
    dtype = _DTYPE_NAMES.get(tc.params_dtype)
    if dtype is None:
        bad.append(f"params_dtype={tc.params_dtype} (build with float32, bfloat16 or float16)")
    if bad:
        raise ValueError("the Megatron TransformerConfig has options the rollout model does not implement: "
                         + "; ".join(bad))
    moe = bool(tc.num_moe_experts)
    freq = _moe_layer_freq(tc)
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=tc.hidden_size, num_layers=tc.num_layers,
        num_attention_heads=tc.num_attention_heads, num_query_groups=tc.num_query_groups or tc.num_attention_heads,
        kv_channels=tc.kv_channels or tc.hidden_size // tc.num_attention_heads,
        ffn_hidden_size=tc.ffn_hidden_size,
        num_moe_experts=tc.num_moe_experts or 0, moe_router_topk=tc.moe_router_topk if moe else 2,
        moe_ffn_hidden_size=(tc.moe_ffn_hidden_size or tc.ffn_hidden_size) if moe else 0,
        moe_shared_expert_intermediate_size=(tc.moe_shared_expert_intermediate_size or 0) if moe else 0,
        moe_layer_freq=freq,
        # Megatron: pre-softmax = softmax over all experts then top-k (unnormalised); otherwise
        # softmax over the top-k logits, which equals the renormalised top-k of the full softmax.
        moe_renormalize_topk=not tc.moe_router_pre_softmax,
        moe_router_score_function=getattr(tc, "moe_router_score_function", "softmax"),
        moe_router_enable_expert_bias=bool(getattr(tc, "moe_router_enable_expert_bias", False)),
        moe_router_num_groups=getattr(tc, "moe_router_num_groups", None) or 0,
        moe_router_group_topk=getattr(tc, "moe_router_group_topk", None) or 0,
        moe_router_topk_scaling_factor=getattr(tc, "moe_router_topk_scaling_factor", None) or 1.0,
        layernorm_epsilon=tc.layernorm_epsilon, rotary_base=float(rotary_base), qk_layernorm=tc.qk_layernorm,
        tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings, dtype=dtype)


def model_config_of(gpt: Any) -> ModelConfig:
    """`model_config_from_megatron` for a built `GPTModel`, reading its own constructor arguments.
    Raises ValueError for a position embedding other than full RoPE, or a pipeline stage that is
    not the whole model."""
    kind = getattr(gpt, "position_embedding_type", None)
    if kind != "rope" or getattr(gpt, "rotary_percent", 1.0) != 1.0:
        raise ValueError(f"the GPTModel uses position_embedding_type={kind!r}, rotary_percent="
                         f"{getattr(gpt, 'rotary_percent', None)}; the rollout implements full RoPE: build with "
                         "position_embedding_type='rope', rotary_percent=1.0")
    if not (getattr(gpt, "pre_process", True) and getattr(gpt, "post_process", True)):
        raise ValueError("the GPTModel is one pipeline stage (pre_process/post_process False); the rollout "
                         "builds from a model holding every layer")
    cfg = model_config_from_megatron(gpt.config, gpt.vocab_size, gpt.max_sequence_length,
                                     rotary_base=gpt.rotary_base,
                                     tie_word_embeddings=gpt.share_embeddings_and_output_weights)
    _check_rope(gpt, cfg)
    return cfg


def _check_rope(gpt: Any, cfg: ModelConfig) -> None:
    """The rotary embedding the GPTModel runs has `cfg.rotary_base`'s frequencies: newer megatron-core
    reports `config.rotary_base` while building the embedding from its constructor argument, and
    RoPE scaling changes the frequencies without changing the base."""
    inv_freq = getattr(getattr(gpt, "rotary_pos_emb", None), "inv_freq", None)
    if inv_freq is None:
        return
    d = cfg.kv_channels
    want = 1.0 / (cfg.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    got = inv_freq.detach().float().cpu()
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-5, atol=0):
        raise ValueError(f"the GPTModel's rotary embedding does not run rotary_base={cfg.rotary_base:g} unscaled "
                         f"(inverse frequencies {got[:3].tolist()}..., expected {want[:3].tolist()}...): build it "
                         "with rope_scaling=False and the rotary_base its config reports")
