"""The MTP layers (`model.mtp`) carry Megatron-core's names and shapes; the tiny DeepSeek-V3 with
one MTP layer that the speculative-decoding tests share (tests/engine/test_drafting.py)."""
from __future__ import annotations

from megatron_rollout.model import checkpoint as ckpt
from megatron_rollout.model.sharding import full_shapes
from megatron_rollout.model.transformer import MoETransformer
from tests.model.test_deepseek import deepseek_config

CFG = ckpt.config_from_hf(deepseek_config("yarn-grouped")).replace(mtp_num_layers=1, vocab_size=12)
"""A tiny DeepSeek-V3 (MLA, grouped sigmoid routing, YaRN) with one MTP layer and 12 tokens."""
PROMPTS = [[1, 2, 3, 4, 5], [7], [3, 3, 9, 0, 11, 2, 6]]


def test_mtp_parameters_have_megatron_names():
    names = set(MoETransformer(CFG).state_dict())
    assert names == set(full_shapes(CFG))
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.final_layernorm.weight", "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
            "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight"} <= names
    assert full_shapes(CFG)["mtp.layers.0.eh_proj.weight"] == (CFG.hidden_size, 2 * CFG.hidden_size)
