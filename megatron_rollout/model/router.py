"""DeepSeek-V3 routing: sigmoid scores, a per-expert selection bias, group-limited top-k, scaling.

Each expert's score is `sigmoid(x . w_e)` (or the softmax over experts). Experts are *chosen* on
score + `expert_bias` (fp32, the auxiliary-loss-free balancing bias a trainer updates; Megatron
keeps it as the buffer `router.expert_bias`, here a parameter without gradient so hot swap copies
it by name), restricted to the `moe_router_group_topk` best groups, a group ranked by the sum of
its best topk/group_topk biased scores. The *weights* are the unbiased scores of the chosen
experts, renormalised to sum to one when `moe_renormalize_topk`, times
`moe_router_topk_scaling_factor`. All in fp32, as Megatron and transformers do.
Left out: the bias update itself (a trainer's step) and the auxiliary losses.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.layers import linear


def uses_scored_router(cfg: ModelConfig) -> bool:
    """Whether `cfg`'s routing needs `ScoredRouter` rather than the plain softmax top-k router."""
    return (cfg.moe_router_score_function != "softmax" or cfg.moe_router_enable_expert_bias
            or cfg.moe_router_num_groups > 0 or cfg.moe_router_topk_scaling_factor != 1.0)


class ScoredRouter(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None) -> None:
        super().__init__()
        self.cfg, self.topk = cfg, cfg.moe_router_topk
        self.weight = nn.Parameter(torch.empty(cfg.num_moe_experts, cfg.hidden_size, dtype=cfg.torch_dtype,
                                               device=device))
        if cfg.moe_router_enable_expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(cfg.num_moe_experts, dtype=torch.float32, device=device),
                                            requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, H]. Returns weights [N, k] (x's dtype) and expert ids [N, k]."""
        cfg = self.cfg
        logits = linear(x.float(), self.weight.float())  # [N, E], batch-invariant on CPU
        scores = logits.sigmoid() if cfg.moe_router_score_function == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.expert_bias if cfg.moe_router_enable_expert_bias else scores
        if cfg.moe_router_num_groups:
            choice = self._mask_groups(choice)
        ids = choice.topk(cfg.moe_router_topk, dim=-1).indices  # [N, k], sorted: the sum below has one order
        weights = scores.gather(1, ids)
        if cfg.moe_renormalize_topk and cfg.moe_router_topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * cfg.moe_router_topk_scaling_factor).to(x.dtype), ids

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [N, E] with every expert outside the token's best groups set to -inf."""
        cfg, (n, e) = self.cfg, choice.shape
        groups = choice.view(n, cfg.moe_router_num_groups, e // cfg.moe_router_num_groups)  # [N, G, E/G]; N may be 0
        per_group = cfg.moe_router_topk // cfg.moe_router_group_topk
        group_scores = groups.topk(per_group, dim=-1).values.sum(dim=-1)  # [N, G]
        best = group_scores.topk(cfg.moe_router_group_topk, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [N, G]
        return groups.masked_fill(~keep[:, :, None], float("-inf")).view(n, e)
