"""The colocated GRPO loop: rollout with the engine, train, hot-swap the new weights, repeat.

One process (per rank) holds both the trainer's model and the engine's model: the native trainer's
as separate modules, a Megatron trainer's (`trainer: megatron`, `rl.megatron_policy`) as the engine
built from its GPTModel, sharing its tensors where the runner allows. Every step ends with
`engine.update_weights(trainer.named_weights(), version + 1)`, so the hot-swap path is exercised
exactly as a Megatron trainer would use it, and the engine sleeps while the trainer runs
(`engine.sleep(sleep_tags)`: its KV cache, the graphs over it, and its weight copy where asked).
Under torch.distributed the rollout is either replicated (every rank a full engine) or sharded
ATP x ADP over all ranks (`rl.placement`); either way the step's trajectories are gathered to
every rank, GRPO advantages are computed over all of them, each trainer replica trains on its
share of the groups and gradients are averaged over ranks. Only rank 0 writes outputs.

Left out: asynchronous (off-policy) rollouts overlapping training, rollout/trainer on separate
devices, checkpointing, evaluation sets, and learning-rate schedules.
"""
from __future__ import annotations

import copy
import dataclasses
import fcntl
import json
import logging
import os
import random
import time
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
from rl.envs.lookup import LookupEnv
from rl.envs.single_turn import TASKS
from rl.fields import ConfigTypeError, build, check_types
from rl.megatron_policy import MegatronOptions, build_megatron_policy
from rl.objective import LossConfig
from rl.placement import Placement
from rl.rollout import Episode, RolloutConfig
from rl.trainer import NativeTrainer, TrainerConfig
from rl.trajectory import Trajectory, collate

log = logging.getLogger(__name__)

ENV_NAMES = (*TASKS, "guess", "lookup")
TRAIN_KEYS = ("loss", "pg_loss", "kl", "entropy", "clip_fraction", "ratio_mean", "tis_weight_mean",
              "tis_clip_fraction", "rollout_abs_diff", "tokens", "grad_norm")
"""Trainer metrics, averaged over the ranks that trained this step (None where none did)."""


