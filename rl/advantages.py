"""GRPO advantages: each sample's reward relative to the other samples of its prompt.

GRPO needs no value model: the baseline of a sample is the mean reward of its group (the G
samples drawn for one prompt), optionally scaled by the group's reward standard deviation.
Groups whose rewards are all equal carry no signal (every advantage is 0); they can be dropped so
that they do not dilute token-mean losses.

Left out: per-token (process) rewards, leave-one-out baselines and batch-level normalisation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.fields import check_types


@dataclass(frozen=True)
class AdvantageConfig:
    scale_by_std: bool = True
    """Divide by the group's reward std (GRPO); False keeps only the mean baseline (Dr. GRPO)."""
    drop_uniform_groups: bool = False
    """Mark groups whose rewards are all equal as not kept (DAPO's dynamic sampling filter)."""
    eps: float = 1e-6
    """Added to the std before dividing."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.eps <= 0:
            raise ValueError(f"AdvantageConfig.eps must be positive, got {self.eps}")


@dataclass(frozen=True)
class Advantages:
    values: torch.Tensor  # [B] float32
    keep: torch.Tensor  # [B] bool: False for samples of dropped groups


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, cfg: AdvantageConfig = AdvantageConfig()
                    ) -> Advantages:
    """rewards, group_ids: [B]. The std is the sample std (n-1 in the denominator); a group of one
    sample has advantage 0."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be "
                         f"equal 1-d shapes")
    rewards = rewards.float()
    values = torch.zeros_like(rewards)
    keep = torch.ones_like(rewards, dtype=torch.bool)
    for g in group_ids.unique():
        rows = group_ids == g
        r = rewards[rows]
        centred = r - r.mean()
        if cfg.scale_by_std and r.numel() > 1:
            centred = centred / (r.std() + cfg.eps)
        values[rows] = centred
        if cfg.drop_uniform_groups and bool((r == r[0]).all()):
            keep[rows] = False
    return Advantages(values, keep)
