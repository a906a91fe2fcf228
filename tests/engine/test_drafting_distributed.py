"""Speculative decoding across gloo CPU processes: the drafts, the verification and the MTP
layer's forwards run in lockstep on every rank (ATP peers mirror their leader's drafts; replicas
without a row run matched forwards over nothing), and the greedy tokens are one process's plain ones.
n-gram drafts (no MTP layer) likewise, with `tail_rows`: each replica decides from the state its
leader plans, so its ATP peers draft alike; and with `streak_k` (under `off`), which the rows' verdicts decide."""
from __future__ import annotations

import pytest

from megatron_rollout.engine import (
    EngineConfig,
    MuxConfig,
    RolloutEngine,
    SamplingParams,
    SchedulerConfig,
    SpeculativeConfig,
)
from megatron_rollout.model.transformer import MoETransformer
from tests.model.test_mtp import CFG
from tests.world import run_world

PROMPTS = [[1, 2, 3, 4, 5], [7], [3, 3, 9, 0, 11, 2, 6]]
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_stop=True)
SCHEDULES = ("chunked", "mux")
MTP = tuple((schedule, SpeculativeConfig(k=2)) for schedule in SCHEDULES)
# the long prompt's prefill runs while two rows decode (drafting, under `tail_rows`), then three rows
# decode (not drafting); `off` runs every prefill before decode resumes: no tail, so it drafts always
NGRAM_PROMPTS = PROMPTS[:2] + [[3, 3, 9, 0, 11, 2, 6, 4, 8, 1, 10, 2, 5, 7, 3, 9, 0, 11, 2, 6]]
NGRAM = (("off", SpeculativeConfig("ngram", 3, ngram_min=1, streak_k=6)),
         ("chunked", SpeculativeConfig("ngram", 3, ngram_min=1, tail_rows=2)),
         ("mux", SpeculativeConfig("ngram", 3, ngram_min=1, tail_rows=2)))


def _config(schedule: str, speculative: SpeculativeConfig | None, mux: MuxConfig = MuxConfig()) -> EngineConfig:
    return EngineConfig(scheduler=SchedulerConfig(schedule=schedule, block_size=4, max_batch_tokens=8), mux=mux,
                        speculative=speculative)


def _world(rank: int, atp: int, adp: int, runs: tuple[tuple[str, SpeculativeConfig], ...] = MTP,
           mtp_layers: int = 1, prompts: list[list[int]] = PROMPTS, params: SamplingParams = PARAMS,
           mux: MuxConfig = MuxConfig()) -> dict:
    from megatron_rollout.distributed import Runtime

    runtime = Runtime.start(atp, adp, "cpu", timeout_s=60)
    model = MoETransformer(CFG.replace(mtp_num_layers=mtp_layers), comm=runtime.comm).init_weights(seed=0, std=0.3)
    out: dict = {}
    for schedule, speculative in runs:
        engine = runtime.engine(model, _config(schedule, speculative, mux))
        results = runtime.generate(engine, prompts, params)
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


@pytest.mark.timeout(600)  # two processes on a shared 2-core machine
@pytest.mark.parametrize("atp,adp", [(2, 1), (1, 2)])
def test_ngram_greedy_tokens_equal_one_process_plain_decoding(atp: int, adp: int) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_stop=True)
    plain = RolloutEngine(MoETransformer(CFG.replace(mtp_num_layers=0)).init_weights(seed=0, std=0.3),
                          _config("chunked", None))
    want = [r.token_ids for r in plain.generate(NGRAM_PROMPTS, params)]
    # one boundary per `mux` segment: the long prefill spans decode iterations of the two other rows
    got = run_world(_world, atp * adp, atp, adp, NGRAM, 0, NGRAM_PROMPTS, params, MuxConfig("fixed:1"), timeout=480)
    for schedule, _ in NGRAM:
        assert got[0][schedule] == want, schedule
        assert got[0][f"{schedule} drafted"] > 0, schedule
        if atp > 1:  # ATP peers verify the drafts of their leader
            assert len({r[f"{schedule} drafted"] for r in got}) == 1, schedule


@pytest.mark.timeout(600)  # two processes on a shared 2-core machine
def test_ngram_samples_of_one_prompt_fork_alike_on_atp_peers() -> None:
    """n > 1 under n-gram drafts at ATP 2, from each sample's own context and (`mux`) the group's: the
    leader forks the samples and its peer mirrors them; greedy samples are one process's plain tokens."""
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_stop=True, n=2)
    plain = RolloutEngine(MoETransformer(CFG.replace(mtp_num_layers=0)).init_weights(seed=0, std=0.3),
                          _config("chunked", None))
    want = [r.token_ids for r in plain.generate(PROMPTS[:2], params)]
    runs = (("chunked", SpeculativeConfig("ngram", 3, ngram_min=1)),
            ("mux", SpeculativeConfig("ngram", 3, ngram_min=1, group=True)))
    got = run_world(_world, 2, 2, 1, runs, 0, PROMPTS[:2], params, timeout=480)
    for schedule, _ in runs:
        assert got[0][schedule] == want and len(want) == 4, schedule
        assert got[0][f"{schedule} drafted"] > 0 and got[0][f"{schedule} drafted"] == got[1][f"{schedule} drafted"]
