"""n samples, top and prompt logprobs on the CUDA runner (decode graphs, phase streams).

The forked samples' partial-block copy is issued on the caller's stream before any forward that
reads it; these tests check the tokens and logprobs that depend on it. Run on a GPU machine with
`python -m pytest -q tests/engine/test_samples_gpu.py`.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.engine.api import sample_seed
from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture
def model():
    """A builder: every engine gets a model of its own (a runner may re-lay its weights out)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = preset("tiny-moe").replace(dtype="bfloat16", max_position_embeddings=512)
    return lambda: MoETransformer(cfg, device="cuda").init_weights(5)


def _engine(model, schedule: str) -> RolloutEngine:
    return RolloutEngine(model(), EngineConfig(scheduler=SchedulerConfig(schedule, block_size=16, max_batch_tokens=64),
                                             kv=KVConfig(num_blocks=256)))


def _captured_cleanly(*engines: RolloutEngine) -> None:
    """No graph capture failed and fell back to eager (a failed capture once left torch's generator
    in capture mode for every later random op in the process)."""
    for e in engines:
        r = e.runner
        assert (r.capture_error, r.prefill_capture_error, r.spec_capture_error) == (None, None, None)


@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
def test_samples_share_one_prefill_on_the_cuda_runner(model, schedule):
    prompt = torch.randint(1, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()  # a partial block
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_stop=True)
    engine = _engine(model, schedule)
    results = engine.generate([prompt], dataclasses.replace(greedy, n=8))
    assert engine.stats.prefill_tokens == len(prompt)
    engines = [engine] + [_engine(model, schedule) for _ in range(6)]
    (alone,) = engines[1].generate([prompt], greedy)
    assert all(r.token_ids == alone.token_ids for r in results)  # every sample read the copied block right
    sampled = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_stop=True, seed=3, n=4)
    got = engines[2].generate([prompt], sampled)
    want = [e.generate([prompt], dataclasses.replace(sampled, n=1, seed=sample_seed(3, i)))[0]
            for i, e in enumerate(engines[3:])]
    assert [g.token_ids[0] for g in got] == [w.token_ids[0] for w in want]  # drawn from one prefill's row
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g.token_ids, w.token_ids))
    assert same >= 0.9 * 4 * 24  # later tokens: equal up to bf16 near-ties between batch shapes
    assert engine.runner.stats["graph_replays"] > 0
    _captured_cleanly(*engines)
    engine.check_integrity()


def test_top_and_prompt_logprobs_on_the_cuda_runner(model):
    prompt = torch.randint(1, 256, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=8, logprobs=4, prompt_logprobs=2)
    engine = _engine(model, "mux")
    (res,) = engine.generate([prompt], params)
    _captured_cleanly(engine)
    with torch.no_grad():
        logp = model().forward(torch.tensor([prompt + res.token_ids], device="cuda"))[0].float().log_softmax(-1)
    ids = prompt + res.token_ids
    for t in range(1, len(prompt)):
        assert res.prompt_logprobs[t][prompt[t]] == pytest.approx(float(logp[t - 1, prompt[t]]), abs=5e-2)
    for t, top in enumerate(res.top_logprobs):
        row = logp[len(prompt) - 1 + t]
        assert top[ids[len(prompt) + t]] == pytest.approx(float(row[ids[len(prompt) + t]]), abs=5e-2)
        assert len(top) >= 4
