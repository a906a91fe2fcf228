"""Model shape: one frozen dataclass, and the named presets built on it.

The field names follow Megatron-core's `TransformerConfig` where one exists, so a user can read
a preset next to their trainer's arguments. The config describes the *whole* model; how it is
split over ranks lives in `megatron_rollout.model.sharding`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer whose layers are dense (SwiGLU) or MoE."""

    vocab_size: int
    """Rows of the embedding and of the output layer."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Number of transformer layers."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (grouped-query attention); divides `num_attention_heads`."""
    kv_channels: int
    """Head dimension."""
    ffn_hidden_size: int = 0
    """Intermediate size of the dense SwiGLU MLP (dense layers only)."""
    num_moe_experts: int = 0
    """Routed experts per MoE layer; 0 makes every layer dense."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int = 0
    """Intermediate size of one routed expert."""
    moe_shared_expert_intermediate_size: int = 0
    """Intermediate size of the shared expert; 0 means no shared expert."""
    moe_layer_freq: tuple[int, ...] = ()
    """Per layer, 1 for MoE and 0 for dense (Megatron's list form). Empty: every layer is MoE
    when `num_moe_experts` > 0, dense otherwise."""
    moe_renormalize_topk: bool = True
    """Divide the top-k softmax weights by their sum (Qwen3-MoE `norm_topk_prob`, Mixtral)."""
    layernorm_epsilon: float = 1e-6
    """RMSNorm epsilon."""
    rotary_base: float = 10000.0
    """RoPE theta."""
    qk_layernorm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    tie_word_embeddings: bool = False
    """Output layer shares the embedding matrix (no `output_layer.weight`)."""
    max_position_embeddings: int = 4096
    """Longest context the engine accepts."""
    dtype: str = "float32"
    """Parameter and activation dtype: float32, bfloat16 or float16."""

    # -- DeepSeek-V3 family (Megatron's MLATransformerConfig and MoE router fields) -------------
    multi_latent_attention: bool = False
    """Multi-head latent attention (`model.mla`): the KV cache holds one compressed latent and
    one RoPE key per token instead of per-head keys and values."""
    q_lora_rank: int | None = None
    """Rank of the query's low-rank projection (`linear_q_down_proj`); None: one `linear_q_proj`."""
    kv_lora_rank: int = 0
    """Width of the compressed key/value latent (MLA)."""
    qk_head_dim: int = 0
    """Per-head query/key width without position embedding (MLA)."""
    qk_pos_emb_head_dim: int = 0
    """Per-head query width, and the shared key's width, that carry RoPE (MLA)."""
    v_head_dim: int = 0
    """Per-head value width (MLA)."""
    rope_type: str = "rope"
    """"rope" (plain) or "yarn" (YaRN context extension, fields below)."""
    rotary_scaling_factor: float = 1.0
    """YaRN: context extension factor."""
    original_max_position_embeddings: int = 4096
    """YaRN: the context length the model was pre-trained with."""
    beta_fast: float = 32.0
    """YaRN: rotations above which a frequency is kept (extrapolated)."""
    beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is interpolated."""
    mscale: float = 1.0
    """YaRN: numerator coefficient of the cos/sin magnitude scale."""
    mscale_all_dim: float = 0.0
    """YaRN: denominator coefficient of that scale; also scales the softmax (squared)."""
    moe_router_score_function: str = "softmax"
    """"softmax" over all experts, or "sigmoid" per expert (DeepSeek-V3)."""
    moe_router_enable_expert_bias: bool = False
    """A per-expert bias (`router.expert_bias`, fp32) added to the scores for choosing experts
    only; the weights stay the unbiased scores."""
    moe_router_num_groups: int = 0
    """Group-limited routing: experts form this many equal groups; 0 disables it."""
    moe_router_group_topk: int = 0
    """Groups each token may route into (ranked by the sum of their top topk/group_topk scores)."""
    moe_router_topk_scaling_factor: float = 1.0
    """Multiplies the routing weights (DeepSeek's `routed_scaling_factor`)."""
    mtp_num_layers: int = 0
    """Multi-token-prediction layers after the decoder (`model.mtp`, Megatron's `mtp.layers.K`);
    layer K drafts the token K+2 ahead. MoE when the model has experts."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                    "num_query_groups", "kv_channels", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_query_groups ({self.num_query_groups})")
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of {sorted(_DTYPES)}")
        if self.moe_layer_freq and len(self.moe_layer_freq) != self.num_layers:
            raise ValueError(f"moe_layer_freq has {len(self.moe_layer_freq)} entries for "
                             f"{self.num_layers} layers")
        if any(v not in (0, 1) for v in self.moe_layer_freq):
            raise ValueError(f"moe_layer_freq entries must be 0 or 1, got {self.moe_layer_freq}")
        if any(self.is_moe_layer(i) for i in range(self.num_layers)):
            if not 0 < self.moe_router_topk <= self.num_moe_experts:
                raise ValueError(f"moe_router_topk must be in [1, {self.num_moe_experts}], "
                                 f"got {self.moe_router_topk}")
            if self.moe_ffn_hidden_size <= 0:
                raise ValueError("moe_ffn_hidden_size must be positive for MoE layers")
        if any(not self.is_moe_layer(i) for i in range(self.num_layers)) and self.ffn_hidden_size <= 0:
            raise ValueError("ffn_hidden_size must be positive when some layer is dense")
        self._check_deepseek()

    def _check_deepseek(self) -> None:
        if self.multi_latent_attention:
            for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
                if getattr(self, name) <= 0:
                    raise ValueError(f"multi_latent_attention needs a positive {name}, got {getattr(self, name)}")
            if self.qk_pos_emb_head_dim % 2:
                raise ValueError(f"qk_pos_emb_head_dim must be even for RoPE, got {self.qk_pos_emb_head_dim}")
            if self.q_lora_rank is not None and self.q_lora_rank <= 0:
                raise ValueError(f"q_lora_rank must be positive or None, got {self.q_lora_rank}")
        if self.mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers must be >= 0, got {self.mtp_num_layers}")
        if self.rope_type not in ("rope", "yarn"):
            raise ValueError(f"rope_type must be 'rope' or 'yarn', got {self.rope_type!r}")
        if self.rope_type == "yarn" and (self.rotary_scaling_factor <= 0 or self.original_max_position_embeddings <= 0):
            raise ValueError(f"YaRN needs a positive rotary_scaling_factor and original_max_position_embeddings, "
                             f"got {self.rotary_scaling_factor} and {self.original_max_position_embeddings}")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_router_score_function must be 'softmax' or 'sigmoid', "
                             f"got {self.moe_router_score_function!r}")
        if self.moe_router_num_groups:
            g, k = self.moe_router_num_groups, self.moe_router_group_topk
            if (self.num_moe_experts % g or not 0 < k <= g or self.moe_router_topk % k
                    or self.num_moe_experts // g < self.moe_router_topk // k):
                raise ValueError(f"group-limited routing needs num_moe_experts ({self.num_moe_experts}) divisible by "
                                 f"moe_router_num_groups ({g}), 0 < moe_router_group_topk ({k}) <= groups, "
                                 f"moe_router_topk ({self.moe_router_topk}) divisible by moe_router_group_topk, and "
                                 f"at least topk/group_topk experts per group")

    def is_moe_layer(self, layer: int) -> bool:
        """Layers from `num_layers` on are the MTP layers' (MoE when the model has experts)."""
        if self.num_moe_experts == 0:
            return False
        if layer >= self.num_layers:
            return True
        return bool(self.moe_layer_freq[layer]) if self.moe_layer_freq else True

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def kv_cache_dims(self) -> tuple[int, int] | None:
        """(heads, width) of one token's cached KV when it is shared by all query heads (MLA: one
        latent plus RoPE key, keys and values read from the same slots); None for per-group K and V."""
        if self.multi_latent_attention:
            return 1, self.kv_lora_rank + self.qk_pos_emb_head_dim
        return None

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    # The embedded default: a byte-level vocabulary (256 bytes + BOS/EOS/PAD), 8 experts, top-2,
    # one dense layer first as in DeepSeek-style models, 4 KV heads so ATP can be 1, 2 or 4.
    # Milliseconds per step on CPU.
    "tiny-moe": ModelConfig(
        vocab_size=260, hidden_size=64, num_layers=3, num_attention_heads=8, num_query_groups=4,
        kv_channels=8, ffn_hidden_size=128, num_moe_experts=8, moe_router_topk=2,
        moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_layer_freq=(0, 1, 1),
        qk_layernorm=True, max_position_embeddings=8192, rotary_base=10000.0),
    # Qwen3-30B-A3B shapes (random init; GPU benchmarks).
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, num_layers=48, num_attention_heads=32,
        num_query_groups=4, kv_channels=128, num_moe_experts=128, moe_router_topk=8,
        moe_ffn_hidden_size=768, qk_layernorm=True, layernorm_epsilon=1e-6,
        rotary_base=1_000_000.0, max_position_embeddings=40960, dtype="bfloat16"),
}
PRESETS["qwen3-30b-a3b-12l"] = PRESETS["qwen3-30b-a3b"].replace(num_layers=12)
# DeepSeek-V3's widths (MLA, 256 routed experts top-8 in 8 groups pick 4, one shared expert,
# sigmoid scores with a bias, YaRN) in 6 layers, 2 of them dense: 6 x 1 + 4 MoE x 11.5 + 1.9 (embedding
# and output) = about 49B parameters, 98 GB in bf16, so one H200 keeps ~40 GB for KV and graphs. The
# full model has 61 layers, 3 dense. Random init; GPU benchmarks (`benchmarks.mla`).
PRESETS["deepseek-v3"] = ModelConfig(
    vocab_size=129280, hidden_size=7168, num_layers=6, num_attention_heads=128, num_query_groups=128,
    kv_channels=192, ffn_hidden_size=18432, num_moe_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
    moe_shared_expert_intermediate_size=2048, moe_layer_freq=(0, 0, 1, 1, 1, 1), moe_renormalize_topk=True,
    layernorm_epsilon=1e-6, rotary_base=10000.0, max_position_embeddings=163840, dtype="bfloat16",
    multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
    v_head_dim=128, rope_type="yarn", rotary_scaling_factor=40.0, original_max_position_embeddings=4096,
    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_num_groups=8, moe_router_group_topk=4,
    moe_router_topk_scaling_factor=2.5)
# The same architecture at tiny-moe's scale (byte-level vocabulary): milliseconds per step on CPU.
PRESETS["tiny-deepseek"] = ModelConfig(
    vocab_size=260, hidden_size=64, num_layers=3, num_attention_heads=8, num_query_groups=8, kv_channels=24,
    ffn_hidden_size=128, num_moe_experts=8, moe_router_topk=4, moe_ffn_hidden_size=32,
    moe_shared_expert_intermediate_size=32, moe_layer_freq=(0, 1, 1), max_position_embeddings=8192,
    multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
    v_head_dim=16, rope_type="yarn", rotary_scaling_factor=4.0, original_max_position_embeddings=1024,
    mscale_all_dim=1.0, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5)


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}") from None
