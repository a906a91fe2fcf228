"""Decode ahead on the CUDA runner (`engine.ahead`): graph replays fed from the device's draw give
the tokens of the same engine without it; a weight update waits for the forward issued ahead."""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams
from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer

pytestmark = pytest.mark.timeout(300)


def _run(mode: str, schedule: str, update_at: int | None = None) -> tuple[list, RolloutEngine]:
    cfg = preset("tiny-moe").replace(dtype="bfloat16", max_position_embeddings=512)
    model = MoETransformer(cfg, device="cuda").init_weights(3)
    engine = RolloutEngine(model, EngineConfig(schedule=schedule, block_size=16, num_blocks=512,
                                               max_batch_tokens=256, decode_ahead=mode))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (5, 70, 33, 12, 90, 1)]
    lengths = (24, 9, 30, 17, 24, 3)
    rids = [engine.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_stop=True))
            for p, n in zip(prompts, lengths)]
    outs, step = {}, 0
    while engine.has_work():
        step += 1
        if step == update_at:
            state = {k: v * 1.01 if v.dim() > 1 else v for k, v in model.state_dict().items()}
            engine.update_weights(state, version=1)
        for out in engine.step():
            outs[out.request_id] = out.result
    return [outs[r] for r in rids], engine


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
def test_graph_replays_fed_on_the_device_give_the_same_tokens(schedule):
    on, engine = _run("auto", schedule)
    off, _ = _run("off", schedule)
    assert engine.executor.ahead is not None  # auto: on for the CUDA runner on one rank
    assert engine.stats.ahead_taken > 10
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    for a, b in zip(on, off):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)


@pytest.mark.gpu
def test_weight_update_after_a_forward_issued_ahead():
    on, engine = _run("auto", "off", update_at=20)
    off, _ = _run("off", "off", update_at=20)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert [r.weight_versions for r in on] == [r.weight_versions for r in off]
    assert engine.stats.ahead_dropped >= 1
