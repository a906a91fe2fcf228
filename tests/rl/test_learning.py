"""The main job's task learns, reproducibly, and would not if the sampler or the loss were broken.

`test_the_tool_task_learns` runs the README's GRPO job (configs/grpo_tool_cpu.yaml: the lookup
tool task, mux rollouts with tool latency) for 100 steps on seed 0; the broken variants run the
same 100 steps with a draw that gives every row of a batch one uniform (the members of a group
then agree, so GRPO sees no signal) or with the advantages' sign flipped, and must not learn.
Seeded runs reproduce exactly (batch-invariant CPU numerics, tests/engine/test_batch_invariance.py),
so each of these is one fixed outcome on a machine, not a draw.

The three 100-step runs are independent single-threaded processes started together on first use
(`histories`): on a 2-core machine they take about half the time one after another would, and
each test still reads only its own run.
"""
from concurrent.futures import Future, ProcessPoolExecutor

import pytest
import torch

import rl.loop
from megatron_rollout.engine import sampler
from rl.advantages import Advantages
from rl.loop import GRPOConfig, run_grpo
from tests.rl.draw_audit import draw_functions
from tests.rl.test_loop import TOOL_CONFIG
from tests.world import context

STEPS = 100
BROKEN = ("one uniform per batch", "advantages negated")
TIMING = {"rollout_makespan_s", "tokens_per_s", "rollout_s", "train_s", "update_weights_s", "sleep_s", "wake_s"}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gain(history: list[dict]) -> float:
    rewards = [m["reward_mean"] for m in history]
    return sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5


def test_same_seed_same_metrics():
    cfg = GRPOConfig.from_yaml(TOOL_CONFIG, steps=6)
    first, second = run_grpo(cfg), run_grpo(cfg)
    strip = [{k: v for k, v in m.items() if k not in TIMING} for m in first], \
        [{k: v for k, v in m.items() if k not in TIMING} for m in second]
    assert strip[0] == strip[1]
    assert len({m["loss"] for m in first}) == 6  # the metrics move: equality is not trivial


_grpo_advantages = rl.loop.grpo_advantages


def _negated(*args, **kwargs) -> Advantages:
    adv = _grpo_advantages(*args, **kwargs)
    return Advantages(-adv.values, adv.keep)


def _history(broken: str | None) -> list[dict]:
    """The main job's run for STEPS steps in this (fresh) process, broken as named or not at all."""
    torch.set_num_threads(1)
    if broken == "one uniform per batch":
        sampler._draw = draw_functions["shared_uniform"]
    elif broken == "advantages negated":
        rl.loop.grpo_advantages = _negated
    return run_grpo(GRPOConfig.from_yaml(TOOL_CONFIG, steps=STEPS))


@pytest.fixture(scope="module")
def histories():
    """{None (working) or a BROKEN name: that run's future}, all three started at once, each in a
    process of its own (one task per worker: a broken run's patch never reaches another run)."""
    with ProcessPoolExecutor(1 + len(BROKEN), mp_context=context(), max_tasks_per_child=1) as pool:
        yield {broken: pool.submit(_history, broken) for broken in (None, *BROKEN)}


def rewards(run: Future) -> list[float]:
    return [round(m["reward_mean"], 3) for m in run.result()]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_tool_task_learns(histories):
    history = histories[None].result()
    assert gain(history) >= 0.2, rewards(histories[None])


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("broken", BROKEN)
def test_it_does_not_learn_with_a_broken_sampler_or_loss(histories, broken):
    history = histories[broken].result()
    assert gain(history) < 0.1, rewards(histories[broken])
