"""Piecewise CUDA graphs of P and mixed forwards (`runner/piecewise.py`) against the eager forward.

CPU: the runner config validates the buckets. GPU: on the same weights and the same paged KV, a
piecewise replay gives the eager forward's logits, stores the same K/V, yields the same
boundaries in the same order, serves padded buckets and mixed decode+prefill batches, sees
in-place weight updates, falls back to eager past its buckets, and an engine on it gives
identical greedy tokens under `off` and `mux`.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.engine.config import RunnerConfig
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.runner.cuda import CudaRunner
from megatron_rollout.types import Phase, SeqSpan, SpanInput

from .kv_check import kv_rel


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def test_config_rejects_bad_prefill_buckets():
    with pytest.raises(ValueError, match="prefill_graph_tokens must be positive ints, strictly increasing"):
        RunnerConfig(prefill_graph_tokens=(128, 64))
    with pytest.raises(ValueError, match="prefill_graph_rows must be a positive int, got 0"):
        RunnerConfig(prefill_graph_rows=0)
    assert RunnerConfig(prefill_graph_tokens=()).prefill_graph_tokens == ()


def test_shared_outputs_are_views_of_one_buffer_per_layer():
    from megatron_rollout.runner.piecewise import SharedOutputs

    shared = SharedOutputs()
    big = shared.out(0, torch.ones(64, 4, 8))
    small = shared.out(0, torch.ones(16, 4, 8))
    assert small.data_ptr() == big.data_ptr() and small.shape == (16, 4, 8)
    assert shared.out(1, torch.ones(16, 4, 8)).data_ptr() != big.data_ptr()  # one buffer per layer
    grown = shared.out(0, torch.ones(128, 4, 8))  # larger than the buffer: a new one
    assert grown.shape == (128, 4, 8) and grown.data_ptr() != big.data_ptr()
    assert big.shape == (64, 4, 8)  # the old view (and its graphs) keep the old buffer
    assert shared.out(0, torch.ones(16, 2, 8)).shape == (16, 2, 8)  # another head shape: its own


def test_shared_outputs_sized_for_the_largest_bucket_share_whatever_the_capture_order():
    """Buckets are captured lazily, smallest first when traffic grows: with the largest bucket's
    rows given, every bucket still gets a view of the same buffer."""
    from megatron_rollout.runner.piecewise import SharedOutputs

    shared = SharedOutputs(rows=128)
    first = shared.out(0, torch.ones(16, 4, 8))
    assert shared.buffers[0].shape == (128, 4, 8) and first.shape == (16, 4, 8)
    assert shared.out(0, torch.ones(128, 4, 8)).data_ptr() == first.data_ptr()


# -- GPU -----------------------------------------------------------------------------------
BUCKETS = (16, 64, 128)


def _runner(seed: int, buckets: tuple[int, ...], blocks: int = 96, bs: int = 4) -> CudaRunner:
    cfg = preset("tiny-moe").replace(dtype="bfloat16", max_position_embeddings=512)
    model = MoETransformer(cfg, device="cuda").init_weights(seed)
    cache = PagedKVCache(cfg, blocks, bs, cfg.num_query_groups, device="cuda")
    return CudaRunner(model, cache, RunnerConfig(graph_batch_sizes=(1, 2, 4), prefill_graph_tokens=buckets,
                                                 measure_expert_kernels=False))


def _inputs(spec, tables, gen, sample=None):
    sample = sample or [True] * len(spec)
    return [SpanInput(SeqSpan(tables[i], past, new), torch.randint(0, 256, (new,), generator=gen).tolist(), s)
            for i, ((past, new), s) in enumerate(zip(spec, sample))]


def _drive(runner: CudaRunner, inputs, phase=Phase.P):
    """Logits and the boundaries yielded (completion polls left out)."""
    gen, points = runner.forward(inputs, phase), []
    with torch.no_grad():
        while True:
            try:
                point = next(gen)
            except StopIteration as stop:
                return stop.value, points
            if point.layer >= 0:
                points.append(point)


@pytest.mark.gpu
def test_piecewise_replay_matches_the_eager_forward():
    gen = torch.Generator().manual_seed(0)
    graphs, eager = _runner(0, BUCKETS), _runner(0, ())
    tables = [tuple(range(i * 24, (i + 1) * 24)) for i in range(4)]
    cases = [
        ([(0, 13), (0, 30), (0, 5)], Phase.P, None),  # fresh prefills: bucket 64, padded 48 -> 64
        ([(13, 40), (30, 9)], Phase.P, [True, False]),  # continuations, one row not sampled
        ([(53, 1), (39, 1), (0, 20), (5, 1)], Phase.D, None),  # a mixed chunked step
    ]
    for spec, phase, sample in cases:
        inputs = _inputs(spec, tables, gen, sample)
        before = graphs.stats["piecewise_forwards"]
        a, pa = _drive(eager, inputs, phase)
        b, pb = _drive(graphs, inputs, phase)
        assert graphs.stats["piecewise_forwards"] == before + 1
        assert b.shape == a.shape
        assert _rel(b, a) < 2e-2, spec
        assert pb == pa and len(pa) > 0, spec
    # the K/V each runner stored for every position written so far
    assert kv_rel(graphs.cache, eager.cache, [b for t in tables for b in t[:15]]) < 2e-2


@pytest.mark.gpu
def test_past_the_buckets_and_too_many_rows_run_eagerly():
    gen = torch.Generator().manual_seed(1)
    runner = _runner(1, (16,))
    tables = [tuple(range(i * 24, (i + 1) * 24)) for i in range(4)]
    _drive(runner, _inputs([(0, 40)], tables, gen))  # 40 tokens > 16
    assert runner.stats["piecewise_forwards"] == 0 and runner.stats["eager_forwards"] == 1
    _drive(runner, _inputs([(0, 3)], tables[1:], gen))
    assert runner.stats["piecewise_forwards"] == 1


@pytest.mark.gpu
def test_weight_updates_reach_the_piecewise_graphs():
    gen = torch.Generator().manual_seed(2)
    graphs, eager = _runner(2, BUCKETS), _runner(2, ())
    tables = [tuple(range(i * 24, (i + 1) * 24)) for i in range(2)]
    inputs = _inputs([(0, 20), (0, 7)], tables, gen)
    first, _ = _drive(graphs, inputs)
    other = MoETransformer(graphs.cfg).init_weights(11)
    with torch.no_grad():
        for name, p in other.named_parameters():  # what update_weights does: in-place copies
            graphs.model.get_parameter(name).copy_(p.to("cuda"))
            eager.model.get_parameter(name).copy_(p.to("cuda"))
    a, _ = _drive(eager, inputs)
    b, _ = _drive(graphs, inputs)
    assert _rel(b, a) < 2e-2 and _rel(first, a) > 0.1


@pytest.mark.gpu
def test_off_and_mux_give_identical_tokens_on_piecewise_graphs():
    outs = {}
    for schedule in ("off", "mux"):
        cfg = preset("tiny-moe").replace(dtype="bfloat16", max_position_embeddings=512)
        model = MoETransformer(cfg, device="cuda").init_weights(3)
        config = EngineConfig(scheduler=SchedulerConfig(schedule, block_size=4, max_batch_tokens=96),
                              kv=KVConfig(num_blocks=512), runner=RunnerConfig(prefill_graph_tokens=BUCKETS))
        engine = RolloutEngine(model, config)
        gen = torch.Generator().manual_seed(4)
        prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (5, 70, 33, 12, 90, 1)]
        done = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_stop=True))
        outs[schedule] = [r.token_ids for r in done]
        assert engine.runner.stats["piecewise_forwards"] > 0
    assert outs["off"] == outs["mux"]


@pytest.mark.gpu
def test_buckets_that_share_attention_outputs_match_the_eager_forward_in_turn():
    """Two buckets read and write one attention-output buffer per layer: forwards alternating
    between them give the eager logits every time."""
    gen = torch.Generator().manual_seed(5)
    graphs, eager = _runner(5, (16, 64)), _runner(5, ())
    tables = [tuple(range(i * 24, (i + 1) * 24)) for i in range(4)]
    specs = [[(0, 50)], [(0, 9)], [(50, 30)], [(9, 7)]]  # 64, 16, 64, 16
    for i, spec in enumerate(specs):
        inputs = _inputs(spec, tables[i % 2:], gen)
        a, _ = _drive(eager, inputs)
        b, _ = _drive(graphs, inputs)
        assert _rel(b, a) < 2e-2, spec
    small, large = graphs._p_graphs[16], graphs._p_graphs[64]
    assert small.slots[0].out.data_ptr() == large.slots[0].out.data_ptr()
    assert graphs.stats["piecewise_forwards"] == 4
