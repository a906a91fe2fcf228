"""The CUDA runner (`runner/cuda.py`) against the portable runner on the same model and KV.

Kept under tests/kernels because the runner is the kernels' only caller. CPU: `make_runner`
picks the portable runner off CUDA and honours the environment override. GPU: logits and KV of
prefill (fresh and continuation), of graph-replayed decode (padded buckets) and of mixed batches
match the portable runner; an engine with the CUDA runner completes multi-turn sessions under
every schedule with graphs actually replayed; weight updates reach the captured graphs.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model.config import preset
from megatron_rollout.model.layers import run_to_end
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.runner.base import ModelRunner
from megatron_rollout.runner.config import RUNNER_ENV, RunnerConfig, runner_kind_from_env
from megatron_rollout.runner.cuda import CudaRunner, make_runner
from megatron_rollout.types import Phase, SeqSpan, SpanInput

from .kv_check import kv_rel


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def test_make_runner_is_portable_on_cpu(monkeypatch):
    model = MoETransformer(preset("tiny-moe")).init_weights(0)
    cache = PagedKVCache(model.cfg, 8, 4, model.cfg.num_query_groups)
    assert type(make_runner(model, cache, RunnerConfig())) is ModelRunner
    with pytest.raises(RuntimeError, match="needs a single-rank model on a CUDA device"):
        make_runner(model, cache, RunnerConfig(kind="cuda"))
    monkeypatch.setenv(RUNNER_ENV, "cuda")  # the environment is the CLI's default, not the runner's
    assert type(make_runner(model, cache, RunnerConfig())) is ModelRunner


def test_the_environment_names_the_cli_default_only(monkeypatch):
    monkeypatch.delenv(RUNNER_ENV, raising=False)
    assert runner_kind_from_env() == "auto"
    monkeypatch.setenv(RUNNER_ENV, "eager")
    assert runner_kind_from_env() == "eager"
    monkeypatch.setenv(RUNNER_ENV, "fast")
    with pytest.raises(ValueError, match=r"\$MEGATRON_ROLLOUT_RUNNER must be auto, eager or cuda, got 'fast'"):
        runner_kind_from_env()


def test_config_rejects_unsorted_buckets():
    with pytest.raises(ValueError, match="strictly increasing"):
        RunnerConfig(graph_batch_sizes=(4, 2))


# -- GPU -----------------------------------------------------------------------------------

def _model(seed: int = 0) -> MoETransformer:
    cfg = preset("tiny-moe").replace(dtype="bfloat16", max_position_embeddings=512)
    return MoETransformer(cfg, device="cuda").init_weights(seed)


def _pair(seed: int, blocks: int = 64, bs: int = 4):
    """A portable runner and a CUDA runner on two copies of the same model (the CUDA runner
    swaps its model's expert exchange, so the reference needs its own model)."""
    ref_model, model = _model(seed), _model(seed)
    ref_cache = PagedKVCache(model.cfg, blocks, bs, model.cfg.num_query_groups, device="cuda")
    cache = PagedKVCache(model.cfg, blocks, bs, model.cfg.num_query_groups, device="cuda")
    runner = CudaRunner(model, cache, RunnerConfig(graph_batch_sizes=(1, 2, 4, 8)))
    return ModelRunner(ref_model, ref_cache), runner


def _inputs(spec, tables, gen, vocab=256, sample=True):
    return [SpanInput(SeqSpan(tables[i], past, new), torch.randint(0, vocab, (new,), generator=gen).tolist(), sample)
            for i, (past, new) in enumerate(spec)]


def _captured_step(ref, fast, gen):
    """Two sequences prefilled on both runners, then one decode step on `fast`, which captures its
    bucket-2 graph. Returns that step's inputs, to replay after a weight change."""
    tables = [tuple(range(i * 8, (i + 1) * 8)) for i in range(2)]
    with torch.no_grad():
        inputs = _inputs([(0, 6), (0, 3)], tables, gen)
        run_to_end(ref.forward(inputs, Phase.P))
        run_to_end(fast.forward(inputs, Phase.P))
        step = _inputs([(6, 1), (3, 1)], tables, gen)
        run_to_end(fast.forward(step, Phase.D))
    return step


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [4, 64])
def test_cuda_runner_matches_portable_runner(bs):
    gen = torch.Generator().manual_seed(0)
    ref, fast = _pair(0, bs=bs)
    per = -(-64 // bs)  # blocks for 64 positions a sequence
    perm = torch.randperm(64, generator=gen).tolist()
    tables = [tuple(perm[i * per:(i + 1) * per]) for i in range(3)]
    with torch.no_grad():
        # fresh prefills, P phase (eager, async completion)
        inputs = _inputs([(0, 13), (0, 30), (0, 5)], tables, gen)
        a = run_to_end(ref.forward(inputs, Phase.P))
        b = run_to_end(fast.forward(inputs, Phase.P))
        assert _rel(b, a) < 3e-2
        # three decode steps through graphs (3 rows -> bucket 4: one padded row)
        lens = [13, 30, 5]
        for _ in range(3):
            inputs = _inputs([(n, 1) for n in lens], tables, gen)
            a = run_to_end(ref.forward(inputs, Phase.D))
            b = run_to_end(fast.forward(inputs, Phase.D))
            assert b.shape == a.shape and _rel(b, a) < 3e-2
            lens = [n + 1 for n in lens]
        assert fast.stats["graph_replays"] == 3
        # a mixed (chunked-style) batch: two decode rows and a continuation prefill
        inputs = _inputs([(lens[0], 1), (lens[1], 1), (lens[2], 9)], tables, gen)
        a = run_to_end(ref.forward(inputs, Phase.P))
        b = run_to_end(fast.forward(inputs, Phase.P))
        assert _rel(b, a) < 3e-2
    torch.cuda.synchronize()
    assert kv_rel(fast.cache, ref.cache, [s for t in tables for s in t]) < 3e-2


@pytest.mark.gpu
def test_weight_update_reaches_captured_graphs():
    gen = torch.Generator().manual_seed(1)
    ref, fast = _pair(1)
    model = fast.model
    step = _captured_step(ref, fast, gen)
    with torch.no_grad():
        other = MoETransformer(model.cfg).init_weights(7)
        with torch.no_grad():
            for name, p in other.named_parameters():  # what update_weights does: in-place copies
                model.get_parameter(name).copy_(p.to("cuda"))
                ref.model.get_parameter(name).copy_(p.to("cuda"))
        a = run_to_end(ref.forward(step, Phase.D))
        b = run_to_end(fast.forward(step, Phase.D))
    assert _rel(b, a) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
def test_engine_sessions_complete_on_the_cuda_runner(schedule):
    model = _model(2)
    engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(schedule, block_size=4, max_batch_tokens=64),
                                               kv=KVConfig(num_blocks=256)))
    assert isinstance(engine.runner, CudaRunner)
    gen = torch.Generator().manual_seed(3)
    sessions = [engine.open_session() for _ in range(4)]
    for _turn in range(3):
        rids = []
        for s in sessions:
            s.append(torch.randint(0, 256, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist())
            rids.append(s.submit(SamplingParams(temperature=0.0, max_new_tokens=6, ignore_stop=True)))
        done = engine.run_until(rids)
        assert all(len(done[r].result.token_ids) == 6 for r in rids)
    engine.check_integrity()
    assert engine.runner.stats["graph_replays"] > 0


@pytest.mark.gpu
def test_bind_drops_graphs_and_stays_correct():
    """WeightStore.bind re-points every parameter: graphs must not replay stale weights."""
    from megatron_rollout.weights.store import WeightStore

    gen = torch.Generator().manual_seed(4)
    ref, fast = _pair(4)
    step = _captured_step(ref, fast, gen)
    with torch.no_grad():
        other = MoETransformer(ref.model.cfg, device="cuda").init_weights(9)
        params = {n: p.detach().clone() for n, p in other.named_parameters()}
        WeightStore(fast.model).bind(params, version=1)
        for name, p in params.items():
            ref.model.get_parameter(name).copy_(p)
        a = run_to_end(ref.forward(step, Phase.D))
        b = run_to_end(fast.forward(step, Phase.D))
    assert not fast.graph_safe
    assert _rel(b, a) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, 128])
