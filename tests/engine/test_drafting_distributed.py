"""MTP speculative decoding across gloo CPU processes: the drafts, the verification and the MTP
layer's forwards run in lockstep on every rank (ATP peers mirror their leader's drafts; replicas
without a row run matched forwards over nothing), and the greedy tokens are one process's plain ones."""
from __future__ import annotations

import pytest

from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams, SchedulerConfig, SpeculativeConfig
from megatron_rollout.model.transformer import MoETransformer
from tests.model.test_mtp import CFG
from tests.world import run_world

PROMPTS = [[1, 2, 3, 4, 5], [7], [3, 3, 9, 0, 11, 2, 6]]
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_stop=True)
SCHEDULES = ("chunked", "mux")


def _config(schedule: str, speculative: SpeculativeConfig | None) -> EngineConfig:
    return EngineConfig(scheduler=SchedulerConfig(schedule=schedule, block_size=4, max_batch_tokens=8),
                        speculative=speculative)


def _world(rank: int, atp: int, adp: int) -> dict:
    from megatron_rollout.distributed import Runtime

    runtime = Runtime.start(atp, adp, "cpu", timeout_s=60)
    model = MoETransformer(CFG, comm=runtime.comm).init_weights(seed=0, std=0.3)
    out: dict = {}
    for schedule in SCHEDULES:
        engine = runtime.engine(model, _config(schedule, SpeculativeConfig(k=2)))
        results = runtime.generate(engine, PROMPTS, PARAMS)
        engine.check_integrity()
        out[schedule] = None if results is None else [r.token_ids for r in results]
        out[f"{schedule} drafted"] = engine.stats.drafted_tokens
    return out


@pytest.mark.timeout(600)  # two processes on a shared 2-core machine
@pytest.mark.parametrize("atp,adp", [(2, 1), (1, 2)])
def test_greedy_tokens_equal_one_process_plain_decoding(atp: int, adp: int) -> None:
    plain = RolloutEngine(MoETransformer(CFG).init_weights(seed=0, std=0.3), _config("chunked", None))
    want = [r.token_ids for r in plain.generate(PROMPTS, PARAMS)]
    got = run_world(_world, atp * adp, atp, adp, timeout=480)
    for schedule in SCHEDULES:
        assert got[0][schedule] == want, schedule
        assert all(r[f"{schedule} drafted"] > 0 for r in got)
