"""n samples and forked sessions on an ATP pair of gloo CPU processes: the peer mirrors the forks
(its KV and sessions track the leader's), and the tokens equal one process's."""
from __future__ import annotations

import pytest

from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer
from tests.world import run_world

CFG = preset("tiny-moe")
PROMPTS = [[4, 5, 6, 7, 8, 9, 10], [200, 100]]
FIRST = SamplingParams(temperature=1.0, max_new_tokens=5, seed=5, n=3)
SECOND = SamplingParams(temperature=1.0, max_new_tokens=3, seed=6)
STEPS = 25  # enough for every turn to finish; every rank steps the same count


def _config() -> EngineConfig:
    return EngineConfig(scheduler=SchedulerConfig(schedule="chunked", block_size=4, max_batch_tokens=8))


def _sessions(engine, step, leader: bool) -> list[list[int]]:
    """Turn 0 with n samples, then one more turn in each of the forked sessions."""
    contexts = []
    if leader:
        session = engine.open_session()
        session.append(PROMPTS[0])
        session.submit(FIRST)
    step()
    if leader:
        sessions = [session, *session.forks()]
        for s in sessions:
            s.append([11, 12])
            s.submit(SECOND)
    step()
    if leader:
        contexts = [s.token_ids for s in sessions]
        for s in sessions:
            s.close()
    step()
    return contexts


def _world(rank: int, atp: int, adp: int) -> dict:
    from megatron_rollout.distributed import Runtime

    runtime = Runtime.start(atp, adp, "cpu", timeout_s=60)
    model = MoETransformer(CFG, comm=runtime.comm).init_weights(seed=3)
    results = runtime.generate(runtime.engine(model, _config()), PROMPTS, FIRST)
    engine = runtime.engine(model, _config())

    def step():
        for _ in range(STEPS):
            engine.step()

    contexts = _sessions(engine, step, runtime.leader)
    engine.check_integrity()
    return {"tokens": [r.token_ids for r in results] if results is not None else None, "contexts": contexts,
            "free": engine.pool.num_free == engine.pool.num_blocks and not engine.seqs}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_samples_and_forks_on_an_atp_pair_match_one_process() -> None:
    engine = RolloutEngine(MoETransformer(CFG).init_weights(seed=3), _config())
    want = [r.token_ids for r in engine.generate(PROMPTS, FIRST)]
    one = RolloutEngine(MoETransformer(CFG).init_weights(seed=3), _config())
    contexts = _sessions(one, lambda: [one.step() for _ in range(STEPS)], True)
    got = run_world(_world, 2, 2, 1, timeout=200)
    assert got[0]["tokens"] == want and len(want) == 6
    assert got[0]["contexts"] == contexts and len({tuple(c) for c in contexts}) > 1
    assert all(r["free"] for r in got)  # the peer closed its mirrored forks too
