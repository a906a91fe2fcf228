"""The CUDA runner through the multi-rank code path on one GPU: a world of ONE NCCL rank.

`DistComm(ParallelLayout(1, 1, 1), counts="device", trivial_groups=True)` builds every phase
communicator even though each axis has one rank, so D's collectives (the ADP all-gather, the
FULL all-reduce, the low-latency domain's all-to-alls) are real NCCL calls on D's own
communicators, captured inside the decode graphs; P runs eagerly on its stream through P's
communicators; the comm's router is bound to the runner's streams and moves a registered P
collective onto D's stream with events both ways. Checked against the single-rank `CudaRunner`
and the eager `ModelRunner` on the same weights: logits, greedy tokens, and whole engine runs.

What one rank cannot show (see the coordinator's notes and benchmarks/device/multigpu_validate.sh): that
peers pair up their collectives (capture warm-ups across ranks, ranks replaying different
buckets, a rank with no decode rows), the ATP all-reduce and ATP all-gather from the model (ATP
is 1: only captured directly here), the crossed-group ordering the routed collective exists for,
cross-rank sequence mismatches, P/D overlap under NCCL contention, and any performance figure.
"""
from __future__ import annotations

import os

import pytest
import torch

from megatron_rollout.engine import KVConfig, SchedulerConfig
from megatron_rollout.types import Axis, Phase

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_world(tmp_path_factory):
    """torch.distributed with one NCCL rank (FileStore), torn down after the module."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    torch.cuda.set_device(0)
    os.environ.setdefault("LOCAL_RANK", "0")
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def _dist_comm(p_exchange: str, d_exchange: str, conflict: bool = True):
    from megatron_rollout.comm.dist import CommConfig, DistComm
    from megatron_rollout.comm.groups import ParallelLayout
    from megatron_rollout.multiplex.routing import D_ADP_ALL_GATHER, P_FULL_ALL_REDUCE, ConflictRegistry, Router

    # One rank has no crossed groups; the conflict is registered by hand so that P's FULL
    # all-reduce takes the routed path (D's stream, events both ways) as it does at ATP2/ADP2.
    registry = ConflictRegistry()
    if conflict:
        registry.register(P_FULL_ALL_REDUCE, D_ADP_ALL_GATHER, "forced on one rank to exercise routing")
    config = CommConfig(timeout_s=120, counts="device", trivial_groups=True, p_exchange=p_exchange,
                        d_exchange=d_exchange, p_max_tokens=128, d_max_tokens=32)
    return DistComm(ParallelLayout(1, 1, 1), config, device=torch.device("cuda", 0), router=Router(registry))


def _model(seed: int, comm=None):
    from megatron_rollout.model.config import preset
    from megatron_rollout.model.transformer import MoETransformer

    cfg = preset("tiny-moe").replace(dtype="bfloat16", max_position_embeddings=512)
    return MoETransformer(cfg, device="cuda", **({"comm": comm} if comm is not None else {})).init_weights(seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def test_nccl_collectives_are_captured_and_replayed(nccl_world):
    """D's collectives on D's communicators inside one CUDA graph: the ATP all-reduce, the padded
    ADP all-gather and the low-latency exchange; replays read new inputs and give new results."""
    from megatron_rollout.comm.exchange import LocalExchange
    from megatron_rollout.forward import run_to_end
    from tests.comm.worlds import experts_pair, routed_tokens

    comm = _dist_comm("alltoall", "alltoall", conflict=False)
    try:
        assert comm.sync_free and comm.group(Axis.ATP, Phase.D) is not None
        assert comm.group(Axis.ATP, Phase.D) is not comm.group(Axis.ATP, Phase.P)
        full, local = experts_pair(comm.shard)
        local = local.cuda()
        x, ids, w = (t.cuda() for t in routed_tokens(6, set(), seed=1))
        static = {"x": x.clone(), "ids": ids.clone(), "w": w.clone()}
        stream = torch.cuda.Stream()

        def step():
            reduced = comm.all_reduce(static["x"] * 2, Axis.ATP, Phase.D)
            gathered = comm.all_gather_into(static["x"], Axis.ADP, Phase.D)
            moe = run_to_end(comm.exchange(Phase.D).run(static["x"], static["ids"], static["w"], local, 0))
            return reduced, gathered, moe

        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                step()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            outs = step()
        for seed in (2, 3):
            nx, nids, nw = (t.cuda() for t in routed_tokens(6, {seed}, seed=seed))
            static["x"].copy_(nx), static["ids"].copy_(nids), static["w"].copy_(nw)
            graph.replay()
            torch.cuda.synchronize()
            ref = run_to_end(LocalExchange().run(nx.cpu(), nids.cpu(), nw.cpu(), full, 0))
            torch.testing.assert_close(outs[0], nx * 2)
            torch.testing.assert_close(outs[1], nx.unsqueeze(0))
            assert _rel(outs[2].cpu(), ref) < 1e-5
        from megatron_rollout.comm.alltoall import check_domains

        check_domains(comm)  # the replayed dispatches kept the device-side sequence numbers in step
    finally:
        comm.close()


def _inputs(spec, tables, tokens):
    from megatron_rollout.types import SeqSpan, SpanInput

    return [SpanInput(SeqSpan(tables[i], past, new), tokens[i], True) for i, (past, new) in enumerate(spec)]


@pytest.mark.parametrize("p_exchange,d_exchange", [("allgather", "alltoall"), ("alltoall", "allgather")])
def test_multirank_runner_matches_single_rank_and_eager(nccl_world, p_exchange, d_exchange):
    """Prefill, then eight graph-replayed decode steps teacher-forced with the eager runner's
    greedy tokens: the same logits (bf16 tolerance) and greedy tokens as the single-rank
    CudaRunner and the eager ModelRunner; P's FULL all-reduce went through the router."""
    from megatron_rollout.forward import run_to_end
    from megatron_rollout.kv.paged import PagedKVCache
    from megatron_rollout.runner.base import ModelRunner
    from megatron_rollout.runner.config import RunnerConfig
    from megatron_rollout.runner.cuda import CudaRunner

    comm = _dist_comm(p_exchange, d_exchange)
    try:
        eager_model, single_model, multi_model = _model(5), _model(5), _model(5, comm)
        cfg = eager_model.cfg
        caches = [PagedKVCache(cfg, 64, 4, cfg.num_query_groups, device="cuda") for _ in range(3)]
        knobs = RunnerConfig(graph_batch_sizes=(1, 2, 4, 8))
        eager = ModelRunner(eager_model, caches[0])
        single, multi = CudaRunner(single_model, caches[1], knobs), CudaRunner(multi_model, caches[2], knobs)
        assert multi.multi_rank and multi.graph_safe
        assert comm.router.streams.d is multi.d_stream and comm.router.streams.p is multi.p_stream
        comm.route_collectives(True)
        gen = torch.Generator().manual_seed(0)
        perm = torch.randperm(64, generator=gen).tolist()
        tables = [tuple(perm[i * 16:(i + 1) * 16]) for i in range(3)]
        lens = [13, 30, 5]
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
        agree = {"single": 0, "multi": 0}
        with torch.no_grad():
            inputs = _inputs([(0, n) for n in lens], tables, prompts)
            comm.router.open_window(1, 1)  # as the turnstile does after D: the routed P collective may follow
            logits = [run_to_end(r.forward(inputs, Phase.P)) for r in (eager, single, multi)]
            comm.router.close_window()
            moe_layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_layers))
            assert moe_layers > 0 and comm.router.routed_count == (moe_layers if p_exchange == "allgather" else 0)
            for step in range(9):
                ref = logits[0].float()
                tokens = ref.argmax(-1)
                for name, got in (("single", logits[1]), ("multi", logits[2])):
                    assert got.shape == ref.shape and _rel(got, ref) < 3e-2, (name, step, _rel(got, ref))
                    agree[name] += int((got.float().argmax(-1) == tokens).sum())
                assert torch.equal(logits[1].float().argmax(-1), logits[2].float().argmax(-1)) or \
                    _rel(logits[2], logits[1]) < 1e-2
                if step == 8:
                    break
                inputs = _inputs([(n, 1) for n in lens], tables, [[t] for t in tokens.tolist()])
                logits = [run_to_end(r.forward(inputs, Phase.D)) for r in (eager, single, multi)]
                lens = [n + 1 for n in lens]
        total = 9 * len(lens)
        assert agree["multi"] >= 0.9 * total and agree["single"] >= 0.9 * total, agree
        assert multi.stats["graph_replays"] == 8 and sorted(multi._graphs) == [1, 2, 4, 8]
        assert multi.capture_error is None
        torch.cuda.synchronize()
        multi._probe.poll()  # the deferred sequence checks: nothing out of order
        for phase in Phase:
            domain = comm.domain(phase)
            if domain is not None:
                assert int(domain.fault_counters.sum()) == 0
    finally:
        comm.route_collectives(False)
        comm.close()


