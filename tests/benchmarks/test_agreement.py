"""`benchmarks.agreement`: turn digests, their comparison and the one-line note."""
from __future__ import annotations

import pytest

from benchmarks.agreement import agreement, agreement_note, compare, digest, replay_digests, turn_key


def test_a_digest_stands_for_the_ids_their_order_and_length():
    assert digest([1, 2, 3]) == digest((1, 2, 3)) and len(digest([1])) == 16
    assert len({digest(ids) for ids in ([1, 2, 3], [3, 2, 1], [1, 2], [1, 2, 3, 0], [], [2 ** 40])}) == 6


def test_compare_counts_turns_and_whole_conversations():
    a = {"0/0": "x", "0/1": "y", "1/0": "z", "2/0": "w"}
    b = {"0/0": "x", "0/1": "Y", "1/0": "z", "3/0": "v"}  # conversation 0 parts at turn 1; 2 and 3 not shared
    assert compare(a, b) == {"turns": 2, "of": 3, "conversations": 1, "of_conversations": 2,
                             "first_turn_differs": 0}
    assert compare(a, a) == {"turns": 4, "of": 4, "conversations": 3, "of_conversations": 3,
                             "first_turn_differs": 0}
    # 0 differs on its first turn, 1 only later: turns order as numbers (2 before 10)
    assert compare({"0/0": "x", "1/2": "q", "1/10": "q"}, {"0/0": "X", "1/2": "q", "1/10": "Q"}) == {
        "turns": 1, "of": 3, "conversations": 0, "of_conversations": 2, "first_turn_differs": 1}


def test_our_digests_come_from_the_replay_s_outputs():
    from types import SimpleNamespace as NS

    outs = [NS(request_id=5, result=NS(token_ids=[4, 4])), NS(request_id=6, result=NS(token_ids=[1]))]
    got = replay_digests(outs, {5: "c", 6: 7}, {5: NS(turn=2), 6: NS(turn=0)})
    assert got == {turn_key("c", 2): digest([4, 4]), "7/0": digest([1])}


def _result(ours: list[dict], passes: list[dict]) -> dict:
    return {"schedules": {"off": {"repeats": [{"digests": d} for d in ours[:1]]},
                          "mux": {"repeats": [{"digests": d} for d in ours[1:]] + [{"finished": False}]}},
            "vllm": {"budgets": {"16384": {"passes": [{"makespan_s": 1.0, "digests": d} for d in passes]}}}}


def test_every_replay_is_set_against_our_first_and_the_peer_s_against_its_first():
    ref = {"0/0": "a", "0/1": "b", "1/0": "c"}
    theirs = {"0/0": "a", "0/1": "B", "1/0": "c"}
    result = _result([ref, dict(ref), dict(ref)], [ref, theirs])
    got = agreement(result)
    assert got["reference"] == "off" and [c["turns"] for c in got["ours"]] == [3, 3, 3]
    assert [c["turns"] for c in got["vllm"]["16384"]["with_ours"]] == [3, 2]
    assert [c["turns"] for c in got["vllm"]["16384"]["with_its_first"]] == [2]
    assert agreement_note(result) == ("greedy tokens alike on 3 of 3 turns across our 3 replays; "
                                      "vLLM@16384 2-3 with ours, 2 between its passes")


@pytest.mark.parametrize("result", [{}, {"schedules": {"off": {"repeats": [{"report": {}}]}}}])
def test_no_digests_no_note(result):
    assert agreement(result) is None and agreement_note(result) is None
