import asyncio
import copy

import pytest
import torch

from megatron_rollout.engine import (
    EngineConfig,
    KVConfig,
    RolloutEngine,
    SamplingParams,
    SchedulerConfig,
    SpeculativeConfig,
)
from rl.envs import Env, GuessDigitEnv, Observation, SingleTurnEnv
from rl.envs.single_turn import TASKS
from rl.objective import LossConfig
from rl.rollout import Episode, RolloutConfig, rollout
from rl.trainer import NativeTrainer
from rl.trajectory import NOT_GENERATED, collate


def _engine(model, schedule="chunked", speculative=None):
    return RolloutEngine(copy.deepcopy(model), EngineConfig(scheduler=SchedulerConfig(schedule=schedule),
                                                            kv=KVConfig(num_blocks=128), speculative=speculative))


def _digits(tok, groups=3, size=4):
    task, rubric = TASKS["digits"]
    return [Episode(SingleTurnEnv(task, rubric, tok), seed=g, group_id=g, sample_seed=10 * g + i)
            for g in range(groups) for i in range(size)]


def _guess(tok, n, latency, max_turns=3):
    return [Episode(GuessDigitEnv(tok, latency_s=latency, max_turns=max_turns), seed=i // 2, group_id=i // 2,
                    sample_seed=i) for i in range(n)]


@pytest.mark.parametrize("schedule", ["chunked", "mux"])
def test_rollout_logprobs_equal_trainer_logprobs(policy, tok, schedule):
    engine = _engine(policy, schedule)
    single = rollout(engine, _digits(tok), RolloutConfig(SamplingParams(max_new_tokens=8)))
    multi = rollout(engine, _guess(tok, 4, 0.0), RolloutConfig(SamplingParams(max_new_tokens=4), max_turns=3))
    trainer = NativeTrainer(policy, torch.optim.SGD(policy.parameters(), lr=0.0), LossConfig())
    for result in (single, multi):
        batch = collate(result.trajectories, tok.pad_id)
        trainer_lp = trainer.logprobs(batch.input_ids)
        m = batch.loss_mask.bool()
        assert int(m.sum()) == result.stats.generated_tokens > 0
        diff = (trainer_lp[m] - batch.rollout_logprobs[m]).abs().max().item()
        assert diff < 1e-5, f"rollout vs trainer logprob mismatch {diff}"
        # same tokens, same numbers through the model's own helper
        assert torch.allclose(policy.token_logprobs(batch.input_ids)[m], trainer_lp[m], atol=1e-6)


def test_single_turn_trajectories(policy, tok):
    engine = _engine(policy)
    res = rollout(engine, _digits(tok, groups=2, size=3), RolloutConfig(SamplingParams(max_new_tokens=6)))
    assert [t.group_id for t in res.trajectories] == [0, 0, 0, 1, 1, 1]
    for t in res.trajectories:
        prompt = [tok.bos_id, *tok.encode(TASKS["digits"][0](t.group_id).text)]
        assert list(t.token_ids[: len(prompt)]) == prompt
        assert t.loss_mask == (0,) * len(prompt) + (1,) * 6
        assert set(t.generated_versions) == {0}
        assert all(v == NOT_GENERATED for v in t.weight_versions[: len(prompt)])
        gen = [i for i in t.token_ids[len(prompt):] if i < 256]
        assert t.reward == pytest.approx(sum(48 <= i <= 57 for i in gen) / len(gen) if gen else 0.0)
    assert res.stats.num_trajectories == 6 and res.stats.generated_tokens == 36
    assert not engine.has_work() and not engine.seqs  # every session closed


class _CountedGuess(GuessDigitEnv):
    """Records how many tool calls (`step`s) of its episodes are in flight at once."""

    def __init__(self, tok, calls: dict, **kwargs) -> None:
        super().__init__(tok, **kwargs)
        self.calls = calls

    async def step(self, generated_ids):
        self.calls["now"] += 1
        self.calls["peak"] = max(self.calls["peak"], self.calls["now"])
        try:
            return await super().step(generated_ids)
        finally:
            self.calls["now"] -= 1


def test_multi_turn_with_tool_latency(policy, tok):
    engine = _engine(policy, "mux")
    n, latency, turns = 12, 0.05, 3
    cfg = RolloutConfig(SamplingParams(max_new_tokens=3), max_turns=turns)
    calls = {"now": 0, "peak": 0}
    episodes = [Episode(_CountedGuess(tok, calls, latency_s=latency, max_turns=turns), seed=i // 2, group_id=i // 2,
                        sample_seed=i) for i in range(n)]
    res = rollout(engine, episodes, cfg)
    trajs = res.trajectories
    assert res.stats.num_turns == sum(t.num_turns for t in trajs) and res.stats.num_turns > n
    # Overlap counted, not timed: the engine's own compute on a loaded machine would blur a makespan bound.
    assert calls["peak"] > 1 and calls["now"] == 0, "tool calls did not overlap"
    for t in trajs:
        text = tok.decode([i for i, m in zip(t.token_ids, t.loss_mask) if not m])
        replies = text.count("\nno digit\n") + text.count("\nhigher\n") + text.count("\nlower\n")
        assert replies == t.num_turns - 1  # an observation between consecutive turns, masked out
        assert t.num_generated == 3 * t.num_turns
        assert 0.0 <= t.reward <= 1.0
    # continuation turns prefill only new tokens: prompt + observations + the last sampled token per turn
    new_tokens = sum(len(t.token_ids) - t.num_generated + t.num_turns for t in trajs)
    full_recompute = sum(len(t.token_ids) for t in trajs) * 2
    assert res.stats.prefill_tokens <= new_tokens < full_recompute
    assert not engine.seqs


