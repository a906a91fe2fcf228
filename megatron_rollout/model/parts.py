"""Which attention and router a config's layers build: the one place that knows every variant.

`layers` defines the standard parts and takes the choice as a `LayerParts`; the variants
(`mla.MLASelfAttention`, `router.ScoredRouter`) build on `layers`' primitives, so the choice lives
above all three and `layers` imports none of them.
"""
from __future__ import annotations

from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.layers import LayerParts, Router, SelfAttention
from megatron_rollout.model.mla import MLASelfAttention
from megatron_rollout.model.router import ScoredRouter, uses_scored_router


def layer_parts(cfg: ModelConfig) -> LayerParts:
    return LayerParts(attention=MLASelfAttention if cfg.multi_latent_attention else SelfAttention,
                      router=ScoredRouter if uses_scored_router(cfg) else Router)
