"""Multi-token prediction (DeepSeek-V3's MTP) layers with Megatron-core's names, used as a drafter.

MTP layer 0 at position i reads the decoder's last hidden state h_i (before the final norm) and
the *next* token t_{i+1}: `x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])`, one transformer
layer over x (its own attention, whose KV the cache holds as layer `num_layers`), then
`final_layernorm` and the model's shared output layer give logits for t_{i+2}. That makes it a
drafter that costs one layer: after the target has produced t_{n+1}, MTP proposes t_{n+2}, and
the next target forward verifies it (`engine.speculative`, `engine.drafting`).

Names: `mtp.layers.K.{enorm,hnorm,eh_proj,transformer_layer.*,final_layernorm}.weight`, as
Megatron's MultiTokenPredictionBlock (the embedding and output layer are the model's own).
DeepSeek checkpoints' MTP layers load with the rest (`model.deepseek_checkpoint`). The engine
drafts with the first layer inside its decode iterations (`engine.drafting`). Left out: drafting
with more than the first MTP layer.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_rollout.comm.facade import Comm, Shard
from megatron_rollout.forward import Forward
from megatron_rollout.model.attention import AttentionBackend
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.layers import Linear, RMSNorm, TransformerLayer
from megatron_rollout.model.parts import layer_parts
from megatron_rollout.types import Phase


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, depth: int, shard: Shard, device=None) -> None:
        super().__init__()
        h, dt, eps = cfg.hidden_size, cfg.torch_dtype, cfg.layernorm_epsilon
        self.enorm = RMSNorm(h, eps, dt, device)
        self.hnorm = RMSNorm(h, eps, dt, device)
        self.eh_proj = Linear(2 * h, h, dt, device)
        self.transformer_layer = TransformerLayer(cfg, cfg.num_layers + depth, shard, device, layer_parts(cfg))
        self.final_layernorm = RMSNorm(h, eps, dt, device)

    def forward(self, embedded_next: torch.Tensor, hidden: torch.Tensor, rope, attn: AttentionBackend,
                comm: Comm, phase: Phase) -> Forward:
        """embedded_next, hidden: [N, H] -> this layer's output [N, H] (before `final_layernorm`)."""
        x = self.eh_proj(torch.cat([self.enorm(embedded_next), self.hnorm(hidden)], dim=-1))
        return (yield from self.transformer_layer(x, rope, attn, comm, phase))


class MTPBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: Shard, device=None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MTPLayer(cfg, k, shard, device) for k in range(cfg.mtp_num_layers))
