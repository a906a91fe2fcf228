"""What a rollout must cost at least: bytes and FLOPs of the model, rooflines, trace lower bounds.

Pure arithmetic on Python numbers (no device), so it is tested on CPU and every figure in the
benchmark can be recomputed by hand:

- `ModelCosts`: parameters split by role, bytes one decode step must read (every weight it
  touches once: attention, router, the experts that at least one row routes to, the output
  layer; plus each row's KV history), FLOPs per prefill token and per attention (query, key)
  pair.
- `decode_roofline_s`: the memory roofline of one decode step, bytes / measured copy bandwidth.
- `prefill_flops`: FLOPs of a prefill batch (linear layers + causal attention with an offset).
- `trace_lower_bound`: two bounds on any schedule's makespan for a trace on one device:
  *chain*, the longest conversation run alone (its tool waits, its prefills at the peak matmul
  rate, one roofline decode step per output token at batch 1), and *work*, the whole trace's
  FLOPs at peak or its bytes at full bandwidth (with decode batched at the largest possible
  batch), whichever is larger. The makespan is at least their maximum.

Multi-latent attention (DeepSeek-V3) is counted in its absorbed form, as the model runs it.

Left out: communication (one device), the host (Python scheduling costs are what the benchmark
measures against these), and MTP / speculative decoding (one token per step).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_rollout.model.config import ModelConfig
from megatron_rollout.trace.schema import TraceRequest, group_conversations


@dataclass(frozen=True)
class ModelCosts:
    """Parameter counts and per-token costs of one (unsharded) model."""

    itemsize: int
    """Bytes per weight / KV element."""
    attention_params: int
    """All layers: QKV + output projections (+ q/k norms)."""
    dense_params: int
    """All dense-MLP layers' parameters."""
    router_params: int
    """All MoE layers' routers."""
    expert_params: int
    """One routed expert's parameters (fc1 + fc2)."""
    shared_params: int
    """All MoE layers' shared experts."""
    moe_layers: int
    num_experts: int
    topk: int
    vocab_hidden: int
    """vocab x hidden: the output layer (and the embedding table)."""
    hidden: int
    kv_bytes_per_token: int
    """K and V of one position over all layers."""
    attn_flops_per_pair: int
    """FLOPs of one (query, key) pair over all layers: QK^T and PV, 2 x head_dim each, every q head."""

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token multiplies (no output layer)."""
        return (self.attention_params + self.dense_params + self.router_params + self.shared_params
                + self.moe_layers * self.topk * self.expert_params)

    def expected_experts_touched(self, rows: int) -> float:
        """Mean distinct experts a layer reads for `rows` tokens routed uniformly at random."""
        if self.num_experts == 0 or rows <= 0:
            return 0.0
        miss = 1.0 - self.topk / self.num_experts
        return self.num_experts * (1.0 - miss ** rows)

    def decode_weight_bytes(self, rows: int) -> float:
        """Weight bytes one decode step of `rows` rows reads at least (each touched weight once)."""
        params = (self.attention_params + self.dense_params + self.router_params + self.shared_params
                  + self.moe_layers * self.expected_experts_touched(rows) * self.expert_params
                  + self.vocab_hidden + rows * self.hidden)
        return params * self.itemsize

    def decode_bytes(self, rows: int, context_tokens: int) -> float:
        """Weights + the KV history of every row (`context_tokens` = sum of their lengths)."""
        return self.decode_weight_bytes(rows) + self.kv_bytes_per_token * context_tokens


def model_costs(cfg: ModelConfig) -> ModelCosts:
    h, d = cfg.hidden_size, cfg.kv_channels
    hq, hkv = cfg.num_attention_heads, cfg.num_query_groups
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.dtype]
    attn = cfg.num_layers * (h * (hq + 2 * hkv) * d + hq * d * h + (2 * d if cfg.qk_layernorm else 0))
    kv_per_token, flops_per_pair = 2 * cfg.num_layers * hkv * d, 4 * cfg.num_layers * hq * d
    if cfg.multi_latent_attention:
        attn, kv_per_token, flops_per_pair = _mla_costs(cfg)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    dense_layers = cfg.num_layers - moe_layers
    return ModelCosts(
        itemsize=itemsize,
        attention_params=attn,
        dense_params=dense_layers * 3 * h * cfg.ffn_hidden_size,
        router_params=moe_layers * cfg.num_moe_experts * h,
        expert_params=3 * h * cfg.moe_ffn_hidden_size,
        shared_params=moe_layers * 3 * h * cfg.moe_shared_expert_intermediate_size,
        moe_layers=moe_layers,
        num_experts=cfg.num_moe_experts,
        topk=cfg.moe_router_topk if moe_layers else 0,
        vocab_hidden=cfg.vocab_size * h,
        hidden=h,
        kv_bytes_per_token=kv_per_token * itemsize,
        attn_flops_per_pair=flops_per_pair,
    )


def _mla_costs(cfg: ModelConfig) -> tuple[int, int, int]:
    """Multi-latent attention (`model.mla`, absorbed): (attention parameters, cached elements per
    token, FLOPs per (query, key) pair), all layers. Every token multiplies each weight once
    (`linear_kv_up_proj` too: absorbed into the query and applied to the output's latent); the
    cache holds one latent + RoPE row per token; a pair scores over latent + RoPE and sums the
    latent."""
    h, hq, layers = cfg.hidden_size, cfg.num_attention_heads, cfg.num_layers
    r, dr, dn, dv, ql = cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim, cfg.qk_head_dim, cfg.v_head_dim, cfg.q_lora_rank
    query = h * hq * (dn + dr) if ql is None else h * ql + ql + ql * hq * (dn + dr)
    per_layer = query + h * (r + dr) + r + r * hq * (dn + dv) + hq * dv * h
    return layers * per_layer, layers * (r + dr), layers * hq * (2 * (r + dr) + 2 * r)


def decode_roofline_s(costs: ModelCosts, rows: int, context_tokens: int, bandwidth: float) -> float:
    """Seconds one decode step needs at least: its bytes over the measured bandwidth (B/s)."""
    return costs.decode_bytes(rows, context_tokens) / bandwidth


def prefill_flops(costs: ModelCosts, spans: Sequence[tuple[int, int]], sampled: int | None = None) -> float:
    """FLOPs of prefilling spans (past, new): linear layers for every new token, causal attention
    over cached + earlier new positions, and the output layer for `sampled` rows (default: one
    per span)."""
    tokens = sum(new for _, new in spans)
    pairs = sum(new * past + new * (new + 1) / 2 for past, new in spans)
    return counted_prefill_flops(costs, tokens, pairs, len(spans) if sampled is None else sampled)


def counted_prefill_flops(costs: ModelCosts, tokens: int, pairs: float, sampled: int) -> float:
    """`prefill_flops` from its counts: new tokens, causal attention (query, key) pairs, sampled rows
    (what an engine step's record keeps: `StepRecord.prefill_tokens`, `prefill_pairs`, `prefill_rows`)."""
    return 2.0 * costs.active_params_per_token * tokens + costs.attn_flops_per_pair * pairs \
        + 2.0 * costs.vocab_hidden * sampled


@dataclass(frozen=True)
class LowerBound:
    chain_s: float
    """Longest conversation alone: waits + prefill at peak + batch-1 roofline decode steps."""
    chain_conversation: str
    """Which conversation that is."""
    work_s: float
    """Whole trace: max(FLOPs / peak, bytes / bandwidth) with decode at the largest batch."""
    total_flops: float
    total_bytes: float

    @property
    def bound_s(self) -> float:
        return max(self.chain_s, self.work_s)


def trace_lower_bound(requests: Sequence[TraceRequest], costs: ModelCosts, peak_flops: float, bandwidth: float,
                      max_batch: int) -> LowerBound:
    """Lower bounds on the makespan of `requests` on one device (see the module docstring).

    Args:
        peak_flops: measured dense matmul rate (FLOP/s).
        bandwidth: measured device copy bandwidth (B/s, read + write).
        max_batch: most decode rows one step can hold (decode batching bound for `work`).
    """
    if peak_flops <= 0 or bandwidth <= 0 or max_batch <= 0:
        raise ValueError(f"need positive peak_flops, bandwidth and max_batch, got {peak_flops}, {bandwidth}, "
                         f"{max_batch}")
    chain_best, chain_key = 0.0, ""
    total_flops = 0.0
    decode_tokens = 0
    kv_read = 0.0
    for key, turns in group_conversations(requests).items():
        context = 0
        chain = 0.0
        for turn in turns:
            flops = prefill_flops(costs, [(context, turn.input_tokens)])
            weights_once = costs.decode_weight_bytes(turn.input_tokens)
            prefill_s = max(flops / peak_flops, weights_once / bandwidth)
            context += turn.input_tokens
            steps = max(0, turn.output_tokens - 1)  # the first output token comes from the prefill
            history = steps * context + steps * (steps + 1) / 2  # KV positions read by its decode steps
            decode_s = (steps * costs.decode_weight_bytes(1) + costs.kv_bytes_per_token * history) / bandwidth
            kv_read += costs.kv_bytes_per_token * history
            chain += turn.wait_ms / 1e3 + prefill_s + decode_s
            total_flops += flops + steps * 2.0 * (costs.active_params_per_token + costs.vocab_hidden)
            decode_tokens += steps
            context += turn.output_tokens
        if chain > chain_best:
            chain_best, chain_key = chain, str(key)
    batches = math.ceil(decode_tokens / max_batch) if decode_tokens else 0
    rows = min(max_batch, decode_tokens) if decode_tokens else 0
    decode_weight = batches * costs.decode_weight_bytes(rows) if batches else 0.0
    total_bytes = decode_weight + kv_read
    work = max(total_flops / peak_flops, total_bytes / bandwidth)
    return LowerBound(chain_best, chain_key, work, total_flops, total_bytes)
