"""The policy loss: one PPO-style objective whose variants (GRPO, DAPO, Dr. GRPO, ...) are
settings of a frozen `LossConfig`, never separate code paths.

Per generated token t with advantage A (per sequence, broadcast over its tokens):

    r_t   = exp(logp_t - old_t)                                  importance ratio vs the old policy
    pg_t  = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)
    w_t   = min(exp(old_t - rollout_t), tis_cap)                 truncated IS (no gradient)
    kl_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1           k3 estimator of KL(pi || ref)
    l_t   = w_t pg_t + kl_coef kl_t - entropy_coef H_t

`old` is the trainer's log-probability under the weights the rollout used (computed by the
trainer before its first update), `rollout` the engine's for the same token; they differ through
numerics (kernels, dtypes) and the correction keeps that mismatch from biasing the gradient.
Aggregation is a token mean over the batch ("token") or a mean over sequences of each
sequence's token mean ("sequence"). Metrics are aggregated the same way, so
loss = pg_loss + kl_coef * kl - entropy_coef * entropy holds exactly.

Left out: value-function losses (GRPO has no critic), dual clipping, sequence-level ratios (GSPO).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.fields import check_types

AGGREGATIONS = ("token", "sequence")


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - clip_low for negative advantages."""
    clip_high: float = 0.2
    """Upper clip: the ratio is clipped at 1 + clip_high for positive advantages (DAPO: 0.28)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference policy; 0 disables it (no reference model needed)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus; 0 disables it."""
    aggregation: str = "token"
    """"token": mean over all generated tokens of the batch; "sequence": mean of per-sequence means."""
    tis_cap: float | None = None
    """Cap of the truncated importance weight exp(old - rollout); None disables the correction."""

    def __post_init__(self) -> None:
        check_types(self)
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be positive or None, got {self.tis_cap}")


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor
    """Scalar to backpropagate."""
    metrics: dict[str, float]
    """pg_loss, kl, entropy, clip_fraction, ratio_mean, tis_weight_mean, tis_clip_fraction,
    rollout_abs_diff (mean |old - rollout|), tokens."""


def aggregate(values: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """Masked mean of [B, T] values: over all tokens ("token") or per sequence, then over the
    sequences that have at least one token ("sequence")."""
    if how == "token":
        return (values * mask).sum() / mask.sum().clamp(min=1)
    if how == "sequence":
        per_row = mask.sum(-1)
        rows = per_row > 0
        seq = (values * mask).sum(-1)[rows] / per_row[rows]
        return seq.mean() if seq.numel() else values.sum() * 0
    raise ValueError(f"unknown aggregation {how!r}; expected one of {AGGREGATIONS}")


def policy_loss(cfg: LossConfig, logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
                old_logprobs: torch.Tensor | None = None, rollout_logprobs: torch.Tensor | None = None,
                ref_logprobs: torch.Tensor | None = None, entropy: torch.Tensor | None = None) -> LossOutput:
    """logprobs (with grad), old/rollout/ref logprobs, entropy, mask: [B, T]; advantages: [B] or [B, T].

    `old_logprobs` defaults to `logprobs.detach()` (a single update per rollout: ratio 1)."""
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logprobs.dtype).expand_as(logprobs)
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    for name, t, needed in (("rollout_logprobs", rollout_logprobs, cfg.tis_cap is not None),
                            ("ref_logprobs", ref_logprobs, cfg.kl_coef > 0),
                            ("entropy", entropy, cfg.entropy_coef != 0)):
        if needed and t is None:
            raise ValueError(f"LossConfig needs {name} (tis_cap={cfg.tis_cap}, kl_coef={cfg.kl_coef}, "
                             f"entropy_coef={cfg.entropy_coef}) but none was given")
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(logprobs.shape)}")
    agg = cfg.aggregation

    ratio = torch.exp(logprobs - old_logprobs)
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = -torch.minimum(ratio * advantages, clipped * advantages)
    clip_active = ((ratio > 1 + cfg.clip_high) & (advantages > 0)) | ((ratio < 1 - cfg.clip_low) & (advantages < 0))

    tis_weight = torch.ones_like(logprobs)
    if cfg.tis_cap is not None:
        raw = torch.exp(old_logprobs - rollout_logprobs).detach()
        tis_weight = raw.clamp(max=cfg.tis_cap)
    pg = tis_weight * pg
    pg_loss = aggregate(pg, mask, agg)
    loss = pg_loss

    zeros = torch.zeros_like(logprobs)
    kl = zeros
    if ref_logprobs is not None:
        d = ref_logprobs - logprobs
        kl = torch.exp(d) - d - 1
    kl_mean = aggregate(kl, mask, agg)
    if cfg.kl_coef > 0:
        loss = loss + cfg.kl_coef * kl_mean
    ent_mean = aggregate(entropy if entropy is not None else zeros, mask, agg)
    if cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * ent_mean

    with torch.no_grad():
        metrics = {
            "loss": float(loss),
            "pg_loss": float(pg_loss),
            "kl": float(kl_mean),
            "entropy": float(ent_mean),
            "clip_fraction": float(aggregate(clip_active.to(mask.dtype), mask, agg)),
            "ratio_mean": float(aggregate(ratio, mask, agg)),
            "tis_weight_mean": float(aggregate(tis_weight, mask, agg)),
            "tis_clip_fraction": float(aggregate(
                (torch.exp(old_logprobs - rollout_logprobs) > cfg.tis_cap).to(mask.dtype), mask, agg))
            if cfg.tis_cap is not None else 0.0,
            "rollout_abs_diff": float(aggregate((old_logprobs - rollout_logprobs).abs(), mask, agg))
            if rollout_logprobs is not None else 0.0,
            "tokens": float(mask.sum()),
        }
    return LossOutput(loss, metrics)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim, in fp32: [..., V] -> [...]."""
    logp = logits.float().log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)
