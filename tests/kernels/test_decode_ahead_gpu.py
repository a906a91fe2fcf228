"""Decode ahead on the CUDA runner (`engine.ahead`) and the device draw (`sampler.PendingDraw`):
graph replays fed from the device's draw, greedy or sampled, give the tokens of the same engine
without it; a weight update waits for the forward issued ahead."""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, RunnerConfig, SamplingParams, SchedulerConfig
from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer

pytestmark = pytest.mark.timeout(300)


def _run(mode: str, schedule: str, update_at: int | None = None, temperature: float = 0.0
         ) -> tuple[list, RolloutEngine]:
    cfg = preset("tiny-moe").replace(dtype="bfloat16", max_position_embeddings=512)
    model = MoETransformer(cfg, device="cuda").init_weights(3)
    engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(schedule, block_size=16, max_batch_tokens=256),
                                               kv=KVConfig(num_blocks=512), runner=RunnerConfig(decode_ahead=mode)))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (5, 70, 33, 12, 90, 1)]
    lengths = (24, 9, 30, 17, 24, 3)
    rids = [engine.add_request(p, SamplingParams(temperature=temperature, max_new_tokens=n, ignore_stop=True,
                                                 seed=i if temperature else None))
            for i, (p, n) in enumerate(zip(prompts, lengths))]
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


@pytest.mark.gpu
def test_sampled_rows_are_drawn_on_the_device_and_decoded_ahead():
    """Temperature 1, seeded: the draw (inverse CDF on the device from host uniforms) feeds the
    forward issued ahead; the tokens equal those of the same engine without decode ahead, and a
    second run with the same seeds repeats them."""
    on, engine = _run("auto", "off", temperature=1.0)
    off, _ = _run("off", "off", temperature=1.0)
    again, _ = _run("auto", "off", temperature=1.0)
    assert engine.stats.ahead_taken > 10
    assert [r.token_ids for r in on] == [r.token_ids for r in off] == [r.token_ids for r in again]
    assert len({tuple(r.token_ids) for r in on}) > 1


@pytest.mark.gpu
def test_pending_draw_on_the_device_keeps_its_tokens_there_and_judges_rows_like_the_cpu():
    from megatron_rollout.engine.sampler import PendingDraw

    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0)) * 3
    logits[2, 7] = float("nan")
    params = [SamplingParams(temperature=t) for t in (0.0, 1.0, 1.0, 0.7, 0.0)]
    gens = lambda: [torch.Generator().manual_seed(s) for s in range(5)]  # noqa: E731
    cpu = PendingDraw(logits, params, gens()).result(range(5))
    dev = PendingDraw(logits.cuda(), params, gens())
    assert dev.tokens.is_cuda
    gpu = dev.result(range(5))
    assert [s.error for s in gpu] == [s.error for s in cpu] and gpu[2].error is not None
    assert gpu[0].token == cpu[0].token and gpu[4].token == cpu[4].token  # greedy: the same argmax
    assert [int(t) for t in dev.tokens[[0, 1, 3, 4]].cpu()] == [gpu[i].token for i in (0, 1, 3, 4)]
