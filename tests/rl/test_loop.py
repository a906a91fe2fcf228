import dataclasses
import json
import logging
from pathlib import Path

import pytest

from rl.loop import GRPOConfig, run_grpo
from rl.objective import LossConfig
from tests.world import run_world

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grpo_tiny_cpu.yaml"
TOOL_CONFIG = CONFIG.with_name("grpo_tool_cpu.yaml")
REQUIRED = {"step", "reward_mean", "reward_std", "kl", "clip_fraction", "rollout_makespan_s", "tokens_per_s",
            "weight_version", "rollout_s", "train_s", "update_weights_s", "turns_mean", "turns_max"}


def test_config_from_yaml_and_overrides():
    cfg = GRPOConfig.from_yaml(CONFIG, steps=3)
    assert cfg.steps == 3 and cfg.env == "digits" and cfg.engine["scheduler"]["schedule"] == "mux"
    assert cfg.loss == LossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.001, tis_cap=2.0)
    assert cfg.trainer.num_minibatches == 2
    with pytest.raises(ValueError, match="unknown GRPO config keys"):
        GRPOConfig.from_dict({"stepz": 3})
    with pytest.raises(ValueError, match="unknown env"):
        GRPOConfig(env="chess")
    with pytest.raises(ValueError):
        GRPOConfig(engine={"scheduler": {"schedule": "sometimes"}})
    with pytest.raises(ValueError, match=r"GRPOConfig.engine: EngineConfig has no field \['num_blocks'\]"):
        GRPOConfig(engine={"num_blocks": 64})  # the flat spelling is gone: kv: {num_blocks: 64}
    assert GRPOConfig(engine={"kv": {"num_blocks": 64}}).engine_config.scheduler.schedule.value == "mux"


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
                     group_size=4, steps=2, engine={"scheduler": {"schedule": "mux"}, "kv": {"num_blocks": 64}})
    history = run_grpo(cfg, tmp_path)
    assert [m["weight_version"] for m in history] == [1, 2]
    assert all(1 < m["turns_mean"] <= 3 for m in history)
    assert all(0.0 <= m["reward_mean"] <= 1.0 for m in history)
    assert all(0 < m["generated_tokens"] <= 3 * 8 * m["turns_mean"] for m in history)


def test_tool_config():
    cfg = GRPOConfig.from_yaml(TOOL_CONFIG)
    assert cfg.env == "lookup" and cfg.max_turns == 2 and cfg.max_new_tokens == (2, 1)
    assert cfg.tool_latency_s > 0 and cfg.loss.kl_coef == 0.05 and cfg.engine["scheduler"]["schedule"] == "mux"
    assert GRPOConfig.from_yaml(TOOL_CONFIG, atp=2, adp=2, ep=4).ep == 4
    with pytest.raises(ValueError, match="ep must equal atp x adp = 4"):
        GRPOConfig.from_yaml(TOOL_CONFIG, atp=2, adp=2, ep=2)
    with pytest.raises(ValueError, match="max_turns must be >= 2"):
        GRPOConfig(env="lookup", max_turns=1)


@pytest.mark.parametrize("raw,message", [
    ({"lr": "fast"}, "GRPOConfig.lr must be float, got 'fast' (str)"),
    ({"steps": 2.5}, "GRPOConfig.steps must be int, got 2.5 (float)"),
    ({"betas": 0.9}, "GRPOConfig.betas must be a list of 2 values (float, float), got 0.9 (float)"),
    ({"betas": [0.9, "x"]}, "GRPOConfig.betas[1] must be float, got 'x'"),
    ({"loss": "ppo"}, "loss must be a mapping of LossConfig fields (clip_low,"),
    ({"loss": {"kl_coef": "big"}}, "LossConfig.kl_coef must be float, got 'big'"),
    ({"loss": {"kl": 0.1}}, "unknown loss keys ['kl']"),
    ({"trainer": {"num_minibatches": True}}, "TrainerConfig.num_minibatches must be int, got True"),
    ({"max_new_tokens": [2, "8"]}, "max_new_tokens must be an int >= 1 or a list of them, got [2, '8']"),
    ({"engine": {"kv": {"num_blockz": 3}}}, "GRPOConfig.engine: "),
    ({"env": 3}, "GRPOConfig.env must be str, got 3 (int)"),
])
def test_wrong_yaml_types_name_the_key(raw, message):
    with pytest.raises(ValueError) as info:  # ConfigTypeError is a ValueError (and a TypeError)
        GRPOConfig.from_dict(raw)
    assert message in str(info.value)


