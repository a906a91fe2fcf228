"""The rollout engine's public API on one process, on tiny random HF checkpoints: greedy tokens and
logprobs equal transformers' `generate` under every schedule; weight updates and KV release behave.
Every engine passes `check_integrity()` at teardown (see conftest). The parts have their own files:
`test_bookkeeping.py` (KV pressure, sharing, aborts), `test_execution.py` (sampling and stop rules),
`test_schedules.py` (schedule equivalence, `mux` epochs), `test_session.py`."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from megatron_rollout.engine import FinishReason, SamplingParams
from megatron_rollout.weights.store import WeightVersionError

from .common import GREEDY, SCHEDULES, SMALL, assert_same, drain, hf_greedy, prompts, small


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_greedy_equals_transformers(request, make_engine, family, schedule):
    hf, model = request.getfixturevalue(family)
    batch = prompts([1, 6, 11, 19], seed=1)
    lengths = [5, 8, 3, 6]
    engine = make_engine(model, small(schedule))
    results = engine.generate(batch, [SamplingParams(temperature=0.0, max_new_tokens=n) for n in lengths])
    for prompt, n, res in zip(batch, lengths, results):
        tokens, logprobs = hf_greedy(hf, prompt, n)
        assert res.token_ids == tokens
        assert res.logprobs == pytest.approx(logprobs, abs=1e-4)
        assert res.finish_reason is FinishReason.LENGTH and res.error is None
        assert res.weight_versions == [0] * n
    assert engine.stats.prefill_tokens == sum(len(p) for p in batch)
    assert engine.stats.decode_tokens == sum(lengths) - len(batch)
    if schedule == "mux":
        assert engine.schedule.rounds > 0 and not engine.schedule.busy
    assert engine.pool.num_free == engine.pool.num_blocks  # finished one-shot requests keep no KV


@pytest.mark.parametrize("block_size", [16, 64])
def test_greedy_equals_transformers_with_wider_kv_blocks(make_engine, qwen, block_size):
    """Blocks of 16 and 64 positions (the rollout's default and a FA3-friendlier page): prompts shorter
    than a block, across one and across several, continued across a block boundary."""
    hf, model = qwen
    batch = prompts([3, block_size - 2, block_size + 5, 100], seed=4)  # the model's max_model_len is 128
    config = small("chunked")
    config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, block_size=block_size))
    results = make_engine(model, config).generate(batch, SamplingParams(temperature=0.0, max_new_tokens=6))
    for prompt, res in zip(batch, results):
        tokens, logprobs = hf_greedy(hf, prompt, 6)
        assert res.token_ids == tokens
        assert res.logprobs == pytest.approx(logprobs, abs=1e-4)


def _perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def test_update_weights_then_generate_equals_a_fresh_engine(make_engine, qwen):
    _, base = qwen
    model = copy.deepcopy(base)
    new = _perturbed(base, seed=1)
    fresh_model = copy.deepcopy(base)
    fresh_model.load_state_dict(new)
    batch = prompts([13, 6], seed=18)
    engine = make_engine(model, SMALL)
    before = engine.generate(batch, GREEDY)  # the prompts' blocks are now in the prefix cache
    assert all(r.weight_versions == [0] * 6 for r in before)
    engine.update_weights(new, version=1)
    assert engine.weight_version == 1
    after = engine.generate(batch, GREEDY)
    expected = make_engine(fresh_model, SMALL).generate(batch, GREEDY)
    assert_same(after, expected)
    assert all(r.weight_versions == [1] * 6 and r.weight_version == 1 for r in after)
    assert any(a.token_ids != b.token_ids for a, b in zip(after, before))  # the update mattered


def test_stale_versions_are_refused_and_a_half_received_one_does_not_serve(make_engine, qwen):
    _, base = qwen
    model = copy.deepcopy(base)
    engine = make_engine(model, SMALL)
    v1, v2 = _perturbed(base, 1), _perturbed(base, 2)
    engine.update_weights(v1, version=1)
    for stale in (1, 0):
        with pytest.raises(WeightVersionError, match=f"weight version {stale} is stale: the engine is at 1"):
            engine.update_weights(v1, version=stale)
    names = sorted(v2)
    engine.update_weights({k: v2[k] for k in names[:5]}, version=2, final=False)
    assert engine.weights.pending == 2
    during = engine.generate(prompts([5]), GREEDY)  # staged is not serving: version 1 generates, and says so
    by_v1 = copy.deepcopy(base)
    by_v1.load_state_dict(v1)
    assert_same(during, make_engine(by_v1, SMALL).generate(prompts([5]), GREEDY))
    assert during[0].weight_versions == [1] * 6
    with pytest.raises(WeightVersionError, match="version 2 is half-applied; got a chunk of version 3"):
        engine.update_weights({names[5]: v2[names[5]]}, version=3, final=False)
    assert engine.weights.pending is None  # a refused chunk drops the pending version whole
    with pytest.raises(WeightVersionError, match="leaves .* tensors unset"):
        engine.update_weights({names[5]: v2[names[5]]}, version=2, final=True)
    assert engine.weight_version == 1  # the incomplete version was dropped whole (test_weight_updates.py)
    engine.update_weights({k: v2[k] for k in names[:6]}, version=2, final=False)
    engine.update_weights({k: v2[k] for k in names[6:]}, version=2, final=True)
    rid = engine.add_request(prompts([5])[0], GREEDY)
    out = engine.run_until([rid])[rid].result
    fresh = copy.deepcopy(base)
    fresh.load_state_dict(v2)
    assert_same([out], make_engine(fresh, SMALL).generate(prompts([5]), GREEDY))
    assert out.weight_versions == [2] * 6
    with pytest.raises(KeyError, match="unknown weight 'nope'"):
        engine.update_weights({"nope": torch.zeros(1)}, version=3)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({names[0]: torch.zeros(1)}, version=3)
    assert engine.weight_version == 2


def test_tokens_record_the_version_they_were_sampled_under(make_engine, qwen):
    _, base = qwen
    engine = make_engine(copy.deepcopy(base), SMALL)
    rid = engine.add_request(prompts([5])[0], SamplingParams(temperature=0.0, max_new_tokens=6))
    while len(engine.requests[rid].output) < 2:
        engine.step()
    engine.update_weights(_perturbed(base, 3), version=7)
    out = engine.run_until([rid])[rid].result
    k = out.weight_versions.count(0)
    assert k >= 2 and out.weight_versions == [0] * k + [7] * (6 - k)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_requests_record_their_admission_between_arrival_and_first_token(make_engine, qwen, schedule):
    """`RequestTimes.admitted` (what splits TTFT into queue and prefill in the replay report)."""
    _, model = qwen
    engine = make_engine(model, small(schedule))
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=3)) for p in prompts([9, 4, 14], 3)]
    outs = drain(engine)
    assert sorted(outs) == sorted(ids)
    for out in outs.values():
        t = out.times
        assert t.admitted is not None and t.arrival <= t.admitted <= t.first_token <= t.finish