@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
def test_multirank_engine_completes_like_the_single_rank_engine(nccl_world, schedule):
    """Whole engines (rank-shared planning, the turnstile's rendezvous under mux, routing): every
    request completes, decode graphs replay, and the greedy tokens agree with the single-rank
    CUDA engine's (bf16 kernels differ slightly, so near-ties may flip: at least 80% agree)."""
    from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams
    from megatron_rollout.engine.coordinator import RankSharedCoordinator
    from megatron_rollout.multiplex.rendezvous import Rendezvous
    from megatron_rollout.runner.cuda import CudaRunner

    comm = _dist_comm("allgather", "alltoall")
    try:
        config = EngineConfig(scheduler=SchedulerConfig(schedule=schedule, block_size=4, max_batch_tokens=64),
                              kv=KVConfig(num_blocks=256))
        rendezvous = Rendezvous(comm.cpu_group, 120.0, 0, name=f"test-{schedule}")
        comm.route_collectives(schedule == "mux")
        multi = RolloutEngine(_model(2, comm), config, rank=0, coordinator=RankSharedCoordinator(comm),
                              rendezvous=rendezvous, router=comm.router)
        single = RolloutEngine(_model(2), config)
        assert isinstance(multi.runner, CudaRunner) and multi.runner.multi_rank
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 256, (int(torch.randint(3, 40, (1,), generator=gen)),), generator=gen).tolist()
                   for _ in range(6)]
        params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_stop=True)
        got, want = multi.generate(prompts, params), single.generate(prompts, params)
        assert all(len(r.token_ids) == 8 for r in got)
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g.token_ids, w.token_ids))
        assert same >= 0.8 * 8 * len(prompts), same
        assert multi.runner.stats["graph_replays"] > 0 and multi.runner.capture_error is None
        if schedule == "mux":
            assert comm.router.routed_count > 0
        multi.check_integrity()
    finally:
        comm.route_collectives(False)
        comm.close()
