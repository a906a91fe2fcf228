"""SM partitions for the prefill stream (`runner.partition`, `RunnerConfig.decode_sms`).

CPU: the driver calls a split makes, in order, over a fake libcuda (outputs written where ctypes'
`byref` points); the refusals of counts, of schedules other than mux and of the portable runner.
GPU: prefill's kernels land only on its partition, eagerly and from graphs, while an ordinary stream
still reaches every SM; an engine under mux with SMs held back gives the tokens it gives without.
"""
from __future__ import annotations

import ctypes
import types

import pytest
import torch

from megatron_rollout.engine import EngineConfig, KVConfig, MuxConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.runner import partition
from megatron_rollout.runner.config import RunnerConfig
from megatron_rollout.runner.cuda import make_runner


class FakeLib:
    """libcuda's split calls: the device holds `sms` SMs and the driver rounds a group up to 8."""

    def __init__(self, sms: int = 132, missing: str = "", fail: dict[str, int] | None = None) -> None:
        self.sms, self.missing, self.fail, self.calls = sms, missing, fail or {}, []

    def __getattr__(self, name: str):
        if name == self.missing:
            raise AttributeError(name)

        def call(*args):
            self.calls.append(name)
            if name == "cuDeviceGetDevResource":
                args[1]._obj.sm_count = self.sms
            elif name == "cuDevSmResourceSplitByCount":  # (result, groups, input, remaining, flags, min count)
                group = -(-args[5] // 8) * 8
                args[0]._obj.sm_count, args[3]._obj.sm_count = group, args[2]._obj.sm_count - group
            elif name == "cuGetErrorString":
                args[1]._obj.value = b"invalid value"
            return self.fail.get(name, 0)
        return call


def _driver(lib: FakeLib) -> partition.Driver:
    driver = partition.Driver.__new__(partition.Driver)
    driver.lib = lib
    return driver


@pytest.mark.timeout(30)
def test_the_split_rounds_the_held_back_group_up_and_gives_the_rest_to_prefill():
    lib = FakeLib()
    group, rest = _driver(lib).split(ctypes.c_int(0), 20)
    assert (group.sm_count, rest.sm_count) == (24, 108)
    assert lib.calls == ["cuDeviceGetDevResource", "cuDevSmResourceSplitByCount"]


@pytest.mark.timeout(30)
def test_driver_errors_name_the_call_and_a_driver_without_green_contexts():
    with pytest.raises(RuntimeError, match=r"cuDevSmResourceSplitByCount failed: CUresult 1 \(invalid value\)"):
        _driver(FakeLib(fail={"cuDevSmResourceSplitByCount": 1})).split(ctypes.c_int(0), 16)
    with pytest.raises(RuntimeError, match="need green contexts \\(CUDA 12.4 or later\\); this driver has no "
                                           "cuDevSmResourceSplitByCount"):
        _driver(FakeLib(missing="cuDevSmResourceSplitByCount")).split(ctypes.c_int(0), 16)


@pytest.mark.timeout(30)
def test_runners_share_one_partition_per_device_count_and_shape_until_it_is_closed(monkeypatch):
    made = []

    def green(held_back):
        return partition.GreenStream(stream=None, sms=132 - held_back, _driver=None, _handles=(0, 0))

    def fake(held_back, device, decode_too):
        made.append((held_back, device.index, decode_too))
        return green(held_back), green(0) if decode_too else None

    monkeypatch.setattr(partition, "partition_streams", fake)
    monkeypatch.setattr(partition, "_SHARED", {})
    cuda0 = torch.device("cuda", 0)
    first = partition.shared_partition(24, cuda0, False)
    assert partition.shared_partition(24, cuda0, False) is first and first[1] is None
    assert partition.shared_partition(16, cuda0, False) is not first
    assert partition.shared_partition(24, torch.device("cuda", 1), False) is not first
    split = partition.shared_partition(24, cuda0, True)
    assert split is not first and partition.shared_partition(24, cuda0, True) is split
    first[0].closed = True
    assert partition.shared_partition(24, cuda0, False) is not first
    split[1].closed = True  # either stream of a split closed: made again
    assert partition.shared_partition(24, cuda0, True) is not split
    assert made == [(24, 0, False), (16, 0, False), (24, 1, False), (24, 0, True), (24, 0, False), (24, 0, True)]


@pytest.mark.timeout(30)
def test_a_prefill_forward_is_in_flight_from_its_first_step_to_its_end():
    """`CudaRunner._in_flight` and `_beside_prefill` on a stand-in runner (the logic only: no CUDA)."""
    from megatron_rollout.runner.cuda import CudaRunner

    runner = types.SimpleNamespace(_p_in_flight=0, d_partition=object())

    def forward():
        yield "segment"
        yield "completion poll"
        return "logits"

    gen = CudaRunner._in_flight(runner, forward())
    assert runner._p_in_flight == 0  # not issued yet: D keeps the whole device
    assert next(gen) == "segment" and runner._p_in_flight == 1 and CudaRunner._beside_prefill(runner)
    assert next(gen) == "completion poll" and runner._p_in_flight == 1
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value == "logits" and runner._p_in_flight == 0 and not CudaRunner._beside_prefill(runner)
    closed = CudaRunner._in_flight(runner, forward())
    next(closed)
    closed.close()  # an epoch dropped half way (the engine stopped): no longer in flight
    assert runner._p_in_flight == 0
    held = types.SimpleNamespace(_p_in_flight=1, d_partition=None)  # "held": D never leaves the whole device
    assert not CudaRunner._beside_prefill(held)


@pytest.mark.timeout(30)
def test_held_back_counts_and_where_they_are_refused():
    partition.check_held_back(99, 132)
    for bad, match in ((0, "positive int"), (-8, "positive int"), (True, "positive int"), (100, "at most 99")):
        with pytest.raises(ValueError, match=match):
            partition.check_held_back(bad, 132)
    with pytest.raises(ValueError, match="decode_sms must be an int >= 0"):
        RunnerConfig(decode_sms=-1)
    with pytest.raises(ValueError, match="partition must be held or split, got 'both'"):
        RunnerConfig(decode_sms=24, partition="both")
    with pytest.raises(ValueError, match="only the mux schedule does; schedule 'off'"):
        EngineConfig(scheduler=SchedulerConfig("off"), runner=RunnerConfig(decode_sms=24))
    assert EngineConfig(scheduler=SchedulerConfig("mux"), runner=RunnerConfig(decode_sms=24)).runner.decode_sms == 24
    model = MoETransformer(preset("tiny-moe")).init_weights(0)
    cache = PagedKVCache(model.cfg, 8, 4, model.cfg.num_query_groups)
    with pytest.raises(ValueError, match="the portable runner .* has none"):
        make_runner(model, cache, RunnerConfig(decode_sms=16))


@pytest.mark.timeout(30)
def test_the_cli_holds_sms_back_for_mux_only():
    from megatron_rollout.cli import parser
    from megatron_rollout.options import engine_config

    args = parser().parse_args(["replay", "--trace", "t.jsonl", "--schedule", "off,mux", "--decode-sms", "16",
                                "--decode-partition", "split"])
    assert (engine_config(args, "mux").runner.decode_sms, engine_config(args, "mux").runner.partition) == (16, "split")
    assert engine_config(args, "off").runner.decode_sms == 0


# -- GPU -----------------------------------------------------------------------------------

def _sm_ids(stream: torch.cuda.Stream, graph: bool = False) -> set[int]:
    from benchmarks.sm_partition import sm_ids

    return set(sm_ids(stream, graph=graph))


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_prefill_partition_keeps_its_kernels_off_the_held_back_sms():
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).multi_processor_count
    green, none = partition.partition_streams(20, device, decode_too=False)
    assert none is None
    try:
        assert green.sms <= total - 20  # the driver rounds the held-back group up, never down
        eager, graphed = _sm_ids(green.stream), _sm_ids(green.stream, graph=True)
        assert green.sms // 2 < len(eager) <= green.sms and graphed == eager
        assert len(_sm_ids(torch.cuda.Stream(device)) - eager) >= 16  # D's ordinary stream reaches the rest
    finally:
        green.close()


