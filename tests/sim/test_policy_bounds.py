"""Orderings and the lower bound: the oracle shortens a critical path that FIFO leaves waiting,
no schedule beats the bound, and a conversation alone runs exactly its chain."""
import dataclasses

import pytest

from megatron_rollout.engine.api import Schedule
from megatron_rollout.engine.scheduler import SchedulerConfig
from megatron_rollout.sim.bounds import lower_bound
from megatron_rollout.sim.policy import POLICIES, Fifo, Foresight, Oracle, RequestInfo, make_policy
from megatron_rollout.sim.simulator import SimConfig, simulate
from megatron_rollout.trace.make import make_trace
from megatron_rollout.trace.schema import TraceRequest

from .test_simulator import COST


def config(schedule: str, budget: int = 64) -> SimConfig:
    return SimConfig(SchedulerConfig(schedule=Schedule(schedule), max_batch_tokens=budget), num_blocks=100_000)


def test_policy_keys():
    info = Foresight(arrival_order=3, turn=1, context=100, generated=7, remaining_chain_s=2.0)
    assert [POLICIES[name]().key(info) for name in ("fifo", "oracle", "most-generated", "most-turns",
                                                    "longest-context")] == [3, -2.0, -7, -1, -100]


def test_only_the_simulator_has_an_oracle():
    with pytest.raises(TypeError, match="needs the future"):
        Oracle().key(RequestInfo(arrival_order=3, turn=1, context=100, generated=7))
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="priority must be one of"):
        SchedulerConfig(priority="oracle")  # the engine cannot know the future


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_serves_every_turn(name):
    trace = make_trace(conversations=8, seed=4, scale=0.02)
    sim = simulate(trace, COST, config("chunked"), POLICIES[name]())
    assert sim.policy == name and sorted((r.conversation, r.turn) for r in sim.requests) == sorted(
        (t.conversation, t.turn) for t in trace)


@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
def test_a_conversation_alone_runs_its_chain(schedule):
    trace = [TraceRequest("a", k, 30 + 11 * k, 3 + k, 20.0 * k) for k in range(4)]
    bound = lower_bound(trace, COST, max_decode_rows=256)
    assert bound.chain_conversation == "a"
    assert simulate(trace, COST, config(schedule, budget=512)).makespan_s == pytest.approx(bound.chain_s)


def test_the_oracle_serves_the_long_chain_first():
    # Eight one-turn conversations with long prompts, submitted first, and one conversation of many
    # short turns: FIFO makes each of its turns queue behind the long prompts' chunks.
    trace = [TraceRequest(f"s{i}", 0, 600, 2, 0.0) for i in range(8)]
    trace += [TraceRequest("long", k, 40, 8, 0.0 if k == 0 else 150.0) for k in range(10)]
    fifo = simulate(trace, COST, config("chunked"))
    oracle = simulate(trace, COST, config("chunked"), Oracle())
    assert oracle.policy == "oracle" and len(oracle.requests) == len(trace)
    assert fifo.finish_of()["long"] == pytest.approx(fifo.makespan_s)  # the long chain is the tail
    assert oracle.makespan_s < 0.9 * fifo.makespan_s  # not the chain: prefill chunks still ride its decode steps
    assert oracle.makespan_s >= lower_bound(trace, COST, 256).makespan_s



def test_most_turns_serves_the_long_chain_from_its_second_turn():
    # As above, the long chain's first turn just ahead of the long prompts: no priority without the
    # future can tell it apart at turn 0, but from its second turn on it has the most turns behind it.
    trace = [TraceRequest(f"s{i}", 0, 600, 2, 1.0) for i in range(8)]
    trace += [TraceRequest("long", k, 40, 8, 0.0 if k == 0 else 150.0) for k in range(10)]
    fifo = simulate(trace, COST, config("chunked"))
    turns = simulate(trace, COST, SimConfig(dataclasses.replace(config("chunked").scheduler, priority="most-turns"),
                                            num_blocks=100_000))
    assert turns.policy == "most-turns" and turns.makespan_s < 0.95 * fifo.makespan_s
    assert turns.makespan_s == pytest.approx(simulate(trace, COST, config("chunked"), Oracle()).makespan_s)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
def test_no_schedule_beats_the_lower_bound(seed, schedule):
    trace = make_trace(conversations=12, seed=seed, scale=0.05)
    bound = lower_bound(trace, COST, max_decode_rows=256)
    assert bound.makespan_s == max(bound.chain_s, bound.work_s) > 0
    for policy in (Fifo(), Oracle()):
        assert simulate(trace, COST, config(schedule, 512), policy).makespan_s >= bound.makespan_s * (1 - 1e-9)
