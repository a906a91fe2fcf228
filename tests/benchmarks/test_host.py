"""benchmarks.host times the engine's host work, the static layout's fill and sampling without a GPU."""
import json

import pytest

from benchmarks.host import (
    append_us,
    engine_step_ms,
    fill_ms,
    layout_ms,
    sample_ms,
    startup_ms,
    turn_layout_ms,
    verdicts_ms,
)


def test_engine_step_and_fill_are_timed():
    step = engine_step_ms(rows=2, steps=5, repeats=2)
    assert 0 < step["min"] <= step["median"] <= step["max"]
    for drafts in (0, 3):  # a decode batch, and a verify forward's one-query rows
        fills = fill_ms(rows=4, blocks=50, steps=4, repeats=2, drafts=drafts)
        assert set(fills) == {"full", "keyed"}
        assert all(0 < f["min"] <= f["median"] <= f["max"] for f in fills.values())


def test_a_mixed_steps_layout_is_timed_with_and_without_the_table_cache():
    timed = layout_ms(rows=4, blocks=50, chunk=64, steps=3, repeats=2)
    assert set(timed) == {"full", "keyed"} and all(0 < t["min"] <= t["median"] <= t["max"] for t in timed.values())
    turns = turn_layout_ms(requests=4, blocks=80, tokens=256, repeats=2)
    assert set(turns) == {"full", "keyed"} and all(0 < t["min"] <= t["median"] <= t["max"] for t in turns.values())


def test_a_turns_append_is_timed_per_thousand_tokens():
    timed = append_us(tokens=2000, repeats=2)
    assert list(timed) == ["append"]
    assert 0 < timed["append"]["min"] <= timed["append"]["median"] <= timed["append"]["max"]


@pytest.mark.timeout(60)
def test_the_start_up_submits_each_conversations_first_turn(tmp_path):
    lines = [{"conversation": c, "turn": t, "input_tokens": 300 + 100 * c + t, "output_tokens": 5, "wait_ms": 0.0}
             for c in range(3) for t in range(2)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    timed = startup_ms(str(path), repeats=2)
    assert (timed["turns"], timed["tokens"]) == (3, 300 + 400 + 500)  # the later turns are not submitted
    assert 0 < timed["ms"]["min"] <= timed["ms"]["median"] <= timed["ms"]["max"]


def test_sample_is_timed_greedy_ours_sampled_and_a_batched_noise_race():
    timed = sample_ms(rows=2, vocab=64, repeats=2)
    assert set(timed) == {"t0", "t1", "noise"}
    assert all(0 < t["min"] <= t["median"] <= t["max"] and 0 < t["issue_ms"] <= t["max"] for t in timed.values())


def test_drafting_step_is_timed_against_plain_and_emits_its_drafts():
    """Every draft is accepted once the rows repeat their token: a drafting step emits k + 1 tokens a
    row, a plain one 1."""
    from benchmarks.host import drafting_step_ms

    timed = drafting_step_ms(rows=2, drafts=3, steps=6, repeats=2)
    assert set(timed) == {"plain", "ngram:3"}
    assert all(0 < t["min"] <= t["median"] <= t["max"] for t in timed.values())
    assert timed["plain"]["tokens_per_step"] == 2 and timed["ngram:3"]["tokens_per_step"] == 2 * 4


def test_lookup_is_timed_on_text_uniform_ids_and_a_loop():
    from benchmarks.host import lookup_us

    text, uniform, loop = (lookup_us(200, kind, steps=20, repeats=2) for kind in ("text", "uniform", "loop"))
    assert all(0 < t["min"] <= t["median"] <= t["max"] for t in (text, uniform, loop))
    # the loop's suffix always recurs; text's not always; 2 of 151,936 uniform ids all but never
    assert loop["proposed"] == 1.0 and text["proposed"] < 1.0 and uniform["proposed"] < 0.1


def test_verdicts_are_timed_row_by_row_and_at_once():
    for drafts in (0, 2):
        timed = verdicts_ms(rows=3, drafts=drafts, vocab=64, repeats=2)
        assert set(timed) == {"rows", "at_once"}
        assert all(v["min"] > 0 for v in timed.values())