def _tokens(decode_sms: int, partition: str = "held") -> tuple[list[list[int]], RolloutEngine]:
    cfg = preset("tiny-moe").replace(dtype="bfloat16", max_position_embeddings=512)
    model = MoETransformer(cfg, device="cuda").init_weights(2)
    runner = RunnerConfig(decode_sms=decode_sms, partition=partition)
    # one layer a segment: D steps run between P's segments, so "split" replays its graphs on D's SMs
    # (the default span makes each of these short prefills one segment, with no D step beside it)
    engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig("mux", block_size=4, max_batch_tokens=64),
                                               kv=KVConfig(num_blocks=256), mux=MuxConfig(span="fixed:1"),
                                               runner=runner))
    gen = torch.Generator().manual_seed(3)
    sessions, tokens = [engine.open_session() for _ in range(4)], []
    for _turn in range(3):
        rids = []
        for s in sessions:
            s.append(torch.randint(0, 256, (int(torch.randint(20, 120, (1,), generator=gen)),),
                                   generator=gen).tolist())
            rids.append(s.submit(SamplingParams(temperature=0.0, max_new_tokens=8, ignore_stop=True)))
        done = engine.run_until(rids)
        tokens += [done[r].result.token_ids for r in rids]
    engine.check_integrity()
    return tokens, engine


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("partition", ["held", "split"])
def test_mux_with_sms_held_back_from_prefill_gives_the_same_greedy_tokens(partition):
    plain, _ = _tokens(0)
    held, engine = _tokens(24, partition)
    runner = engine.runner
    assert runner.p_partition is not None and runner.p_stream is runner.p_partition.stream
    stats = runner.stats
    assert stats["piecewise_forwards"] + stats["eager_forwards"] > 0 and stats["graph_replays"] > 0
    if partition == "split":  # D ran beside P on its own SMs, from graphs captured there
        assert runner.beside_capture_error is None and runner._beside
        assert all(g.stream is runner.d_partition.stream for g in runner._beside.values())
        captured = len(runner._beside)
        assert engine.capture_graphs(8) and len(runner._beside) >= captured  # before timing: every bucket
        assert {rows for _, rows in runner._beside} >= {b for b in runner.config.graph_batch_sizes if b <= 8}
    else:
        assert runner.d_partition is None and not runner._beside
    assert runner._p_in_flight == 0
    assert held == plain
