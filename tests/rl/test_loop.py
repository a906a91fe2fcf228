import dataclasses
import json
from pathlib import Path

import pytest

from rl.loop import GRPOConfig, run_grpo
from rl.objective import LossConfig
from tests.world import run_world

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"
REQUIRED = {"step", "reward_mean", "reward_std", "kl", "clip_fraction", "rollout_makespan_s", "tokens_per_s",
            "weight_version"}


def test_config_from_yaml_and_overrides():
    cfg = GRPOConfig.from_yaml(CONFIG, steps=3)
    assert cfg.steps == 3 and cfg.env == "digits" and cfg.engine["schedule"] == "mux"
    assert cfg.loss == LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.001, tis_cap=2.0)
    assert cfg.trainer.num_minibatches == 2
    with pytest.raises(ValueError, match="unknown GRPO config keys"):
        GRPOConfig.from_dict({"stepz": 3})
    with pytest.raises(ValueError, match="unknown env"):
        GRPOConfig(env="chess")
    with pytest.raises(ValueError):
        GRPOConfig(engine={"schedule": "sometimes"})


@pytest.mark.slow
def test_grpo_learns_digits(tmp_path):
    cfg = GRPOConfig.from_yaml(CONFIG, steps=30)
    history = run_grpo(cfg, tmp_path)
    rewards = [m["reward_mean"] for m in history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last - first >= 0.15, rewards
    assert [m["weight_version"] for m in history] == list(range(1, 31))
    assert all(m["max_staleness"] == 0 for m in history)  # synchronous loop: always on-policy
    assert all(m["rollout_abs_diff"] < 1e-4 for m in history)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 30 and REQUIRED <= set(lines[0])
    assert lines[-1]["reward_mean"] == pytest.approx(rewards[-1])
    assert (tmp_path / "reward.png").stat().st_size > 1000


def test_multi_turn_tool_task_end_to_end(tmp_path):
    cfg = GRPOConfig(env="guess", max_turns=3, tool_latency_s=0.01, max_new_tokens=3, prompts_per_step=2,
                     group_size=4, steps=2, engine={"schedule": "mux", "num_blocks": 64})
    history = run_grpo(cfg, tmp_path)
    assert [m["weight_version"] for m in history] == [1, 2]
    assert all(1 < m["turns_mean"] <= 3 for m in history)
    assert all(0.0 <= m["reward_mean"] <= 1.0 for m in history)
    assert all(0 < m["generated_tokens"] <= 3 * 8 * m["turns_mean"] for m in history)


def _two_rank_run(rank, out):
    import torch

    cfg = dataclasses.replace(GRPOConfig.from_yaml(CONFIG), steps=2, prompts_per_step=2, group_size=4)
    from rl.loop import GRPORun

    run = GRPORun(cfg)
    history = [run.step() for _ in range(cfg.steps)]
    if rank == 0:
        run_grpo(dataclasses.replace(cfg, steps=1), out)
    else:
        run_grpo(dataclasses.replace(cfg, steps=1), out + "-rank1")
    return [float(p.detach().double().sum()) for p in run.policy.parameters()], history, \
        [float(p.detach().double().sum()) for p in run.engine.model.parameters()], torch.__version__


def test_two_ranks_stay_in_sync_and_only_rank0_writes(tmp_path):
    out = str(tmp_path / "run")
    (w0, h0, e0, _), (w1, h1, e1, _) = run_world(_two_rank_run, 2, out, timeout=240)
    assert w0 == w1 and e0 == e1 == w0  # gradients averaged; engine got the trained weights
    assert [m["reward_mean"] for m in h0] == [m["reward_mean"] for m in h1]  # metrics averaged over ranks
    assert Path(out, "metrics.jsonl").exists() and not Path(out + "-rank1").exists()