@dataclass(frozen=True)
class GRPOConfig:
    seed: int = 0
    """Seeds the model init (identical on every rank) and the prompts (different per rollout replica)."""
    model: str = "tiny-moe"
    """Model preset."""
    env: str = "digits"
    """digits | target_byte (single turn) | guess | lookup (multi-turn tool tasks; need max_turns >= 2)."""
    prompts_per_step: int = 8
    """Prompts (GRPO groups) per step, spread over the rollout replicas (ranks, or ADP replicas when
    sharded): a multiple of their number; the same groups whatever the layout."""
    group_size: int = 8
    """Samples per prompt."""
    max_new_tokens: int | tuple[int, ...] = 12
    """Generated tokens per turn: one budget for every turn, or a list per turn (the last repeats),
    e.g. [2, 8] for a short tool call and a longer answer."""
    temperature: float = 1.0
    max_turns: int = 1
    """Generation turns per episode (multi-turn envs)."""
    tool_latency_s: float = 0.0
    """Simulated tool/grader delay per env step (an asyncio sleep: other episodes keep decoding)."""
    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.99)
    steps: int = 30
    atp: int = 1
    """Rollout attention tensor parallel size (ATP x ADP = the torchrun world, or 1 x 1 for replicas)."""
    adp: int = 1
    """Rollout attention data parallel replicas; each replica's leader drives its own episodes."""
    ep: int | None = None
    """Rollout expert parallel size; must be ATP x ADP (ETP = 1); None means exactly that."""
    sleep_tags: tuple[str, ...] = ("kv",)
    """What the engine hands back while the trainer steps (`engine.sleep`): kv (with the graphs over
    it) | graphs | weights (its own copy, to host memory; an engine sharing the trainer's tensors
    holds none)."""
    max_engine_errors: float = 0.1
    """Largest share of a step's episodes the engine may end (refused: the KV pool is too small;
    failed) before the run stops with the figure; any such episode is logged as a warning."""
    engine: dict[str, Any] = field(default_factory=dict)
    """EngineConfig fields, nested as in Python (`EngineConfig.from_dict`): e.g. {"scheduler":
    {"schedule": "mux"}, "kv": {"num_blocks": 256}}; the schedule defaults to "mux"."""
    loss: LossConfig = LossConfig()
    advantages: AdvantageConfig = AdvantageConfig()
    trainer: TrainerConfig = TrainerConfig()
    """`trainer: megatron` is short for `trainer: {kind: megatron}`."""
    megatron: MegatronOptions = MegatronOptions()
    """How the Megatron trainer and its engine are built; only with `trainer.kind: megatron`."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.env not in ENV_NAMES:
            raise ValueError(f"unknown env {self.env!r}; expected one of {ENV_NAMES}")
        budgets = self.max_new_tokens if isinstance(self.max_new_tokens, (tuple, list)) else (self.max_new_tokens,)
        if not budgets or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in budgets):
            raise ConfigTypeError(f"GRPOConfig.max_new_tokens must be an int >= 1 or a list of them, "
                                  f"got {self.max_new_tokens!r}")
        object.__setattr__(self, "max_new_tokens", self.max_new_tokens if isinstance(self.max_new_tokens, int)
                           else tuple(self.max_new_tokens))
        for name in ("prompts_per_step", "group_size", "max_turns", "steps", "atp", "adp"):
            if getattr(self, name) < 1:
                raise ValueError(f"GRPOConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.env in ("guess", "lookup") and self.max_turns < 2:
            raise ValueError(f"env {self.env!r} is multi-turn: max_turns must be >= 2, got {self.max_turns}")
        if self.ep is not None and self.ep != self.atp * self.adp:
            raise ValueError(f"GRPOConfig.ep must equal atp x adp = {self.atp * self.adp} (expert tensor "
                             f"parallel 1), got {self.ep}")
        if self.lr <= 0:
            raise ValueError(f"GRPOConfig.lr must be positive, got {self.lr}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"GRPOConfig.betas must be two values in [0, 1), got {list(self.betas)}")
        if self.tool_latency_s < 0:
            raise ValueError(f"GRPOConfig.tool_latency_s must be >= 0, got {self.tool_latency_s}")
        if not 0 <= self.max_engine_errors <= 1:
            raise ValueError(f"GRPOConfig.max_engine_errors must be in [0, 1], got {self.max_engine_errors}")
        if not self.sleep_tags or not set(self.sleep_tags) <= {"kv", "graphs", "weights"}:
            raise ValueError(f"GRPOConfig.sleep_tags must name some of kv, graphs, weights, got "
                             f"{list(self.sleep_tags)}")
        if self.trainer.kind == "megatron" and (self.atp, self.adp, self.ep or 1) != (1, 1, 1):
            raise ValueError(f"trainer 'megatron' runs one unsharded engine in one process: set atp = adp = 1 "
                             f"(got atp={self.atp}, adp={self.adp}, ep={self.ep})")
        if self.trainer.kind != "megatron" and self.megatron != MegatronOptions():
            raise ValueError(f"megatron options {self.megatron} are given but trainer.kind is "
                             f"{self.trainer.kind!r}: set trainer: megatron, or drop the megatron block")
        _ = self.engine_config  # validate early, with the engine's own messages

    @property
    def engine_config(self) -> EngineConfig:
        try:
            scheduler = self.engine.get("scheduler", {})
            if isinstance(scheduler, dict):  # anything else is refused by from_dict, with its value
                scheduler = {"schedule": "mux", **scheduler}
            return EngineConfig.from_dict({**self.engine, "scheduler": scheduler})
        except TypeError as exc:  # an unknown key
            raise ConfigTypeError(f"GRPOConfig.engine: {exc}; see megatron_rollout.engine.EngineConfig") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], **overrides: Any) -> "GRPOConfig":
        if not isinstance(raw, dict):
            raise ConfigTypeError(f"a GRPO config must be a mapping of keys, got {type(raw).__name__}")
        raw = {**raw, **{k: v for k, v in overrides.items() if v is not None}}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown GRPO config keys {unknown}; known: {sorted(known)}")
        if isinstance(raw.get("trainer"), str):  # `trainer: megatron`
            raw["trainer"] = {"kind": raw["trainer"]}
        nested = {"loss": LossConfig, "advantages": AdvantageConfig, "trainer": TrainerConfig,
                  "megatron": MegatronOptions}
        for key, kind in nested.items():
            if key in raw:
                raw[key] = build(kind, raw[key], key)
        return cls(**raw)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "GRPOConfig":
        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f) or {}, **overrides)


def make_env(cfg: GRPOConfig, tok: ByteTokenizer) -> Env:
    if cfg.env == "lookup":
        return LookupEnv(tok, latency_s=cfg.tool_latency_s)
    if cfg.env == "guess":
        return GuessDigitEnv(tok, latency_s=cfg.tool_latency_s, max_turns=cfg.max_turns)
    task, rubric = TASKS[cfg.env]
    return SingleTurnEnv(task, rubric, tok, latency_s=cfg.tool_latency_s)


def _episodes(cfg: GRPOConfig, tok: ByteTokenizer, step: int, replica: int, replicas: int) -> list[Episode]:
    """This replica's share of the step's groups (g = replica, replica + replicas, ...): the same
    groups, seeds and samples whatever the layout."""
    rng = random.Random(f"{cfg.seed}-{step}")
    seeds = [(rng.randrange(2**31), [rng.randrange(2**40) for _ in range(cfg.group_size)])
             for _ in range(cfg.prompts_per_step)]
    return [Episode(make_env(cfg, tok), seeds[g][0], g, sample_seed=s)
            for g in range(replica, cfg.prompts_per_step, replicas) for s in seeds[g][1]]


class GRPORun:
    """Builds the policy, the engine and the trainer; `step()` runs one GRPO iteration."""

    def __init__(self, cfg: GRPOConfig, placement: Placement | None = None) -> None:
        self.cfg = cfg
        self.place = placement or Placement.create(cfg.atp, cfg.adp)
        if cfg.prompts_per_step % self.place.rollout_replicas:
            raise ValueError(f"prompts_per_step={cfg.prompts_per_step} must be a multiple of the "
                             f"{self.place.rollout_replicas} rollout replicas")
        self.rank = self.place.rank
        self.tok = ByteTokenizer()
        torch.manual_seed(cfg.seed)
        self.megatron = None
        if cfg.trainer.kind == "megatron":
            self.megatron = build_megatron_policy(preset(cfg.model), cfg.megatron, cfg.engine_config, seed=cfg.seed,
                                                  lr=cfg.lr, betas=cfg.betas, loss=cfg.loss, trainer=cfg.trainer)
            self.engine, self.trainer = self.megatron.engine, self.megatron.trainer
        else:
            self.engine, self.trainer = self._native(cfg)
        budgets = (cfg.max_new_tokens,) if isinstance(cfg.max_new_tokens, int) else cfg.max_new_tokens
        sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=max(budgets),
                                  stop_token_ids=(self.tok.eos_id,))
        self.rollout_cfg = RolloutConfig(sampling, max_turns=cfg.max_turns, turn_max_new_tokens=budgets)
        self.step_index = 0
        self.cuda = self.engine.model.device.type == "cuda"
        self._weights_mode = "shared" if self.megatron is not None and self.megatron.shared else "copied"

    @property
    def policy(self) -> torch.nn.Module:
        """The trained model: the native `MoETransformer`, or the GPTModel (in Megatron's DDP wrapper)."""
        return self.trainer.model

    def _native(self, cfg: GRPOConfig) -> tuple[RolloutEngine, NativeTrainer]:
        policy = MoETransformer(preset(cfg.model)).init_weights(cfg.seed)
        if self.place.distributed:
            for p in policy.parameters():  # identical start on every rank, whatever the init did
                dist.broadcast(p.data, src=0, group=self.place.group)
        # A separate module for the engine (a shard of it when sharded): every update is a hot swap.
        engine = self.place.make_engine(policy, cfg.engine_config)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)
        # The initial policy is the reference whatever kl_coef is, so the KL is always measured.
        return engine, NativeTrainer(policy, optimizer, cfg.loss, cfg.trainer, ref_model=copy.deepcopy(policy),
                                     process_group=self.place.group)

    def _peak_gib(self) -> float | None:
        """Peak GPU memory allocated since the last call (None off the GPU)."""
        if not self.cuda:
            return None
        peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        return peak

    def step(self) -> dict[str, Any]:
        cfg, step, place = self.cfg, self.step_index, self.place
        self._peak_gib()
        t0 = time.perf_counter()
        episodes = _episodes(cfg, self.tok, step, place.rollout_index, place.rollout_replicas)
        local = place.rollout(self.engine, episodes, self.rollout_cfg)
        rollout_peak = self._peak_gib()
        ts = time.perf_counter()
        slept = sleep(self.engine, cfg.sleep_tags)
        # the device's free bytes (CUDA only): address-stable memory is the driver's, not torch's
        freed = None if slept["before"] is None else slept["after"]["free"] - slept["before"]["free"]
        sleep_s = time.perf_counter() - ts
        asleep_gib = torch.cuda.memory_allocated() / 2**30 if self.cuda else None
        mine = local.result
        gathered = place.all_gather((mine.trajectories, mine.stats) if mine is not None else None)
        trajs: list[Trajectory] = [t for g in gathered if g is not None for t in g[0]]
        stats = [g[1] for g in gathered if g is not None]
        self._check_engine_errors(trajs, step)
        t1 = time.perf_counter()
        batch = collate(trajs, self.tok.pad_id)
        adv = grpo_advantages(batch.rewards, batch.group_ids, cfg.advantages)
        # This trainer replica's share: whole groups, round-robin over ranks.
        keep = (adv.keep & (batch.group_ids % place.world == place.rank)).nonzero().squeeze(-1)
        device = next(self.trainer.model.parameters()).device
        sub = batch.select(keep).to(device) if keep.numel() else None
        train = self.trainer.train_step(sub, adv.values[keep].to(device) if sub is not None else None)
        if self.cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        train_peak = self._peak_gib()
        wake(self.engine)
        tw = time.perf_counter()
        version = self.sync_weights()
        t3 = time.perf_counter()
        per_rank = place.all_gather((train, (ts - t0, t2 - t1, t3 - tw, sleep_s, tw - t2)))
        metrics = {k: _mean([r[0][k] for r in per_rank if k in r[0]]) for k in TRAIN_KEYS}
        times = [r[1] for r in per_rank]
        rewards = batch.rewards
        makespan = max(s.makespan_s for s in stats)
        generated = sum(s.generated_tokens for s in stats)
        stale = [version - 1 - v for t in trajs for v in t.generated_versions]
        self.step_index += 1
        return {"step": step, "reward_mean": float(rewards.mean()),
                "reward_std": float(rewards.std(unbiased=False)), **metrics,
                "kept_fraction": float(adv.keep.float().mean()), "weight_version": version,
                "max_staleness": max(stale, default=0),
                "turns_mean": sum(t.num_turns for t in trajs) / len(trajs),
                "turns_max": max(t.num_turns for t in trajs), "episodes": len(trajs),
                "engine_errors": sum(t.error is not None for t in trajs), "generated_tokens": generated,
                "rollout_makespan_s": makespan, "tokens_per_s": generated / makespan if makespan > 0 else 0.0,
                "rollout_s": max(t[0] for t in times), "train_s": max(t[1] for t in times),
                "update_weights_s": max(t[2] for t in times), "sleep_s": max(t[3] for t in times),
                "wake_s": max(t[4] for t in times), "weights": self._weights_mode,
                "rollout_peak_gib": rollout_peak, "train_peak_gib": train_peak, "asleep_gib": asleep_gib,
                "sleep_freed_gib": None if freed is None else freed / 2**30,
                "peak_gpu_mem_gib": max(rollout_peak, train_peak) if self.cuda else None}

    def sync_weights(self) -> int:
        """The trainer's weights into the engine as the next version (sharing the trainer's storage,
        the engine copies and checks nothing: each tensor is its own parameter, only the version
        moves); returns that version."""
        version = self.engine.weight_version + 1
        self.engine.update_weights(self.trainer.named_weights(), version)
        return version

    def _check_engine_errors(self, trajs: list[Trajectory], step: int) -> None:
        """Same gathered trajectories on every rank, so every rank decides alike (no rank left waiting)."""
        errors = [t.error for t in trajs if t.error is not None]
        if not errors:
            return
        share = len(errors) / len(trajs)
        config = self.cfg.engine_config
        blocks, size = config.kv.num_blocks, config.scheduler.block_size
        msg = (f"step {step}: the engine ended {len(errors)} of {len(trajs)} episodes ({share:.0%}), e.g. "
               f"{errors[0]!r}; the KV pool is engine.kv.num_blocks={blocks} x engine.scheduler.block_size={size} "
               f"= {blocks * size} positions per rank")
        if share > self.cfg.max_engine_errors:
            raise RuntimeError(f"{msg}, over max_engine_errors={self.cfg.max_engine_errors:.0%}: raise "
                               f"engine.kv.num_blocks (or lower prompts_per_step x group_size)")
        log.warning("%s", msg)

    def close(self) -> None:
        self.place.close()
        if self.megatron is not None:
            self.megatron.close()