def test_yaml_numbers_are_normalised():
    cfg = GRPOConfig.from_dict({"lr": 1, "betas": [0.9, 0.95], "loss": {"kl_coef": 0}})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.betas == (0.9, 0.95)
    assert isinstance(cfg.loss.kl_coef, float)


def _small(**kw):
    base = dict(prompts_per_step=2, group_size=4, steps=2, max_new_tokens=4, engine={"kv": {"num_blocks": 64}})
    return GRPOConfig(**{**base, **kw})


def test_metrics_record_times_turns_and_kl(tmp_path):
    cfg = _small(env="lookup", max_turns=2, max_new_tokens=(2, 4), tool_latency_s=0.01)
    history = run_grpo(cfg, tmp_path)
    for m in history:
        assert m["turns_mean"] == 2 and m["turns_max"] == 2 and m["episodes"] == 8
        assert m["rollout_s"] >= 0.01 and m["train_s"] > 0 and m["update_weights_s"] > 0
        assert m["rollout_s"] >= m["rollout_makespan_s"] > 0
        assert 0 < m["generated_tokens"] <= 8 * (2 + 4)
        assert m["sleep_s"] > 0 and m["wake_s"] > 0 and m["weights"] == "copied"
        assert m["peak_gpu_mem_gib"] is None and m["asleep_gib"] is None  # CPU: no GPU figures
    from rl.plot import main as plot_main

    plot_main([str(tmp_path)])
    assert (tmp_path / "steps.png").stat().st_size > 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and REQUIRED <= set(lines[0]) and lines[1]["rollout_s"] == history[1]["rollout_s"]
    # digits: dense rewards, so a step with a scored sample moves the policy (step 0's 8 samples may
    # all score 0: no signal); the KL is measured even at kl_coef 0
    history = run_grpo(_small(max_new_tokens=6, steps=3))
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first step trains the initial policy
    trained = [i for i, m in enumerate(history[:-1]) if m["reward_std"] > 0]
    assert trained and history[trained[0] + 1]["kl"] > 1e-5


