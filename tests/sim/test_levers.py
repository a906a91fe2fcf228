"""The levers on the critical chain (`sim.levers`) and the RL-group orderings: each moves the
simulated makespan or the critical chain by what a hand count gives on a tiny trace."""
import pytest

from megatron_rollout.engine.api import Schedule
from megatron_rollout.engine.scheduler import SchedulerConfig
from megatron_rollout.sim.bounds import lower_bound
from megatron_rollout.sim.cost import CostModel
from megatron_rollout.sim.levers import Levers, Overlap, Speculation, TailLane
from megatron_rollout.sim.policy import Foresight, GroupStragglers, LeastGenerated, Oracle, Priority, make_policy
from megatron_rollout.sim.simulator import SimConfig, simulate
from megatron_rollout.trace.schema import TraceRequest

# Round numbers: a decode iteration costs 1 s, a prefill forward 5 s, nothing else.
UNIT = CostModel(decode_base_s=1.0, prefill_base_s=5.0)
# A prefills (0-5 s) and then decodes 10 tokens; B's prompt arrives at 6 s, while A decodes.
TWO = [TraceRequest("A", 0, 10, 11, 0.0), TraceRequest("B", 0, 10, 1, 6000.0)]


def config(schedule: str = "mux", **levers) -> SimConfig:
    return SimConfig(SchedulerConfig(schedule=Schedule(schedule), max_batch_tokens=64), num_blocks=1000,
                     levers=Levers(**levers))


def test_serial_mux_stretches_the_chain_by_the_prefill_it_waits_behind():
    sim = simulate(TWO, UNIT, config())
    assert sim.makespan_s == pytest.approx(20.0) and sim.finish_of() == {"A": pytest.approx(20.0), "B": 12.0}
    b = sim.breakdown()  # the real replays' definitions: A decoded 15 s, 5 of them behind B's prefill
    assert b.critical.conversation == "A" and b.critical.decode.total_s == pytest.approx(15.0)
    assert b.critical.decode.prefill_s == pytest.approx(5.0) and b.critical.decode.decode_s == pytest.approx(10.0)
    assert b.engine.idle_s == pytest.approx(0.0) and b.forwards == {"prefill": 2, "decode": 10, "mixed": 0}


def test_overlap_runs_prefill_beside_decode():
    assert simulate(TWO, UNIT, config(overlap=Overlap(1.0, 1.0))).makespan_s == pytest.approx(15.0)
    # decode_factor 2: the five overlapped seconds of prefill take 2.5 decode iterations of 2 s, the last
    # half alone at 1 s: 5.5 s for 3 of A's iterations, then 6 alone.
    sim = simulate(TWO, UNIT, config(overlap=Overlap(2.0, 1.0)))
    assert sim.makespan_s == pytest.approx(5 + 1 + 5.5 + 6)
    assert sim.breakdown().forwards["mixed"] == 3
    # prefill_factor 2: the prefill needs 10 s beside decode; A's nine iterations after B arrives end first,
    # with 4.5 s of it done; the last 0.5 s runs alone, at full speed
    assert simulate(TWO, UNIT, config(overlap=Overlap(1.0, 2.0))).makespan_s == pytest.approx(5 + 1 + 9 + 0.5)
    # alone_factor 2: B's prefill beside A's decode as before; A's own 5 s prefill, with no decode beside
    # it, runs on its partition in 10 s
    assert simulate(TWO, UNIT, config(overlap=Overlap(1.0, 1.0, 2.0))).makespan_s == pytest.approx(15.0 + 5.0)
    # a 1 s host gap after each step: B's prefill runs on through it (its own stream), 2 s a round beside
    # A's last two iterations (6-8, 8-10), its last second alone (10-11), then the gap: B ends at 12;
    # serial mux, 15. Without the gap's progress it ended at 14.
    gap = CostModel(decode_base_s=1.0, prefill_base_s=5.0, gap_s=1.0)
    short = [TraceRequest("A", 0, 10, 3, 0.0), TraceRequest("B", 0, 10, 1, 6000.0)]
    assert simulate(short, gap, config(overlap=Overlap(1.0, 1.0))).finish_of() == {"A": 10.0, "B": 12.0}
    assert simulate(short, gap, config()).makespan_s == pytest.approx(15.0)
    with pytest.raises(ValueError, match="need the mux schedule"):
        config("off", overlap=Overlap(1.0, 1.0))
    with pytest.raises(ValueError, match="decode_factor must be a number >= 1"):
        Overlap(0.5, 1.0)


