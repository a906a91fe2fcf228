"""The native model's parameters are Megatron-core `GPTModel`'s, name for name and shape for shape.

Megatron builds on CPU in a one-process gloo world; its forward needs CUDA, so logits parity is a
GPU test. Megatron's state_dict also holds `*._extra_state` entries (None under the local spec,
Transformer Engine's FP8 metadata otherwise); they carry no weights and are the only keys ignored.
"""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.nn.functional as F

from megatron_rollout.model.config import PRESETS, ModelConfig
from megatron_rollout.model.sharding import full_shapes
from megatron_rollout.model.transformer import MoETransformer

megatron = pytest.importorskip("megatron.core")
dist = torch.distributed

CONFIGS = {
    # mixed dense/MoE, shared expert, qk norm, GQA
    "tiny-moe": PRESETS["tiny-moe"],
    # every layer MoE, no shared expert, tied embeddings, one KV head, no qk norm, unnormalised top-k
    "all-moe-tied": PRESETS["tiny-moe"].replace(
        moe_layer_freq=(), moe_shared_expert_intermediate_size=0, tie_word_embeddings=True, num_query_groups=1,
        qk_layernorm=False, moe_renormalize_topk=False, num_layers=2),
}


@pytest.fixture(scope="module")
def gloo_world():
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1, expert_tensor_parallel_size=1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def build_megatron(cfg: ModelConfig):
    """A Megatron GPTModel for `cfg` (local spec; needs an initialised parallel_state)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = cfg.num_moe_experts > 0
    tc = TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels, ffn_hidden_size=cfg.ffn_hidden_size or 1,
        num_moe_experts=cfg.num_moe_experts or None, moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size if moe else None,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size or None,
        moe_layer_freq=list(cfg.moe_layer_freq) or 1,
        # pre-softmax (softmax over all experts, then top-k) keeps the weights unnormalised
        moe_router_pre_softmax=not cfg.moe_renormalize_topk, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather",
        use_cpu_initialization=True, add_bias_linear=False, sequence_parallel=False, normalization="RMSNorm",
        layernorm_epsilon=cfg.layernorm_epsilon, gated_linear_unit=True, activation_func=F.silu,
        qk_layernorm=cfg.qk_layernorm, params_dtype=cfg.torch_dtype, bf16=cfg.dtype == "bfloat16",
        hidden_dropout=0.0, attention_dropout=0.0)
    # The decoder block spec (not one layer spec) is what honours a mixed moe_layer_freq.
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                    max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
                    rotary_base=int(cfg.rotary_base), share_embeddings_and_output_weights=cfg.tie_word_embeddings)


def megatron_weights(gpt) -> dict[str, torch.Tensor]:
    return {k: v for k, v in gpt.state_dict().items() if not k.endswith("._extra_state")}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_names_and_shapes_equal_megatron(gloo_world, name):
    cfg = CONFIGS[name]
    gpt = build_megatron(cfg)
    extra = {k for k in gpt.state_dict() if k.endswith("._extra_state")}
    assert all(gpt.state_dict()[k] is None for k in extra)  # nothing with weights is ignored
    theirs = {k: tuple(v.shape) for k, v in megatron_weights(gpt).items()}
    assert theirs == full_shapes(cfg)
    native = MoETransformer(cfg)
    assert {k: tuple(v.shape) for k, v in native.state_dict().items()} == theirs
    # Megatron's own random weights load strictly, and land where the names say.
    native.load_state_dict(megatron_weights(gpt), strict=True)
    probe = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert torch.equal(native.get_parameter(probe), gpt.get_parameter(probe))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_equal_megatron_on_cuda(gloo_world, name, monkeypatch):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_utils

    # megatron-core 0.16.1 without Transformer Engine: the router reads `te_general_gemm`, which is
    # only defined when TE imports (NameError otherwise); None selects its plain-torch matmul.
    monkeypatch.setattr(moe_utils, "te_general_gemm", getattr(moe_utils, "te_general_gemm", None), raising=False)

    cfg = CONFIGS[name]
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)  # Megatron's attention forks this CUDA RNG state even without dropout
    gpt = build_megatron(cfg)
    with torch.no_grad():  # larger than Megatron's 0.02 init so that routing decisions are not ties
        for k, p in gpt.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if k.endswith("layernorm.weight") else 0.2 * torch.randn_like(p))
    gpt = gpt.cuda().eval()
    native = MoETransformer(cfg, device="cuda")
    native.load_state_dict(megatron_weights(gpt), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1)).cuda()
    positions = torch.arange(ids.shape[1], device="cuda")[None].expand_as(ids)
    mask = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool, device="cuda").triu(1)  # True = hidden
    with torch.no_grad():
        theirs = gpt(ids, positions, mask).float()  # [B, T, V]
        ours = native(ids).float()
    assert theirs.abs().max() > 1.0
    diff = (theirs - ours).abs().max().item()
    print(f"\n[{name}] max |logit diff| vs Megatron GPTModel on CUDA: {diff:.2e}")
    assert diff < 1e-3