class _Exploding(Env):
    async def reset(self, seed):
        return Observation((256, 65, 66))

    async def step(self, generated_ids):
        await asyncio.sleep(0.01)
        raise RuntimeError("tool crashed")


def test_env_error_propagates_and_frees_sessions(policy, tok):
    engine = _engine(policy)
    eps = _digits(tok, groups=1, size=3) + [Episode(_Exploding(), 0, 9)]
    with pytest.raises(RuntimeError, match="tool crashed"):
        rollout(engine, eps, RolloutConfig(SamplingParams(max_new_tokens=30)))
    assert not engine.seqs and not engine.has_work()
    engine.check_integrity()


def test_refused_turn_truncates_only_that_episode(policy, tok):
    # Prompt (43 tokens with BOS) + 3 generated + a 10-token reply exceeds 50: the second turn is refused.
    engine = RolloutEngine(copy.deepcopy(policy), EngineConfig(kv=KVConfig(num_blocks=64), max_model_len=50))
    res = rollout(engine, _guess(tok, 4, 0.0), RolloutConfig(SamplingParams(max_new_tokens=3), max_turns=3))
    assert all(t.num_turns == 1 for t in res.trajectories)
    assert all(t.truncated for t in res.trajectories if t.reward == 0.0)
    assert res.stats.truncated >= 1
    assert not engine.seqs


@pytest.mark.parametrize("schedule, group", [("chunked", False), ("mux", False), ("mux", True)])
def test_groups_under_ngram_drafts_share_their_prompt_and_keep_honest_logprobs(policy, tok, schedule, group):
    """The RL loop's groups (n samples of one prompt) under n-gram drafting, from their own contexts
    or (`group`) each other's too, sampled at temperature 1: nothing is refused, each group's prompt
    is prefilled once, and every generated token's logprob is the trainer's."""
    engine = _engine(policy, schedule, SpeculativeConfig("ngram", 3, ngram_min=1, group=group))
    result = rollout(engine, _digits(tok, groups=2, size=4), RolloutConfig(SamplingParams(max_new_tokens=12)))
    prompts = [len(tok.encode(TASKS["digits"][0](g).text)) + 1 for g in range(2)]  # + BOS
    assert result.stats.engine_errors == 0 and result.stats.prefill_tokens == sum(prompts)
    assert engine.stats.drafted_tokens > 0 and (engine.stats.copied_drafts > 0) == group
    batch = collate(result.trajectories, tok.pad_id)
    trainer = NativeTrainer(policy, torch.optim.SGD(policy.parameters(), lr=0.0), LossConfig())
    m = batch.loss_mask.bool()
    assert int(m.sum()) == result.stats.generated_tokens > 0
    assert (trainer.logprobs(batch.input_ids)[m] - batch.rollout_logprobs[m]).abs().max().item() < 1e-5


def test_a_group_prompt_is_prefilled_once(policy, tok):
    episodes = _digits(tok, groups=3, size=4)
    prompts = [len(tok.encode(TASKS["digits"][0](g).text)) + 1 for g in range(3)]  # + BOS
    shared = rollout(_engine(policy), episodes, RolloutConfig(SamplingParams(max_new_tokens=6)))
    alone = rollout(_engine(policy), _digits(tok, groups=3, size=4),
                    RolloutConfig(SamplingParams(max_new_tokens=6), share_prompt=False))
    assert shared.stats.prefill_tokens == sum(prompts)
    assert alone.stats.prefill_tokens > sum(prompts)
    assert [t.group_id for t in shared.trajectories] == [t.group_id for t in alone.trajectories]
    # sample 0 of each group draws with its episode's own turn-0 seed: the same tokens either way
    assert [shared.trajectories[i].token_ids for i in (0, 4, 8)] == [alone.trajectories[i].token_ids for i in (0, 4, 8)]
    assert len({t.token_ids for t in shared.trajectories[:4]}) > 1


def test_a_group_too_large_for_the_pool_at_once_runs_episode_by_episode(policy, tok):
    # 21 prompt tokens + 6: one episode needs 2 blocks of 16, the group of 4 at once 1 + 4 x 1 = 5 of the 4
    engine = RolloutEngine(copy.deepcopy(policy), EngineConfig(kv=KVConfig(num_blocks=4)))
    res = rollout(engine, _digits(tok, groups=2, size=4), RolloutConfig(SamplingParams(max_new_tokens=6)))
    assert res.stats.engine_errors == 0 and all(t.num_generated == 6 for t in res.trajectories)
    assert res.stats.prefill_tokens > 2 * 21