def test_fp8_model_decodes_through_graphs(block):
    """FP8 experts (stacked, weight-only Triton kernels) are captured: the decode graph replays
    and matches the portable runner on the same FP8 weights (dequant backend: same values)."""
    from megatron_rollout.model import fp8

    gen = torch.Generator().manual_seed(4)
    ref, fast = _pair(4)
    for model in (ref.model, fast.model):
        fp8.quantize_model_fp8(model, block=block, backend="dequant")
    fast = CudaRunner(fast.model, fast.cache, RunnerConfig(graph_batch_sizes=(1, 2, 4, 8)))
    assert fast.graph_safe
    tables = [tuple(range(i * 16, (i + 1) * 16)) for i in range(3)]
    with torch.no_grad():
        inputs = _inputs([(0, 11), (0, 20), (0, 4)], tables, gen)
        assert _rel(run_to_end(fast.forward(inputs, Phase.P)), run_to_end(ref.forward(inputs, Phase.P))) < 3e-2
        lens = [11, 20, 4]
        for _ in range(3):
            inputs = _inputs([(n, 1) for n in lens], tables, gen)
            a = run_to_end(ref.forward(inputs, Phase.D))
            b = run_to_end(fast.forward(inputs, Phase.D))
            assert _rel(b, a) < 3e-2
            lens = [n + 1 for n in lens]
    assert fast.stats["graph_replays"] == 3


