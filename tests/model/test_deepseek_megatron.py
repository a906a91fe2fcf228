"""DeepSeek-V3's native parameters are Megatron-core's MLA `GPTModel`'s, name for name and shape for shape.

Megatron 0.16's MLA on the local (non-Transformer-Engine) spec does not build on a CPU-only torch
as it stands: its core attention is Transformer Engine's (the local `DotProductAttention` refuses
MLA's arguments), its rotary tables ask CUDA for a device, and it tests `isinstance` against TE's
`TELinear` when TE is absent. Those three have no parameters; the test stands them in so the rest,
every parameter, is Megatron's own.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.model import checkpoint as ckpt
from megatron_rollout.model.sharding import full_shapes
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.weights.megatron_layout import transformer_config
from tests.model.test_deepseek import deepseek_config
from tests.model.test_megatron_names import gloo_world, megatron_weights  # noqa: F401 (fixture)

megatron = pytest.importorskip("megatron.core")


class _NoCoreAttention(torch.nn.Module):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__()


def build_megatron_mla(cfg, monkeypatch):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer import multi_latent_attention

    monkeypatch.setattr(multi_latent_attention, "HAVE_TE", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    tc = transformer_config(cfg, moe_router_load_balancing_type="none")
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = _NoCoreAttention
    return GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                    max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
                    rotary_base=int(cfg.rotary_base), share_embeddings_and_output_weights=cfg.tie_word_embeddings)


@pytest.mark.parametrize("variant", ["yarn-grouped", "plain-qproj"])
def test_names_and_shapes_equal_megatron(gloo_world, monkeypatch, variant):  # noqa: F811
    cfg = ckpt.config_from_hf(deepseek_config(variant))
    # YaRN's tables are built on CUDA at construction; the names do not depend on the RoPE type
    gpt = build_megatron_mla(cfg.replace(rope_type="rope"), monkeypatch)
    theirs = {k: tuple(v.shape) for k, v in megatron_weights(gpt).items()}
    ours = {k: tuple(v.shape) for k, v in MoETransformer(cfg).state_dict().items()}
    assert ours == theirs == full_shapes(cfg)
    assert gpt.decoder.layers[1].mlp.router.expert_bias.dtype == torch.float32
    assert MoETransformer(cfg).decoder.layers[1].mlp.router.expert_bias.dtype == torch.float32
    assert any(k.endswith("self_attention.linear_kv_up_proj.weight") for k in ours)
