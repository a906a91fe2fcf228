"""One RL episode as the trainer sees it, and right-padded batches of them.

A trajectory is the whole token stream of an episode over all its turns: the prompt, every
generated turn, and every tool/environment observation in between. Only generated tokens are
trained on (`loss_mask` = 1); the prompt and observation tokens are context (`loss_mask` = 0).
Each generated token keeps the log-probability the rollout engine sampled it with and the weight
version it was sampled under, so the loss can correct for a rollout/trainer mismatch and a
consumer can see how stale a sample was.

Deliberately left out: per-turn rewards (the episode reward is what GRPO uses), packing several
trajectories into one row, and left padding (the trainer's forward takes right-padded rows).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

NOT_GENERATED = -1
"""Weight version recorded for prompt and observation tokens."""


@dataclass(frozen=True)
class Trajectory:
    token_ids: tuple[int, ...]
    """Prompt, generated and observation tokens of all turns, in order."""
    loss_mask: tuple[int, ...]
    """1 on generated tokens, 0 on prompt and observation tokens."""
    rollout_logprobs: tuple[float, ...]
    """Engine log-probability of each generated token; 0.0 where `loss_mask` is 0."""
    weight_versions: tuple[int, ...]
    """Weight version each generated token was sampled under; `NOT_GENERATED` elsewhere."""
    reward: float
    """Episode reward (sum of the environment's step rewards)."""
    group_id: int
    """Trajectories with the same group id share a prompt (GRPO's group)."""
    num_turns: int = 1
    """Generation turns in the episode."""
    truncated: bool = False
    """The episode ended early (max turns, a refused or aborted request) rather than by `done`."""
    error: str | None = None
    """Why the engine ended the episode (a refused submission, an ERROR/ABORT finish); None otherwise."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("loss_mask", "rollout_logprobs", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has {len(getattr(self, name))} entries for {n} tokens")
        if n < 2:
            raise ValueError(f"a trajectory needs at least 2 tokens (a prompt token and a generated one), got {n}")
        if self.loss_mask[0] != 0:
            raise ValueError("the first token is context and cannot be trained on (loss_mask[0] must be 0)")
        for i, (m, lp, v) in enumerate(zip(self.loss_mask, self.rollout_logprobs, self.weight_versions)):
            if m not in (0, 1):
                raise ValueError(f"loss_mask[{i}] = {m}; must be 0 or 1")
            if m == 0 and (lp != 0.0 or v != NOT_GENERATED):
                raise ValueError(f"token {i} is not generated but has logprob {lp} / version {v}; "
                                 f"expected 0.0 / {NOT_GENERATED}")
            if m == 1 and v < 0:
                raise ValueError(f"generated token {i} has no weight version ({v})")

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def generated_versions(self) -> list[int]:
        return [v for v, m in zip(self.weight_versions, self.loss_mask) if m]


@dataclass(frozen=True)
class TrajectoryBatch:
    """Right-padded tensors of B trajectories. Everything per token is aligned to *targets*:
    column t describes token t+1 predicted from tokens 0..t, which is what
    `MoETransformer.token_logprobs` returns."""

    input_ids: torch.Tensor  # [B, T] long, padded with pad_id
    loss_mask: torch.Tensor  # [B, T-1] float, 1 where the target token was generated
    rollout_logprobs: torch.Tensor  # [B, T-1] float32, 0 where masked
    rewards: torch.Tensor  # [B] float32
    group_ids: torch.Tensor  # [B] long

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> "TrajectoryBatch":
        return TrajectoryBatch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))

    def select(self, rows: torch.Tensor | Sequence[int]) -> "TrajectoryBatch":
        """The sub-batch of the given rows, trimmed to its longest row."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        mask = self.loss_mask[rows]
        # Keep columns up to the last generated target of any selected row (+1 for the input).
        used = mask.any(0).nonzero()
        t = int(used.max()) + 2 if used.numel() else 2
        return TrajectoryBatch(self.input_ids[rows, :t], mask[:, : t - 1], self.rollout_logprobs[rows, : t - 1],
                               self.rewards[rows], self.group_ids[rows])


def collate(trajectories: Sequence[Trajectory], pad_id: int) -> TrajectoryBatch:
    """Right-pad trajectories into a `TrajectoryBatch`."""
    if not trajectories:
        raise ValueError("collate needs at least one trajectory")
    b, t = len(trajectories), max(len(tr.token_ids) for tr in trajectories)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    mask = torch.zeros(b, t)
    logprobs = torch.zeros(b, t, dtype=torch.float32)
    for i, tr in enumerate(trajectories):
        n = len(tr.token_ids)
        input_ids[i, :n] = torch.tensor(tr.token_ids)
        mask[i, :n] = torch.tensor(tr.loss_mask, dtype=torch.float32)
        logprobs[i, :n] = torch.tensor(tr.rollout_logprobs, dtype=torch.float32)
    rewards = torch.tensor([tr.reward for tr in trajectories], dtype=torch.float32)
    groups = torch.tensor([tr.group_id for tr in trajectories], dtype=torch.long)
    return TrajectoryBatch(input_ids, mask[:, 1:], logprobs[:, 1:], rewards, groups)
