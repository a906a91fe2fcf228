"""The CUDA runner's measuring API (what `benchmarks/` times): `configured`, `decode_graph`,
`forward_eager`, `prefill_bucket`, `drop_graphs`.

CPU: `configured` swaps only the settings read per forward and always restores the runner's own
config. GPU: a decode graph's replay and the eager forward give the portable runner's logits, a
dropped graph is captured again, and no bucket past the largest is handed out.
"""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from megatron_rollout.engine.config import RunnerConfig
from megatron_rollout.kv.paged import PagedKVCache, SeqSpan
from megatron_rollout.model.config import preset
from megatron_rollout.model.layers import run_to_end
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.runner.base import ModelRunner, SpanInput
from megatron_rollout.runner.cuda import CudaRunner
from megatron_rollout.types import Phase


def test_configured_swaps_per_forward_settings_and_restores_the_runner_config():
    own = RunnerConfig(prefill_graph_tokens=(64, 128))
    runner = types.SimpleNamespace(config=own, PER_FORWARD_SETTINGS=CudaRunner.PER_FORWARD_SETTINGS)
    eager = dataclasses.replace(own, prefill_graph_tokens=(), use_graphs=False)
    with CudaRunner.configured(runner, eager):
        assert runner.config is eager
    assert runner.config is own and own.prefill_graph_tokens == (64, 128)
    with pytest.raises(KeyError), CudaRunner.configured(runner, eager):
        raise KeyError("a failing timing")
    assert runner.config is own


def test_configured_refuses_settings_read_when_the_runner_is_built():
    runner = types.SimpleNamespace(config=RunnerConfig(), PER_FORWARD_SETTINGS=CudaRunner.PER_FORWARD_SETTINGS)
    with pytest.raises(ValueError, match=r"\['attention', 'd_priority'\] are read when a CudaRunner is built"):
        with CudaRunner.configured(runner, RunnerConfig(attention="triton", d_priority=0)):
            pass
    assert runner.config == RunnerConfig()
    assert set(CudaRunner.PER_FORWARD_SETTINGS) < {f.name for f in dataclasses.fields(RunnerConfig)}


# -- GPU -----------------------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


@pytest.mark.gpu
def test_decode_graph_and_eager_forward_match_the_portable_runner():
    cfg = preset("tiny-moe").replace(dtype="bfloat16", max_position_embeddings=512)
    ref_model, model = (MoETransformer(cfg, device="cuda").init_weights(0) for _ in range(2))
    caches = [PagedKVCache(cfg, 64, 4, cfg.num_query_groups, device="cuda") for _ in range(2)]
    ref = ModelRunner(ref_model, caches[0])
    runner = CudaRunner(model, caches[1], RunnerConfig(graph_batch_sizes=(2, 4)))
    gen = torch.Generator().manual_seed(0)
    tables = [tuple(range(i * 16, (i + 1) * 16)) for i in range(3)]
    prompt = [SpanInput(SeqSpan(t, 0, 9), torch.randint(0, 256, (9,), generator=gen).tolist(), True) for t in tables]
    step = [SpanInput(SeqSpan(t, 9, 1), [int(torch.randint(0, 256, (1,), generator=gen))], True) for t in tables]
    with torch.no_grad():
        assert runner.prefill_bucket(prompt) == 64  # 27 tokens: the smallest default bucket
        for r in (ref, runner):
            run_to_end(r.forward(prompt, Phase.P))
        want = run_to_end(ref.forward(step, Phase.D))
        graph = runner.decode_graph(3)
        assert graph.rows == 4
        graph.static.fill([i.span for i in step], [i.token_ids[0] for i in step])
        with torch.cuda.stream(runner.d_stream):
            graph.graph.replay()
        torch.cuda.synchronize()
        assert _rel(graph.out[:3], want) < 3e-2
        assert _rel(run_to_end(runner.forward_eager(step, Phase.D)), want) < 3e-2
        assert runner.stats["graph_replays"] == 0 and runner.decode_graph(4) is graph
        runner.drop_graphs()
        assert runner.decode_graph(4) is not graph
    with pytest.raises(ValueError, match="no decode graph holds 5 rows"):
        runner.decode_graph(5)