@pytest.mark.gpu
def test_fp8_weight_update_reaches_captured_graphs():
    """What the weight store does after an update (copies, then `requantize_model_fp8`) reaches a
    decode graph captured on an FP8 model."""
    from megatron_rollout.model import fp8

    gen = torch.Generator().manual_seed(5)
    ref, fast = _pair(5)
    for model in (ref.model, fast.model):
        fp8.quantize_model_fp8(model, block=128, backend="dequant")
    fast = CudaRunner(fast.model, fast.cache, RunnerConfig(graph_batch_sizes=(1, 2, 4, 8)))
    step = _captured_step(ref, fast, gen)
    with torch.no_grad():
        other = MoETransformer(fast.model.cfg).init_weights(8)
        for name, p in other.named_parameters():
            fast.model.get_parameter(name).copy_(p.to("cuda"))
            ref.model.get_parameter(name).copy_(p.to("cuda"))
        for model in (ref.model, fast.model):
            fp8.requantize_model_fp8(model)
        a = run_to_end(ref.forward(step, Phase.D))
        b = run_to_end(fast.forward(step, Phase.D))
    assert fast.stats["graph_replays"] == 2 and _rel(b, a) < 3e-2


@pytest.mark.gpu
def test_a_failed_capture_leaves_random_ops_working(monkeypatch):
    """A decode-graph capture that fails midway (here: a host sync inside it) falls back to eager
    decoding, and the process's CUDA random ops keep working: torch leaves its default generator
    marked as capturing after such a failure, and the runner clears the mark
    (`release_rng_after_failed_capture`)."""
    from megatron_rollout.runner import cuda as cuda_runner

    model = _model(0)
    cache = PagedKVCache(model.cfg, 64, 4, model.cfg.num_query_groups, device="cuda")
    runner = CudaRunner(model, cache, RunnerConfig(graph_batch_sizes=(1, 2)))
    step = cuda_runner.DecodeGraph._step

    def syncing_step(self, m):
        out = step(self, m)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed while capturing: the capture is invalidated
        return out

    monkeypatch.setattr(cuda_runner.DecodeGraph, "_step", syncing_step)
    assert runner._try_graph(2) is None and runner.capture_error is not None
    torch.randn(8, device="cuda")  # raised "Offset increment outside graph capture" before the fix
    torch.cuda.synchronize()
    tables = [tuple(range(i * 8, (i + 1) * 8)) for i in range(2)]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # and the runner still decodes (eagerly)
        run_to_end(runner.forward(_inputs([(0, 5), (0, 3)], tables, gen), Phase.P))
        logits = run_to_end(runner.forward(_inputs([(5, 1), (3, 1)], tables, gen), Phase.D))
    assert torch.isfinite(logits).all()