def test_rerun_that_fails_early_keeps_the_old_metrics(tmp_path):
    old = '{"step": 0, "reward_mean": 0.5}\n'
    (tmp_path / "metrics.jsonl").write_text(old)
    with pytest.raises(FileExistsError, match="--overwrite"):
        run_grpo(_small(), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == old
    tiny_pool = _small(engine={"kv": {"num_blocks": 1}, "scheduler": {"block_size": 4}})  # fails in its first step
    with pytest.raises(RuntimeError):
        run_grpo(tiny_pool, tmp_path, overwrite=True)
    assert (tmp_path / "metrics.jsonl").read_text() == old
    run_grpo(dataclasses.replace(_small(), steps=1), tmp_path, overwrite=True)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["weight_version"] == 1
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_kv_pool_too_small_fails_with_the_figure(caplog):
    # "Digits please (NN): " with BOS is 21 tokens: it does not fit in 2 blocks of 4 positions.
    with pytest.raises(RuntimeError, match=r"ended 8 of 8 episodes \(100%\).*num_blocks=2 x "
                                           r"engine.scheduler.block_size=4 = 8 positions.*raise engine.kv.num_blocks"):
        run_grpo(_small(engine={"kv": {"num_blocks": 2}, "scheduler": {"block_size": 4}}))
    caplog.set_level(logging.WARNING, logger="rl.loop")
    tiny = {"kv": {"num_blocks": 2}, "scheduler": {"block_size": 4}}
    history = run_grpo(_small(engine=tiny, max_engine_errors=1.0, steps=1))
    assert history[0]["engine_errors"] == 8 and "ended 8 of 8 episodes" in caplog.text


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


def _sharded_run(rank, out):
    import torch

    from megatron_rollout.weights.store import gather_full_state
    from rl.loop import GRPORun
    from rl.placement import Placement

    cfg = _small(env="lookup", max_turns=2, max_new_tokens=(2, 3), tool_latency_s=0.01, atp=2, adp=2, ep=4)
    place = Placement.create(cfg.atp, cfg.adp)
    history = run_grpo(cfg, out if rank == 0 else None, placement=place)
    run = GRPORun(dataclasses.replace(cfg, steps=1), place)  # a second run in the same world: one step, checked
    run.step()
    rt = place.runtime
    engine_full = gather_full_state(run.engine.model.state_dict(), run.policy.cfg, rt.comm.shard,
                                    lambda obj: rt.comm.all_gather_object(obj, context="weights"))
    trainer_full = dict(run.trainer.named_weights())
    same = all(torch.equal(engine_full[n], trainer_full[n]) for n in trainer_full)
    local = sum(p.numel() for p in run.engine.model.parameters()) < sum(p.numel() for p in run.policy.parameters())
    return dict(history=history, same=same, sharded=local, leader=rt.leader, replica=rt.replica,
                weights=[float(p.detach().double().sum()) for p in run.policy.parameters()])


def test_sharded_rollout_atp2_adp2_ep4_with_data_parallel_trainers(tmp_path):
    out = str(tmp_path / "run")
    res = run_world(_sharded_run, 4, out, timeout=400)
    assert sorted((r["replica"], r["leader"]) for r in res) == [(0, False), (0, True), (1, False), (1, True)]
    for r in res:
        assert r["sharded"] and r["same"]  # the engine holds shards; update_weights resharded the trainer's
        assert r["weights"] == res[0]["weights"]  # gradients all-reduced over the trainer's own group
        assert r["history"] == res[0]["history"]  # rewards and metrics gathered over ranks
    h = res[0]["history"]
    assert [m["weight_version"] for m in h] == [1, 2]
    assert all(m["episodes"] == 2 * 4 and m["turns_max"] == 2 and m["engine_errors"] == 0 for m in h)
    lines = Path(out, "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["reward_mean"] == h[1]["reward_mean"]
    assert Path(out, "reward.png").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_output_directory_is_taken_for_the_run(tmp_path):
    from rl.loop import MetricsFile

    first = MetricsFile(tmp_path / "metrics.jsonl")
    with pytest.raises(FileExistsError, match="run in progress .*pid"):
        MetricsFile(tmp_path / "metrics.jsonl")  # a second run into the same fresh directory
    first.append({"step": 0})
    first.close()
    MetricsFile(tmp_path / "metrics.jsonl", overwrite=True).close()  # free again once the first run ended


def test_reward_plot_is_skipped_without_matplotlib(tmp_path, monkeypatch, caplog):
    import sys

    from rl.loop import plot_rewards

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with caplog.at_level(logging.WARNING):
        plot_rewards([{"step": 0, "reward_mean": 0.1, "reward_std": 0.0}], tmp_path / "reward.png")
    assert not (tmp_path / "reward.png").exists()
    assert "matplotlib is not installed" in caplog.text


def test_train_grpo_script_errors_and_default_output(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "examples" / "train_grpo.py"
    bad = subprocess.run([sys.executable, str(script), "--config", str(TOOL_CONFIG), "--atp", "2", "--steps", "1"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert bad.returncode == 1 and "needs 2 processes" in bad.stderr and "Traceback" not in bad.stderr
    ok = subprocess.run([sys.executable, str(script), "--config", str(TOOL_CONFIG), "--steps", "1"],
                        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    (run,) = (tmp_path / "runs").iterdir()  # no --out: the metrics still land somewhere, named in the output
    assert run.name.startswith("grpo_tool_cpu-") and (run / "metrics.jsonl").exists() and str(run.name) in ok.stdout
