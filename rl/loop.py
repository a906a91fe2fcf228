"""The colocated GRPO loop: rollout with the engine, train, hot-swap the new weights, repeat.

One process (per rank) holds both the trainer's model and the engine's model, as separate
modules: every step ends with `engine.update_weights(trainer.named_weights(), version + 1)`, so
the hot-swap path is exercised exactly as a Megatron trainer would use it, and KV memory is
released while the trainer runs. Under torch.distributed every rank rolls out its own prompts and
gradients are averaged over ranks (plain data parallelism); reward statistics and loss metrics
are averaged over ranks, and only rank 0 writes outputs.

Left out: asynchronous (off-policy) rollouts overlapping training, rollout/trainer on separate
devices, checkpointing, evaluation sets, and learning-rate schedules.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams
from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.tokenizer import ByteTokenizer
from rl.advantages import AdvantageConfig, grpo_advantages
from rl.envs import Env, GuessDigitEnv, SingleTurnEnv
from rl.envs.single_turn import TASKS
from rl.objective import LossConfig
from rl.rollout import Episode, RolloutConfig, rollout
from rl.trainer import NativeTrainer, TrainerConfig
from rl.trajectory import collate

log = logging.getLogger(__name__)

ENV_NAMES = (*TASKS, "guess")
LOGGED = ("reward_mean", "reward_sq", "kept_fraction", "rollout_makespan_s", "tokens_per_s",  # per rank, averaged
          "loss", "pg_loss", "kl", "entropy", "clip_fraction", "ratio_mean", "tis_weight_mean", "tis_clip_fraction",
          "rollout_abs_diff", "tokens", "grad_norm")


@dataclass(frozen=True)
class GRPOConfig:
    seed: int = 0
    """Seeds the model init (identical on every rank) and the prompts (different per rank)."""
    model: str = "tiny-moe"
    """Model preset."""
    env: str = "digits"
    """digits | target_byte (single turn) | guess (multi-turn tool task)."""
    prompts_per_step: int = 8
    """Prompts (GRPO groups) per rank per step."""
    group_size: int = 8
    """Samples per prompt."""
    max_new_tokens: int = 12
    """Generated tokens per turn."""
    temperature: float = 1.0
    max_turns: int = 1
    """Generation turns per episode (multi-turn envs)."""
    tool_latency_s: float = 0.0
    """Simulated tool/grader delay per env step."""
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.99)
    steps: int = 30
    engine: dict[str, Any] = field(default_factory=dict)
    """EngineConfig fields (schedule, num_blocks, ...); the schedule defaults to "mux"."""
    loss: LossConfig = LossConfig()
    advantages: AdvantageConfig = AdvantageConfig()
    trainer: TrainerConfig = TrainerConfig()

    def __post_init__(self) -> None:
        if self.env not in ENV_NAMES:
            raise ValueError(f"unknown env {self.env!r}; expected one of {ENV_NAMES}")
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "max_turns", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"GRPOConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        self.engine_config  # validate early, with the engine's own messages

    @property
    def engine_config(self) -> EngineConfig:
        return EngineConfig(**{"schedule": "mux", **self.engine})

    @classmethod
    def from_dict(cls, raw: dict[str, Any], **overrides: Any) -> "GRPOConfig":
        raw = {**raw, **{k: v for k, v in overrides.items() if v is not None}}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown GRPO config keys {unknown}; known: {sorted(known)}")
        nested = {"loss": LossConfig, "advantages": AdvantageConfig, "trainer": TrainerConfig}
        for key, kind in nested.items():
            if isinstance(raw.get(key), dict):
                raw[key] = kind(**raw[key])
        if "betas" in raw:
            raw["betas"] = tuple(raw["betas"])
        return cls(**raw)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "GRPOConfig":
        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f) or {}, **overrides)


def make_env(cfg: GRPOConfig, tok: ByteTokenizer) -> Env:
    if cfg.env == "guess":
        return GuessDigitEnv(tok, latency_s=cfg.tool_latency_s, max_turns=cfg.max_turns)
    task, rubric = TASKS[cfg.env]
    return SingleTurnEnv(task, rubric, tok, latency_s=cfg.tool_latency_s)


def _episodes(cfg: GRPOConfig, tok: ByteTokenizer, step: int, rank: int) -> list[Episode]:
    rng = random.Random(f"{cfg.seed}-{rank}-{step}")
    eps = []
    for g in range(cfg.prompts_per_step):
        prompt_seed = rng.randrange(2**31)
        eps += [Episode(make_env(cfg, tok), prompt_seed, g, sample_seed=rng.randrange(2**40))
                for _ in range(cfg.group_size)]
    return eps


def _mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Mean of each LOGGED key over the ranks that have it."""
    if not (dist.is_available() and dist.is_initialized()):
        return {k: values[k] for k in LOGGED if k in values}
    buf = torch.tensor([[values.get(k, 0.0), float(k in values)] for k in LOGGED], dtype=torch.float64)
    dist.all_reduce(buf)
    return {k: float(s / n) for k, (s, n) in zip(LOGGED, buf.tolist()) if n > 0}