def test_decode_priority_shortens_the_chain_not_the_serial_work():
    plain = simulate(TWO, UNIT, config(), Oracle())
    held = simulate(TWO, UNIT, config(critical_first=1), Oracle())  # A ranks first: B waits for A
    assert plain.finish_of()["A"] == pytest.approx(20.0)
    assert held.finish_of() == {"A": pytest.approx(15.0), "B": pytest.approx(20.0)}
    assert held.makespan_s == pytest.approx(plain.makespan_s)
    # a share of 0.5 gives the prefill 1 s after each of A's 1 s iterations: A ends at 20 again
    shared = simulate(TWO, UNIT, config(critical_first=1, critical_share=0.5), Oracle())
    assert shared.finish_of() == {"A": pytest.approx(20.0), "B": pytest.approx(16.0)}
    assert simulate(TWO, UNIT, config("off", critical_first=1), Oracle()).finish_of()["A"] == pytest.approx(15.0)


@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
def test_speculation_keeps_more_tokens_per_iteration(schedule):
    trace = [TraceRequest("a", 0, 10, 9, 0.0)]  # 8 decode iterations without speculation
    plain = simulate(trace, UNIT, config(schedule))
    assert plain.makespan_s == pytest.approx(5 + 8)
    halved = simulate(trace, UNIT, config(schedule, speculation=Speculation(1, 2, 0.5)))
    assert halved.makespan_s == pytest.approx(5 + 4) and len(halved.requests) == 1
    # a 1.5x dearer verifying iteration keeping 1.25 tokens a row: 7 iterations (the last capped)
    dear = simulate(trace, UNIT, config(schedule, speculation=Speculation(1, 1, 0.25, overhead=1.5)))
    assert dear.makespan_s == pytest.approx(5 + 7 * 1.5)
    two_rows = [TraceRequest("a", 0, 10, 9, 0.0), TraceRequest("b", 0, 10, 9, 0.0)]
    assert simulate(two_rows, UNIT, config(schedule, speculation=Speculation(1, 2, 0.5))).makespan_s == \
        pytest.approx(simulate(two_rows, UNIT, config(schedule)).makespan_s)  # above max_rows: plain
    # tail_tokens: 4 drafts (3 tokens kept an iteration) while one row decodes, 1 otherwise
    tail = Speculation(2, 1, 0.5, tail_tokens=4, tail_rows=1)
    assert tail.tokens_at(1) == 4 and tail.tokens_at(2) == 1
    assert simulate(trace, UNIT, config(schedule, speculation=tail)).makespan_s == pytest.approx(5 + 3)
    assert simulate(two_rows, UNIT, config(schedule, speculation=tail)).makespan_s == \
        pytest.approx(simulate(two_rows, UNIT, config(schedule, speculation=Speculation(2, 1, 0.5))).makespan_s)
    with pytest.raises(ValueError, match="tail_tokens must be a positive int"):
        Speculation(2, 1, 0.5, tail_tokens=0)


def test_group_orderings_read_what_the_rl_framework_knows():
    info = Foresight(arrival_order=3, turn=1, context=100, generated=7, remaining_chain_s=2.0, peers_done=0.5)
    assert GroupStragglers().key(info) == -0.5 and LeastGenerated().key(info) == 7
    assert make_policy("group-stragglers").name == "group-stragglers"

    seen = {}

    class Spy(Priority):
        name = "spy"

        def key(self, request):
            seen[(request.turn, request.arrival_order)] = request.peers_done
            return request.arrival_order

    # groups of 2: (a, b) and (c, d); a finishes first, so b's second turn sees its peer done
    trace = [TraceRequest("a", 0, 10, 2, 0.0), TraceRequest("b", 0, 10, 2, 0.0), TraceRequest("b", 1, 10, 2, 9000.0),
             TraceRequest("c", 0, 10, 2, 0.0), TraceRequest("d", 0, 10, 2, 0.0)]
    simulate(trace, UNIT, SimConfig(SchedulerConfig(schedule=Schedule.OFF), group_size=2), Spy())
    assert sorted(seen.values()) == [0.0, 0.0, 0.0, 0.0, 1.0] and seen[(1, 4)] == 1.0


