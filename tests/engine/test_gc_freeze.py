"""`EngineConfig.gc_freeze`: while the engine has requests, or sessions open between turns, the
collector skips the objects that existed before the work came; once the last request is done with no
session open, the last session closes, or the engine sleeps, it sees them again. A process that
froze objects itself keeps its freeze, and the engine never undoes it."""
from __future__ import annotations

import dataclasses
import gc

import pytest

from megatron_rollout.engine import SamplingParams, gc_freeze
from megatron_rollout.engine.gc_freeze import GcFreeze
from tests.engine.common import prompts, small

pytestmark = pytest.mark.timeout(120)

LONG = SamplingParams(temperature=0.0, max_new_tokens=12)


@pytest.fixture(autouse=True)
def process(monkeypatch):
    """A process whose engines have not met a foreign freeze yet (the hold is process-wide)."""
    fresh = gc_freeze._Process()
    monkeypatch.setattr(gc_freeze, "PROCESS", fresh)
    return fresh


def test_frozen_only_while_requests_run(qwen, make_engine):
    engine = make_engine(qwen[1], small("mux"))
    heap = len(gc.get_objects())
    rids = [engine.add_request(p, LONG) for p in prompts([5, 9])]
    assert gc.get_freeze_count() == 0  # submitting freezes nothing: a step does
    engine.step()
    assert engine.has_work() and gc.get_freeze_count() >= heap // 2  # the heap before the step
    assert engine.gc_freeze.held
    outs = engine.run_until(rids)
    assert all(o.result.error is None and len(o.result.token_ids) == 12 for o in outs.values())
    assert gc.get_freeze_count() == 0 and not engine.gc_freeze.held  # handed back by the step that finished them
    assert engine.gc_freeze.freezes == 1


def test_held_across_a_tool_wait_until_the_last_session_closes(qwen, make_engine):
    """A conversation between turns (its tool running) is still the rollout: a collection then would
    hold up the next turn. The freeze goes when the last session closes, forks included."""
    engine = make_engine(qwen[1], small("chunked"))
    a, b = engine.open_session(), engine.open_session()
    for s, p in zip((a, b), prompts([5, 8])):
        s.append(p)
    assert len(a.generate(LONG).token_ids) == 12 and gc.get_freeze_count() > 0
    group = b.generate(dataclasses.replace(LONG, temperature=1.0, seed=3, n=2))
    assert group.token_ids and not engine.has_work() and engine.gc_freeze.held  # every turn done, sessions open
    fork, = b.forks()
    a.close()
    b.close()
    assert engine.gc_freeze.held  # the fork is a conversation still
    fork.append(prompts([3])[0])
    fork.generate(LONG)
    assert engine.gc_freeze.freezes == 1  # one freeze for the whole rollout
    fork.close()
    assert gc.get_freeze_count() == 0 and not engine.gc_freeze.held


def test_each_step_freezes_what_the_rollout_made_before_it(qwen, make_engine):
    """What the rollout keeps (results, records; here a list made between steps) is frozen by the next
    step too, so a collection late in a long rollout walks no more than one at its start."""
    engine = make_engine(qwen[1], small("chunked"))
    rid = engine.add_request(prompts([7])[0], LONG)
    engine.step()
    kept = [[i] for i in range(100_000)]  # made mid-rollout and kept to its end
    engine.step()
    assert len(gc.get_objects()) * 10 < len(kept)  # a full collection now would not walk them
    engine.run_until([rid])
    assert gc.get_freeze_count() == 0 and len(gc.get_objects()) > len(kept)
    del kept


def test_sleep_hands_the_heap_back_and_the_next_turn_takes_it(qwen, make_engine):
    """The trainer's step (`sleep`) is the rollout's end even with sessions kept open across it."""
    engine = make_engine(qwen[1], small("chunked"))
    session = engine.open_session()
    session.append(prompts([6])[0])
    session.generate(LONG)
    assert engine.gc_freeze.held
    engine.sleep()
    assert gc.get_freeze_count() == 0 and not engine.gc_freeze.held
    engine.step()  # a step while asleep (a distributed driver's) takes nothing back
    assert not engine.gc_freeze.held
    engine.wake_up()
    session.append(prompts([4])[0])
    assert len(session.generate(LONG).token_ids) == 12
    assert engine.gc_freeze.held and engine.gc_freeze.freezes == 2
    session.close()
    assert gc.get_freeze_count() == 0


def test_collections_during_a_rollout_skip_the_heap_before_it(qwen, make_engine):
    """The point of it: a full collection inside a step walks only what the rollout made. Counted,
    not timed: `gc.get_objects()` lists what a collection of every generation would walk."""
    ballast = [[i] for i in range(300_000)]  # a trainer's heap, in miniature
    walked = {}

    def walk(engine):
        engine.add_request(prompts([7])[0], SamplingParams(temperature=0.0, max_new_tokens=2))
        engine.step()
        walked[engine.gc_freeze.on] = len(gc.get_objects())
        while engine.has_work():
            engine.step()

    walk(make_engine(qwen[1], small("chunked")))
    walk(make_engine(qwen[1], dataclasses.replace(small("chunked"), gc_freeze=False)))
    assert walked[True] * 20 < len(ballast) < walked[False], walked
    del ballast


def test_off_leaves_the_collector_alone(qwen, make_engine):
    engine = make_engine(qwen[1], dataclasses.replace(small("chunked"), gc_freeze=False))
    rid = engine.add_request(prompts([6])[0], LONG)
    engine.step()
    assert gc.get_freeze_count() == 0
    engine.run_until([rid])
    assert engine.gc_freeze.freezes == 0


def test_a_freeze_made_elsewhere_is_kept(process):
    held = [object() for _ in range(10)]
    gc.freeze()
    before = gc.get_freeze_count()
    freeze = GcFreeze()
    freeze.busy(True)
    assert process.declined and not freeze.held
    freeze.busy(False)
    freeze.busy(True)  # declined for good: no freeze, no unfreeze
    # (frozen objects whose references all go are still freed, so the count may only fall a little)
    assert before // 2 < gc.get_freeze_count() <= before and freeze.freezes == 0 and process.freezes == 0
    del held


def test_engines_share_the_hold(process):
    """Frozen while either of two engines is busy; handed back when both are idle."""
    a, b = GcFreeze(), GcFreeze()
    a.busy(True)
    b.busy(True)
    a.busy(False)
    assert gc.get_freeze_count() > 0 and b.held
    b.busy(False)
    assert gc.get_freeze_count() == 0 and process.holders == 0 and process.freezes == 1


def test_busy_and_idle_alternate():
    freeze = GcFreeze()
    for _ in range(3):
        freeze.busy(True)
        freeze.busy(True)
        assert freeze.held and gc.get_freeze_count() > 0
        freeze.busy(False)
        assert not freeze.held and gc.get_freeze_count() == 0
    assert freeze.freezes == 3
    freeze.busy(False)
    assert gc.get_freeze_count() == 0  # an idle engine hands back nothing twice


def test_config_refuses_a_non_bool():
    from megatron_rollout.engine import EngineConfig

    with pytest.raises(ValueError, match="gc_freeze must be True or False, got 1"):
        EngineConfig(gc_freeze=1)
