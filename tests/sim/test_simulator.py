"""The simulator: the engine's planner on modelled state gives the engine's own forwards, known
costs give hand-computed makespans, KV pressure and tool waits behave as in the engine."""
import dataclasses
import time

import pytest
import torch

from megatron_rollout.engine import EngineConfig, KVConfig, SchedulerConfig
from megatron_rollout.engine.api import Schedule
from megatron_rollout.model.checkpoint import load_model
from megatron_rollout.sim.check import real_replay
from megatron_rollout.sim.cost import CostModel, StepSize, observations
from megatron_rollout.sim.simulator import SimConfig, SimulationError, simulate
from megatron_rollout.trace.make import make_trace
from megatron_rollout.trace.schema import TraceRequest

COST = CostModel(decode_base_s=0.01, decode_row_s=0.001, decode_context_s=1e-6, prefill_base_s=0.02,
                 prefill_row_s=0.002, prefill_token_s=1e-4, prefill_pair_s=1e-8, gap_s=0.0005)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model("tiny-moe", device="cpu")


# Deterministic traces (all released at once, or one conversation): the forwards do not depend on timing.
TRACES = {
    "batch": [TraceRequest(f"c{i}", 0, 20 + 7 * i, 4 + i, 0.0) for i in range(4)],
    "turns": [TraceRequest("a", k, 30 - 5 * k, 5, 0.0) for k in range(3)],
}


@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
@pytest.mark.parametrize("name", sorted(TRACES))
def test_simulated_forwards_are_the_engines(model, schedule, name):
    trace = TRACES[name]
    config = EngineConfig(scheduler=SchedulerConfig(schedule=schedule, max_batch_tokens=48), kv=KVConfig(num_blocks=64))
    _, records = real_replay(model, config, trace, seed=0)
    sim = simulate(trace, COST, SimConfig.of_engine(config))
    real = [size for size, _ in observations(records)]
    if schedule == "mux":  # the engine's segments are one observation per epoch, listed last
        assert sorted(map(repr, sim.sizes)) == sorted(map(repr, real))
    else:
        assert list(sim.sizes) == real
    assert len(sim.requests) == len(trace) and sim.preemptions == 0


def test_a_known_cost_gives_the_hand_computed_makespan():
    trace = [TraceRequest("a", 0, 10, 3, 0.0), TraceRequest("a", 1, 4, 2, 500.0)]
    sim = simulate(trace, COST, SimConfig(SchedulerConfig(schedule=Schedule.OFF)))
    turn0 = COST.step_s(StepSize(prefill_rows=1, prefill_tokens=10, prefill_pairs=55)) \
        + COST.step_s(StepSize(decode_rows=1, decode_context=11)) \
        + COST.step_s(StepSize(decode_rows=1, decode_context=12))
    # turn 1 prefills its 4 tokens and turn 0's last sampled token after 12 cached positions
    turn1 = COST.step_s(StepSize(prefill_rows=1, prefill_tokens=5, prefill_pairs=5 * 12 + 15)) \
        + COST.step_s(StepSize(decode_rows=1, decode_context=18))
    assert sim.makespan_s == pytest.approx(turn0 + turn1 + 5 * COST.gap_s + 0.5)
    first, second = sim.requests
    assert second.arrival == pytest.approx(first.finish + 0.5)
    assert sim.steps == 5


@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
def test_a_turns_submission_costs_its_tokens_at_the_start_up_or_the_later_rate(schedule):
    """A replay's start-up: every mark moves by the first turns' tokens times `submit_token_s`, which a
    later turn does not pay; it pays `turn_token_s` for its own."""
    trace = [TraceRequest("a", 0, 30, 3, 0.0), TraceRequest("a", 1, 400, 2, 5.0), TraceRequest("b", 0, 20, 4, 0.0)]
    config = SimConfig(SchedulerConfig(schedule=schedule, max_batch_tokens=48))
    plain = simulate(trace, COST, config)
    charged = simulate(trace, dataclasses.replace(COST, submit_token_s=1e-3), config)
    assert charged.makespan_s == pytest.approx(plain.makespan_s + 1e-3 * (30 + 20))
    assert charged.sizes == plain.sizes
    for a, b in zip(plain.requests, charged.requests):
        assert (b.conversation, b.turn) == (a.conversation, a.turn)
        assert b.finish == pytest.approx(a.finish + 0.05)
    arrival = {(r.conversation, r.turn): r.arrival for r in charged.requests}
    assert arrival[("a", 0)] == pytest.approx(0.03) and arrival[("b", 0)] == pytest.approx(0.05)  # one after the other
    later = simulate(trace, dataclasses.replace(COST, turn_token_s=1e-4), config)  # a's turn 1, between steps
    assert later.makespan_s == pytest.approx(plain.makespan_s + 1e-4 * 400)
    assert later.sizes == plain.sizes


@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
def test_kv_pressure_preempts_or_evicts_and_everything_finishes(schedule):
    # 6 conversations of 3 turns, 9 blocks each at their end: 54 blocks wanted at once, 20 there
    trace = [TraceRequest(c, k, 40, 4, 0.0) for k in range(3) for c in range(6)]
    config = SimConfig(SchedulerConfig(schedule=Schedule(schedule), max_batch_tokens=64), num_blocks=20)
    sim = simulate(trace, COST, config)
    assert len(sim.requests) == len(trace)
    assert sim.preemptions + sim.evictions > 0
    roomy = simulate(trace, COST, SimConfig(config.scheduler, num_blocks=4096))
    assert roomy.preemptions == roomy.evictions == 0
    # recomputation: more prefill under pressure than with room
    assert sum(s.prefill_tokens for s in sim.sizes) > sum(s.prefill_tokens for s in roomy.sizes)


def test_a_request_no_pool_can_hold_is_an_error():
    with pytest.raises(SimulationError, match="turn 0 needs 4 KV blocks, the pool holds 3"):
        simulate([TraceRequest("a", 0, 60, 2, 0.0)], COST, SimConfig(num_blocks=3))


def test_a_paper_scale_trace_simulates_in_seconds():
    trace = make_trace(conversations=128, seed=5, scale=1.0, profile="prefill")
    config = SimConfig(SchedulerConfig(max_batch_tokens=8192), num_blocks=200_000)
    t0 = time.perf_counter()
    sim = simulate(trace, COST, config)
    assert time.perf_counter() - t0 < 60  # a few seconds on a quiet core
    assert len(sim.requests) == len(trace)