def test_the_bound_counts_the_longest_conversations_decode_steps():
    # a: two turns of 5 output tokens (8 decode iterations, one after another); b: 2 iterations.
    trace = [TraceRequest("a", 0, 10, 5, 0.0), TraceRequest("a", 1, 10, 5, 0.0), TraceRequest("b", 0, 10, 3, 0.0)]
    bound = lower_bound(trace, UNIT, max_decode_rows=256)
    assert bound.work_s == pytest.approx(8.0)
    assert simulate(trace, UNIT, config("off")).makespan_s >= bound.makespan_s


def test_overlap_runs_one_segment_a_round():
    """The engine issues a prefill segment and a decode iteration each round: prefill beside decode
    does not run on into the next segment. B's 5 s prefill in 5 segments of 1 s: each beside
    iteration (2 s beside prefill, decode_alone_factor 2) shares 1 s with its segment and runs its
    other half alone on its partition, at half speed: 2 s a round, 5 rounds (6-16 s), then A's last
    4 iterations alone. One segment of 5 s (`UNIT`) lets the iterations share it whole: the third,
    issued beside its last second, runs its second half on its partition at half speed (1 s), so
    3 iterations take 6 s."""
    overlap = Overlap(2.0, 1.0, decode_alone_factor=2.0)
    cut = CostModel(decode_base_s=1.0, prefill_base_s=5.0, mux_segments=5.0)
    assert simulate(TWO, cut, config(overlap=overlap)).makespan_s == pytest.approx(5 + 1 + 10 + 4)
    assert simulate(TWO, UNIT, config(overlap=overlap)).makespan_s == pytest.approx(5 + 1 + 6 + 6)
    with pytest.raises(ValueError, match="decode_alone_factor must be a number >= 1"):
        Overlap(1.0, 1.0, decode_alone_factor=0.9)


def test_a_tail_lane_gives_the_ranked_row_steps_of_its_own():
    """A decode step costs 1 s plus 1 s a row. Without the lane, A and B decode together (3 s a step)
    until B ends at 11 s, then A alone (2 s a step) to 27 s. With a lane of one row that picks A, A
    gets a step of its own after each shared one: B ends at 15 s, A still at 27 s (its tokens cost
    2 s each alone either way). The oracle picks A, whose chain is the longer, in either order of
    arrival. Attained service and context tie at the lane's first step (one token each), so the
    request first in line takes it and then leads: A when A came first; B when B did, which ends at
    10 s and leaves A at 28 s."""
    cost = CostModel(decode_base_s=1.0, decode_row_s=1.0, prefill_base_s=5.0)
    a, b = TraceRequest("A", 0, 10, 11, 0.0), TraceRequest("B", 0, 10, 3, 0.0)
    plain = simulate([a, b], cost, config("chunked"))
    assert plain.finish_of() == {"A": pytest.approx(27.0), "B": pytest.approx(11.0)}
    a_first, b_first = {"A": pytest.approx(27.0), "B": pytest.approx(15.0)}, {"A": pytest.approx(28.0),
                                                                              "B": pytest.approx(10.0)}
    for rank, want in (("generated", b_first), ("context", b_first), ("oracle", a_first)):
        for trace, expected in (([a, b], a_first), ([b, a], want)):
            sim = simulate(trace, cost, config("chunked", tail_lane=TailLane(rows=1, steps=1, rank=rank)))
            assert sim.finish_of() == expected, (rank, [r.conversation for r in trace])
            assert sim.levers == f"lane:1r/1s/{rank}"
    # a lane as wide as the batch adds nothing
    wide = simulate([a, b], cost, config("chunked", tail_lane=TailLane(rows=2, steps=3)))
    assert wide.finish_of() == plain.finish_of()


def test_a_tail_lane_is_checked():
    with pytest.raises(ValueError, match="off or chunked"):
        config("mux", tail_lane=TailLane(1, 1))
    with pytest.raises(ValueError, match="rank must be one of"):
        TailLane(1, 1, rank="longest")
    with pytest.raises(ValueError, match="TailLane.steps must be a positive int"):
        TailLane(1, 0)
