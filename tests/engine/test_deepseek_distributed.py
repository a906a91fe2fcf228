"""DeepSeek-V3 (MLA, shared experts, biased group-limited routing) on gloo CPU processes.

Each rank loads its shard of one tiny random HF checkpoint (heads over ATP, routed experts over EP,
the latent cache replicated over ATP); the greedy tokens under every schedule equal transformers'
and the single-process engine's, and the logprobs stay within 1e-3 of transformers'. The shards
gather back to the full state, and a trainer's full state hot-swaps in.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.model import checkpoint as ckpt
from megatron_rollout.model.transformer import MoETransformer
from tests.model.test_deepseek import hf_greedy, make_checkpoint
from tests.world import run_world

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [9] * 7, [90, 60]]
STEPS = 5
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_stop=True)
SCHEDULES = ("off", "chunked", "mux")


def _world(rank: int, atp: int, adp: int, path: str) -> dict:
    from megatron_rollout.distributed import Runtime

    runtime = Runtime.start(atp, adp, "cpu", timeout_s=60)
    model = ckpt.load_pretrained(path, comm=runtime.comm)
    out: dict = {"local_experts": model.decoder.layers[1].mlp.experts.num_local,
                 "local_heads": model.decoder.layers[1].self_attention.heads}
    for schedule in SCHEDULES:
        engine = runtime.engine(model, EngineConfig(scheduler=SchedulerConfig(schedule=schedule, block_size=4,
                                                                              max_batch_tokens=8)))
        results = runtime.generate(engine, PROMPTS, PARAMS)
        engine.check_integrity()
        if results is not None:
            out[schedule] = [(r.token_ids, r.logprobs) for r in results]
    # This layout's shards gather back to the checkpoint's full Megatron state (MLA names included) ...
    from megatron_rollout.weights.store import gather_full_state

    full = gather_full_state(model.state_dict(), model.cfg, runtime.comm.shard,
                             lambda obj: runtime.comm.all_gather_object(obj, context="weights"))
    reference = ckpt.load_pretrained(path).state_dict()
    out["gathered_equal"] = set(full) == set(reference) and all(torch.equal(full[k], reference[k]) for k in full)
    # ... and a full state from a one-process trainer lands as this layout's shards
    engine = runtime.engine(model, EngineConfig(scheduler=SchedulerConfig(schedule="chunked", block_size=4)))
    engine.update_weights(_trainer(model.cfg).state_dict(), version=1)
    results = runtime.generate(engine, PROMPTS, PARAMS)
    if results is not None:
        out["swapped"] = [r.token_ids for r in results]
    return out


def _trainer(cfg) -> MoETransformer:
    return MoETransformer(cfg).init_weights(seed=11, std=0.2)


@pytest.mark.timeout(600)  # four processes on a shared 2-core machine: minutes under load
@pytest.mark.parametrize("atp,adp", [(2, 2)])
def test_layout_matches_transformers_and_one_process(tmp_path, atp: int, adp: int) -> None:
    hf = make_checkpoint("yarn-grouped", tmp_path)
    want = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    one_process = ckpt.load_pretrained(tmp_path)
    single_cfg = one_process.cfg
    single = RolloutEngine(one_process, EngineConfig(scheduler=SchedulerConfig(block_size=4))).generate(PROMPTS, PARAMS)
    assert [r.token_ids for r in single] == [tokens for tokens, _ in want]
    got = run_world(_world, atp * adp, atp, adp, str(tmp_path), timeout=480)
    assert {(r["local_experts"], r["local_heads"]) for r in got} == {(8 // (atp * adp), 4 // atp)}
    for schedule in SCHEDULES:
        rows = got[0][schedule]
        assert [tokens for tokens, _ in rows] == [tokens for tokens, _ in want], schedule
        worst = max(abs(a - b) for (_, lp), (_, ref) in zip(rows, want) for a, b in zip(lp, ref))
        assert worst < 1e-3, (schedule, worst)
    assert all(r["gathered_equal"] for r in got)
    trainer = _trainer(single_cfg)
    engine = RolloutEngine(trainer, EngineConfig(scheduler=SchedulerConfig(block_size=4)))
    swapped = [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]
    assert got[0]["swapped"] == swapped != [tokens for tokens, _ in want]