def sleep(engine: RolloutEngine, tags: tuple[str, ...] = ("kv",)) -> dict:
    """Hand the engine's memory back for the training step (sessions keep their tokens); its report."""
    return engine.sleep(tags)


def wake(engine: RolloutEngine) -> dict:
    """Take the engine's memory again before the weight update and the next rollout; its report."""
    return engine.wake_up()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class MetricsFile:
    """metrics.jsonl, rewritten atomically (tmp file + rename) after each step, so a run that fails
    before its first step leaves an earlier run's file as it was, and a reader never sees half a line.
    An existing file is refused unless `overwrite` (it is then replaced once the first step is in).

    The directory is taken for the run's lifetime: an exclusive lock on `.run.lock` in it, which the
    operating system drops when the process ends however it ends, so a second run into the same
    directory is refused at once instead of both running and one's metrics silently lost."""

    def __init__(self, path: Path, overwrite: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = open(path.parent / ".run.lock", "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "another process"
            self._lock.close()
            raise FileExistsError(f"{path.parent} is the output directory of a run in progress ({holder}); "
                                  f"choose another --out directory") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"pid {os.getpid()}")
        self._lock.flush()
        if path.exists() and not overwrite:
            self.close()
            raise FileExistsError(f"{path} exists (an earlier run's metrics); choose a new --out directory, or "
                                  f"pass --overwrite to replace it once this run's first step has finished")
        self.path, self.lines = path, []

    def append(self, metrics: dict[str, Any]) -> None:
        self.lines.append(json.dumps(metrics))
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        tmp.write_text("\n".join(self.lines) + "\n")
        os.replace(tmp, self.path)

    def close(self) -> None:
        """Give the directory back (the lock file stays; its lock is what counts)."""
        if not self._lock.closed:
            self._lock.close()


def run_grpo(cfg: GRPOConfig, out_dir: str | Path | None = None,
             on_step: Callable[[dict[str, Any]], None] | None = None, overwrite: bool = False,
             placement: Placement | None = None) -> list[dict[str, Any]]:
    """Run cfg.steps GRPO steps; rank 0 writes out_dir/metrics.jsonl (per step) and reward.png."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    writer = MetricsFile(Path(out_dir) / "metrics.jsonl", overwrite) if out_dir is not None and rank == 0 else None
    run = GRPORun(cfg, placement)
    history = []
    try:
        for _ in range(cfg.steps):
            m = run.step()
            history.append(m)
            if writer is not None:
                writer.append(m)
            if on_step is not None:
                on_step(m)
    finally:
        if placement is None:
            run.close()
        if writer is not None:
            writer.close()
    if writer is not None:
        plot_rewards(history, Path(out_dir) / "reward.png")
    return history


def plot_rewards(history: list[dict[str, float]], path: Path) -> None:
    """reward.png: the mean reward per step with its spread; skipped (a warning) without matplotlib,
    an optional dependency (the `plot` extra)."""
    try:
        import matplotlib
    except ImportError:
        log.warning("%s not drawn: matplotlib is not installed (pip install 'megatron_rollout[plot]'); "
                    "the metrics are in metrics.jsonl beside it", path)
        return

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
