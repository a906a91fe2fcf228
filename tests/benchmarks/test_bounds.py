"""Byte/FLOP accounting and trace lower bounds, checked against numbers worked out by hand for a
tiny model (hidden 8, one MoE layer of 4 experts, top-2, fp32)."""
from __future__ import annotations

import pytest

from benchmarks.bounds import decode_roofline_s, model_costs, prefill_flops, trace_lower_bound
from megatron_rollout.model.config import ModelConfig, preset
from megatron_rollout.trace.schema import TraceRequest

CFG = ModelConfig(vocab_size=10, hidden_size=8, num_layers=1, num_attention_heads=2, num_query_groups=1,
                  kv_channels=4, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=6)


def test_model_costs_by_hand():
    c = model_costs(CFG)
    assert c.attention_params == 8 * (2 + 2) * 4 + 2 * 4 * 8  # qkv + proj = 192
    assert (c.router_params, c.expert_params, c.shared_params, c.dense_params) == (32, 144, 0, 0)
    assert c.active_params_per_token == 192 + 32 + 2 * 144
    assert c.kv_bytes_per_token == 2 * 1 * 1 * 4 * 4
    assert c.attn_flops_per_pair == 4 * 1 * 2 * 4
    assert c.expected_experts_touched(1) == pytest.approx(2.0)
    assert c.expected_experts_touched(2) == pytest.approx(3.0)
    assert c.expected_experts_touched(10_000) == pytest.approx(4.0)
    assert c.decode_weight_bytes(1) == pytest.approx((192 + 32 + 2 * 144 + 80 + 8) * 4)
    assert decode_roofline_s(c, 1, 5, bandwidth=100.0) == pytest.approx((2400 + 5 * 32) / 100)


def test_prefill_flops_causal_with_offset():
    c = model_costs(CFG)
    # 2 new tokens after 3 cached: pairs = 2*3 + (1 + 2) = 9; one sampled row through the output layer
    assert prefill_flops(c, [(3, 2)]) == pytest.approx(2 * 512 * 2 + 32 * 9 + 2 * 80)


def test_trace_lower_bound_by_hand():
    c = model_costs(CFG)
    trace = [TraceRequest("a", 0, 2, 3, 0.0),
             TraceRequest("b", 0, 1, 1, 0.0), TraceRequest("b", 1, 1, 2, 500.0)]
    lb = trace_lower_bound(trace, c, peak_flops=1e3, bandwidth=1e3, max_batch=2)
    # a: prefill max(2304 FLOP, 3008 B) -> 3.008 s; 2 decode steps reading 2x2400 B + 7 KV positions
    assert lb.chain_s == pytest.approx(3.008 + (2 * 2400 + 32 * 7) / 1e3)
    assert lb.chain_conversation == "a"
    assert lb.total_flops == pytest.approx(4672 + 3680)
    assert lb.total_bytes == pytest.approx(2 * 3008 + 32 * 11)
    assert lb.work_s == pytest.approx(8.352)
    assert lb.bound_s == pytest.approx(max(lb.chain_s, lb.work_s))


def test_trace_lower_bound_rejects_nonsense_rates():
    with pytest.raises(ValueError, match="positive"):
        trace_lower_bound([TraceRequest("a", 0, 1, 1, 0.0)], model_costs(CFG), 0.0, 1.0, 1)


def test_qwen3_30b_a3b_12l_decode_bytes_are_plausible():
    c = model_costs(preset("qwen3-30b-a3b-12l"))
    # 12 layers x 128 experts x 3 x 2048 x 768 bf16 = 14.5 GB of experts, nearly all touched at batch 64
    assert 14.5e9 < c.decode_weight_bytes(64) < 16.5e9
    assert c.kv_bytes_per_token == 2 * 12 * 4 * 128 * 2


def test_mla_costs_by_hand():
    """Multi-latent attention, absorbed: one latent + RoPE row cached per token, every weight
    (the KV up projection too) multiplied once per token, a pair costs 2(r + dr) + 2r per head."""
    cfg = ModelConfig(vocab_size=10, hidden_size=8, num_layers=2, num_attention_heads=2, num_query_groups=2,
                      kv_channels=6, multi_latent_attention=True, q_lora_rank=3, kv_lora_rank=4, qk_head_dim=4,
                      qk_pos_emb_head_dim=2, v_head_dim=5, ffn_hidden_size=7, dtype="bfloat16")
    c = model_costs(cfg)
    # q: 8*3 + 3 (norm) + 3*2*6; kv down: 8*6 + 4 (norm); kv up: 4*2*9; proj: 2*5*8
    assert c.attention_params == 2 * (27 + 36 + 52 + 72 + 80)
    assert c.kv_bytes_per_token == 2 * 6 * 2
    assert c.attn_flops_per_pair == 2 * 2 * (2 * 6 + 2 * 4)
    assert c.dense_params == 2 * 3 * 8 * 7


def test_deepseek_v3_preset_costs():
    c = model_costs(preset("deepseek-v3"))
    assert c.moe_layers == 4 and c.topk == 8 and c.num_experts == 256
    assert c.kv_bytes_per_token == 6 * 576 * 2
    assert 48e9 < c.attention_params + c.dense_params + c.router_params + c.shared_params \
        + 4 * 256 * c.expert_params + 2 * c.vocab_hidden < 50e9  # the preset's 49.0B parameters
