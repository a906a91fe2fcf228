import copy

import pytest
import torch

from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SamplingParams
from megatron_rollout.model.sharding import full_shapes
from megatron_rollout.weights.store import WeightVersionError
from rl.envs import SingleTurnEnv
from rl.envs.single_turn import TASKS
from rl.objective import LossConfig
from rl.rollout import Episode, RolloutConfig, rollout
from rl.trainer import NativeTrainer, TrainerConfig, all_reduce_grads
from rl.trajectory import collate
from tests.world import run_world


def _batch(model, tok, n=4, seed=0):
    engine = RolloutEngine(copy.deepcopy(model), EngineConfig(kv=KVConfig(num_blocks=64)))
    task, rubric = TASKS["digits"]
    eps = [Episode(SingleTurnEnv(task, rubric, tok), seed=seed, group_id=0, sample_seed=seed * 100 + i)
           for i in range(n)]
    return collate(rollout(engine, eps, RolloutConfig(SamplingParams(max_new_tokens=6))).trajectories, tok.pad_id)


def _seq_logprob(trainer, batch):
    return (trainer.logprobs(batch.input_ids) * batch.loss_mask).sum(-1)


def test_named_weights_are_full_megatron_names(policy):
    trainer = NativeTrainer(policy, torch.optim.SGD(policy.parameters(), lr=0.1), LossConfig())
    named = dict(trainer.named_weights())
    assert {n: tuple(t.shape) for n, t in named.items()} == full_shapes(policy.cfg)


def test_step_moves_logprobs_with_advantage_sign(policy, tok):
    batch = _batch(policy, tok)
    trainer = NativeTrainer(policy, torch.optim.Adam(policy.parameters(), lr=1e-3), LossConfig(tis_cap=2.0),
                            TrainerConfig(num_minibatches=2))
    before = _seq_logprob(trainer, batch)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    metrics = trainer.train_step(batch, adv)
    delta = _seq_logprob(trainer, batch) - before
    assert (delta[[0, 2]] > 0).all() and (delta[[1, 3]] < 0).all(), delta
    assert metrics["rollout_abs_diff"] < 1e-5 and metrics["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["tokens"] == pytest.approx(12.0)  # 4 rows x 6 tokens over 2 minibatches
    with pytest.raises(ValueError, match="advantages"):
        trainer.train_step(batch, torch.ones(3))


def test_kl_to_reference_starts_at_zero_then_grows(policy, tok):
    batch = _batch(policy, tok)
    trainer = NativeTrainer(policy, torch.optim.Adam(policy.parameters(), lr=3e-3), LossConfig(kl_coef=0.1))
    assert trainer.ref_model is not None and trainer.ref_model is not policy
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    first = trainer.train_step(batch, adv)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)
    for _ in range(3):
        last = trainer.train_step(batch, adv)
    assert last["kl"] > 1e-4
    no_kl = NativeTrainer(policy, torch.optim.SGD(policy.parameters(), lr=0.1), LossConfig())
    assert no_kl.ref_model is None


def test_empty_local_batch_changes_nothing(policy):
    trainer = NativeTrainer(policy, torch.optim.Adam(policy.parameters(), lr=1e-2), LossConfig())
    before = [p.clone() for p in policy.parameters()]
    assert trainer.train_step(None, None) == {}
    assert all(torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_hot_swap_equals_fresh_engine_and_refuses_stale(policy, tok):
    engine = RolloutEngine(copy.deepcopy(policy), EngineConfig(kv=KVConfig(num_blocks=64)))
    prompts = [[tok.bos_id, *tok.encode("Digits please: ")], [tok.bos_id, *tok.encode("abc")]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    seeded = [SamplingParams(max_new_tokens=8, seed=s) for s in (1, 2)]
    old = engine.generate(prompts, greedy)

    trainer = NativeTrainer(policy, torch.optim.Adam(policy.parameters(), lr=2e-2), LossConfig())
    batch = _batch(policy, tok)
    trainer.train_step(batch, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    engine.update_weights(trainer.named_weights(), 1)
    assert engine.weight_version == 1
    fresh = RolloutEngine(copy.deepcopy(policy), EngineConfig(kv=KVConfig(num_blocks=64)))
    for params in (greedy, seeded):
        got, want = engine.generate(prompts, params), fresh.generate(prompts, params)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        for g, w in zip(got, want):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-6)
        assert all(set(g.weight_versions) == {1} for g in got)
    new = engine.generate(prompts, greedy)
    assert [n.logprobs for n in new] != [o.logprobs for o in old]  # the swap really changed the weights

    snapshot = {n: t.clone() for n, t in engine.model.named_parameters()}
    for stale in (1, 0):
        with pytest.raises(WeightVersionError, match="stale"):
            engine.update_weights({n: t + 1 for n, t in trainer.named_weights()}, stale)
    assert engine.weight_version == 1
    assert all(torch.equal(snapshot[n], t) for n, t in engine.model.named_parameters())
    assert [g.token_ids for g in engine.generate(prompts, greedy)] == [n.token_ids for n in new]


def _world(rank):
    """Both data-parallel checks in one world (one start-up for both)."""
    import torch

    from megatron_rollout.model.config import preset
    from megatron_rollout.model.transformer import MoETransformer
    from megatron_rollout.tokenizer import ByteTokenizer

    torch.set_num_threads(1)
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    a.grad = torch.full((2,), float(rank + 1))
    if rank == 1:
        b.grad = torch.tensor([2.0, 4.0, 6.0])
    all_reduce_grads([a, b])

    model = MoETransformer(preset("tiny-moe")).init_weights(0)
    batch = _batch(model, ByteTokenizer(), seed=rank)  # different data per rank
    trainer = NativeTrainer(model, torch.optim.Adam(model.parameters(), lr=1e-2), LossConfig(),
                            TrainerConfig(num_minibatches=2))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]) * (rank + 1)
    trainer.train_step(batch if rank == 0 else batch.select([0, 1]), adv if rank == 0 else adv[:2])
    return (a.grad.tolist(), b.grad.tolist()), [float(p.detach().double().sum()) for p in model.parameters()]


def test_data_parallel_grads_averaged_and_ranks_stay_identical():
    (g0, w0), (g1, w1) = run_world(_world, 2, timeout=180)
    # mean of 1 and 2; a gradient missing on rank 0 counts as zeros
    assert g0 == g1 == ([1.5, 1.5], [1.0, 2.0, 3.0])
    assert w0 == w1  # different local data, identical weights after the averaged step
    from megatron_rollout.model.config import preset
    from megatron_rollout.model.transformer import MoETransformer

    fresh = MoETransformer(preset("tiny-moe")).init_weights(0)
    assert w0 != [float(p.detach().double().sum()) for p in fresh.parameters()]  # the step moved the weights