class GRPORun:
    """Builds the policy, the engine and the trainer; `step()` runs one GRPO iteration."""

    def __init__(self, cfg: GRPOConfig) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.tok = ByteTokenizer()
        torch.manual_seed(cfg.seed)
        self.policy = MoETransformer(preset(cfg.model)).init_weights(cfg.seed)
        if dist.is_available() and dist.is_initialized():
            for p in self.policy.parameters():  # identical start on every rank, whatever the init did
                dist.broadcast(p.data, src=0)
        # A separate module for the engine, so every update goes through the hot-swap path.
        self.engine = RolloutEngine(copy.deepcopy(self.policy), cfg.engine_config)
        optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)
        self.trainer = NativeTrainer(self.policy, optimizer, cfg.loss, cfg.trainer)
        sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                  stop_token_ids=(self.tok.eos_id,))
        self.rollout_cfg = RolloutConfig(sampling, max_turns=cfg.max_turns)
        self.step_index = 0

    def step(self) -> dict[str, float | None]:
        cfg, step = self.cfg, self.step_index
        self.engine.reclaim_kv()
        result = rollout(self.engine, _episodes(cfg, self.tok, step, self.rank), self.rollout_cfg)
        self.engine.release_kv()
        trajs = result.trajectories
        batch = collate(trajs, self.tok.pad_id)
        adv = grpo_advantages(batch.rewards, batch.group_ids, cfg.advantages)
        keep = adv.keep.nonzero().squeeze(-1)
        sub = batch.select(keep) if keep.numel() else None
        train = self.trainer.train_step(sub, adv.values[keep] if sub is not None else None)
        version = self.engine.weight_version + 1
        self.engine.update_weights(self.trainer.named_weights(), version)
        rewards = batch.rewards
        local = {**train, "reward_mean": float(rewards.mean()),
                 "reward_sq": float((rewards ** 2).mean()), "kept_fraction": keep.numel() / len(trajs),
                 "rollout_makespan_s": result.stats.makespan_s, "tokens_per_s": result.stats.tokens_per_s}
        metrics = _mean_over_ranks(local)
        # std over the samples of all ranks, from the averaged first and second moments
        metrics["reward_std"] = math.sqrt(max(metrics.pop("reward_sq") - metrics["reward_mean"] ** 2, 0.0))
        for key in ("kl", "clip_fraction", "entropy", "loss"):
            metrics.setdefault(key, None)  # no group kept anywhere: no training this step
        stale = [version - 1 - v for t in trajs for v in t.generated_versions]
        self.step_index += 1
        return {"step": step, **metrics, "weight_version": version, "max_staleness": max(stale, default=0),
                "turns_mean": result.stats.num_turns / len(trajs), "generated_tokens": result.stats.generated_tokens}


def run_grpo(cfg: GRPOConfig, out_dir: str | Path | None = None,
             on_step: Callable[[dict[str, float]], None] | None = None) -> list[dict[str, float]]:
    """Run cfg.steps GRPO steps; rank 0 writes out_dir/metrics.jsonl (per step) and reward.png."""
    run = GRPORun(cfg)
    history = []
    writer = None
    if out_dir is not None and run.rank == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        writer = open(Path(out_dir) / "metrics.jsonl", "w")
    try:
        for _ in range(cfg.steps):
            m = run.step()
            history.append(m)
            if writer is not None:
                writer.write(json.dumps(m) + "\n")
                writer.flush()
            if on_step is not None:
                on_step(m)
    finally:
        if writer is not None:
            writer.close()
    if out_dir is not None and run.rank == 0:
        plot_rewards(history, Path(out_dir) / "reward.png")
    return history


def plot_rewards(history: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in history]
    mean = [m["reward_mean"] for m in history]
    std = [m["reward_std"] for m in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, mean, label="reward mean")
    ax.fill_between(steps, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)], alpha=0.2,
                    label="± std")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
