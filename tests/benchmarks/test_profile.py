"""The profiler bench's host-side pieces: phase clocks and the busy-time union (CPU)."""
import time
import types

import pytest

pytest.importorskip("torch.profiler")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from benchmarks.profile import SHAPES, PhaseClock, _busy_us, op_table, parse_shape  # noqa: E402
from megatron_rollout.types import Phase  # noqa: E402


def test_busy_time_is_the_union_of_overlapping_intervals():
    assert _busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert _busy_us([]) == 0


def test_phase_clock_times_wrapped_calls_and_restores_them():
    owner = types.SimpleNamespace(work=lambda s: time.sleep(s) or s)
    original = owner.work
    with PhaseClock({"work": (owner, "work")}) as clock:
        assert owner.work(0.02) == 0.02
        assert owner.work is not original
    assert owner.work is original
    assert 0.015 < clock.seconds["work"] < 0.5


def test_op_table_counts_per_call_and_keeps_the_labelled_segments():
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function("seg00 embed"):
                x @ x
            with record_function("seg01 L0.moe_exchange"):
                x + x
    table = op_table(prof, calls=2)
    assert table["launches"] == 0  # no GPU: no kernel launches
    assert [s["name"] for s in table["sections"]] == ["seg00 embed", "seg01 L0.moe_exchange"]
    assert all(s["count"] == 2 for s in table["sections"])
    assert any(r["name"] == "aten::mm" and r["count"] == 2 for r in table["by_host"])


@pytest.mark.parametrize("ahead", ["off", "on"])
def test_decode_phases_name_callables_a_cpu_engine_runs(ahead):
    """Every phase `benchmarks.profile.decode_idle` clocks exists on the engine and is entered by a
    decode step (a renamed method would stop the GPU bench at its last stage)."""
    from benchmarks.profile import decode_phases
    from megatron_rollout.engine import (
        EngineConfig,
        KVConfig,
        RolloutEngine,
        RunnerConfig,
        SamplingParams,
        SchedulerConfig,
    )
    from megatron_rollout.model.config import PRESETS
    from megatron_rollout.model.transformer import MoETransformer

    engine = RolloutEngine(MoETransformer(PRESETS["tiny-moe"]).init_weights(0),
                           EngineConfig(scheduler=SchedulerConfig("off"), kv=KVConfig(num_blocks=64),
                                        runner=RunnerConfig(decode_ahead=ahead)))
    for prompt in ([1, 2, 3], [4, 5]):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_stop=True))
    engine.step()  # the prefill
    with PhaseClock(decode_phases(engine)) as clock:
        for _ in range(4):
            engine.step()
    entered = {name for name, s in clock.seconds.items() if s > 0}
    every_step = {"plan", "draw (issue)", "complete (wait + bookkeeping)", "step"}
    every_step |= {"issue ahead (refill + launch)"} if ahead == "on" else {"inputs", "forward (refill + launch)"}
    assert every_step <= entered, clock.seconds


def test_idle_windows_are_summarised_by_median_and_range():
    from benchmarks.profile import summarize_idle

    reps = [{"wall_ms_per_step": w, "device_busy_ms_per_step": 6.0, "idle_share": 1 - 6.0 / w,
             "host_idle_share": 0.01 * w, "rows": 64} for w in (7.0, 6.5, 8.0)]
    s = summarize_idle(reps)
    assert s["n"] == 3 and s["repeats"] == reps
    assert [s[k]["wall_ms_per_step"] for k in ("min", "median", "max")] == [6.5, 7.0, 8.0]
    assert s["median"]["idle_share"] == pytest.approx(1 - 6.0 / 7.0)


def test_host_idle_is_the_idle_time_less_the_gaps_inside_the_graphs():
    from benchmarks.profile import host_idle_share

    # a step of 1.0 ms wall, 0.8 ms of kernels; back to back the graph idles 1/9 of its span,
    # i.e. 0.1 ms of gaps per 0.8 ms of kernels: the host left the GPU waiting 0.1 ms
    assert host_idle_share(1.0, 0.8, 1 / 9) == pytest.approx(0.1)
    assert host_idle_share(1.0, 0.8, 0.0) == pytest.approx(0.2)  # no gaps in the graph: all the host's
    assert host_idle_share(0.9, 0.8, 1 / 9) == pytest.approx(0.0, abs=1e-12)


def test_forward_modes_are_timed_interleaved_and_the_config_comes_back(monkeypatch):
    from benchmarks import profile as prof
    from megatron_rollout.engine.config import RunnerConfig
    from megatron_rollout.runner.cuda import CudaRunner

    own, eager, piecewise = RunnerConfig(), RunnerConfig(prefill_graph_tokens=()), RunnerConfig(use_graphs=True)
    names = {id(eager): "eager", id(piecewise): "piecewise"}
    seen = []

    def fake_drive(runner, inputs, phase, label=False):
        seen.append((names.get(id(runner.config)), label))
        return (0.001, 0.002 if runner.config is eager else 0.001)

    class Runner:  # what forward_profiles reads off a CudaRunner
        config = own
        configured, PER_FORWARD_SETTINGS = CudaRunner.configured, CudaRunner.PER_FORWARD_SETTINGS

    monkeypatch.setattr(prof, "drive", fake_drive)
    runner = Runner()
    out = prof.forward_profiles(runner, [], None, {"eager": eager, "piecewise": piecewise}, reps=3)
    assert runner.config is own
    timed = [c for c, label in seen[4:4 + 6]]  # after 2 warm-ups per mode
    assert timed == ["eager", "piecewise"] * 3
    assert out["eager"]["device_ms"] == pytest.approx(2.0) and out["piecewise"]["device_ms"] == pytest.approx(1.0)
    assert [c for c, label in seen if label] == ["eager"] * 3 + ["piecewise"] * 3


def test_shapes_parse_to_a_phase_and_spans():
    assert parse_shape("P 8x(2048+512)") == (Phase.P, [(2048, 512)] * 8)
    assert parse_shape("mixed 16x(2047+1) + 1x(0+512)") == (Phase.D, [(2047, 1)] * 16 + [(0, 512)])
    assert parse_shape("D eager 2x(10+1)") == (Phase.D, [(10, 1)] * 2)
    assert parse_shape("mixed 48x(20000+1) + 1x(30000+16336)")[1][-1] == (30000, 16336)
    assert all(parse_shape(s)[1] for s in SHAPES)  # every default parses
    for bad in ("P", "P 8x2048", "P 0x(1+1)", "P 1x(5+0)", "8x(1+1)", "P 1x(1+1) 2x(1+1)"):
        with pytest.raises(SystemExit, match="shape"):
            parse_shape(bad)
