"""`benchmarks.step_times`: time inside and between a replay's forwards, from its step records."""
from __future__ import annotations

import json

import pytest

from benchmarks import step_times
from megatron_rollout.engine.records import StepRecord
from megatron_rollout.trace.steps import to_columns


def _rec(phase, rows, start, end, prefill=0):
    return StepRecord(phase, rows, rows * 100, 1 if prefill else 0, prefill, prefill * prefill, start, end)


RECORDS = [_rec("P", 0, 0.000, 0.010, prefill=512), _rec("D", 1, 0.011, 0.013), _rec("D", 1, 0.020, 0.023),
           _rec("D", 3, 0.023, 0.027), _rec("D", 40, 0.028, 0.038), _rec("P", 2, 0.038, 0.048, prefill=64)]


def test_inside_between_and_the_median_forward_and_gap_by_rows():
    s = step_times.summarize(list(reversed(RECORDS)), long_gap_s=0.005)  # sorted by start first
    assert s["records"] == 6
    assert s["inside_s"] == pytest.approx(0.010 + 0.002 + 0.003 + 0.004 + 0.010 + 0.010)
    assert s["between_s"] == pytest.approx(0.001 + 0.007 + 0.001)
    assert s["long_gaps_s"] == pytest.approx(0.007)  # only the gap over 5 ms
    # the gap before a step: its planning; the 7 ms one is over the limit, a wait
    assert s["rows_1"] == {"n": 2, "median_ms": pytest.approx(2.5), "gap_ms": pytest.approx(1.0)}
    assert s["rows_2-4"] == {"n": 1, "median_ms": pytest.approx(4.0), "gap_ms": 0.0}  # the mixed one left out
    assert s["rows_5-31"] == {"n": 0, "median_ms": None, "gap_ms": None}
    assert s["rows_32+"] == {"n": 1, "median_ms": pytest.approx(10.0), "gap_ms": pytest.approx(1.0)}
    assert s["epoch_starts"] == s["later_segments"] == {"n": 0, "median_ms": None, "total_s": 0}  # no mux here


def test_the_gaps_split_where_each_engine_step_began():
    # steps begin at 10.5 ms (after the P record: 0.5 ms of loop, then 0.5 of planning) and at 15 ms
    # (inside the 7 ms gap: 2 ms of loop, 5 of planning); the other gaps hold no step start
    s = step_times.summarize(RECORDS, step_starts=[0.0105, 0.015], slept_s=0.0015)
    assert s["gaps_split_s"] == pytest.approx({"slept": 0.0015, "loop": 0.0005 + 0.002 - 0.0015,
                                               "planning": 0.0005 + 0.005, "within": 0.001})
    assert sum(s["gaps_split_s"].values()) == pytest.approx(s["between_s"])
    assert "gaps_split_s" not in step_times.summarize(RECORDS)


def test_an_epochs_start_and_its_later_segments_are_summed_apart():
    # the epoch's tokens are on its first segment's record; a later one holds none
    seg = [StepRecord("P", 0, 0, 1, 256, 256 * 256, 0.000, 0.004, epoch=1), _rec("D", 2, 0.004, 0.006),
           StepRecord("P", 0, 0, 0, 0, 0, 0.006, 0.007, epoch=1), _rec("D", 2, 0.007, 0.009),
           StepRecord("P", 0, 0, 0, 0, 0, 0.009, 0.012, epoch=1), _rec("D", 2, 0.012, 0.014)]
    s = step_times.summarize(seg)
    assert s["epoch_starts"] == {"n": 1, "median_ms": pytest.approx(4.0), "total_s": pytest.approx(0.004)}
    assert s["later_segments"] == {"n": 2, "median_ms": pytest.approx(2.0), "total_s": pytest.approx(0.004)}


def test_main_reads_a_rollout_result_and_prints_one_row_per_repeat(tmp_path, capsys):
    result = {"schedules": {"mux": {"repeats": [
        {"repeat": 0, "report": {"makespan_s": 0.05}, "steps": to_columns(RECORDS),
         "allocator": {"num_device_alloc": 3, "num_device_free": 1, "num_alloc_retries": 1, "num_ooms": 0},
         "replay_start": -0.004, "submissions": {"start": [-0.004, 0.014], "end": [-0.001, 0.019],
                                                 "tokens": [1000, 3000]},
         "gc": {"collections": [40, 3, 1], "total_s": 0.0125, "longest_s": 0.0091},
         "step_starts": [0.0105, 0.015], "sleeps": {"start": [0.0110], "end": [0.0125]}},
        {"repeat": 1, "report": {"makespan_s": 0.06}, "steps": to_columns(RECORDS[1:]),
         "gc": {"collections": [30, 2, 1], "total_s": 0.3, "longest_s": 0.25,
                "in_window": {"collections": [30, 2, 0], "total_s": 0.05, "longest_s": 0.002}}}]},
        "off": {"repeats": [{"repeat": 0, "report": {"makespan_s": 0.07}}]}}}  # no records: left out
    path = tmp_path / "rollout.json"
    path.write_text(json.dumps(result))
    assert step_times.main([str(path), "--out", str(tmp_path / "t.json")]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| mux")]
    assert len(rows) == 2 and rows[0].startswith("| mux | 0 | 0.05 | 6 |")
    # the allocator, the start-up, the turns' submissions (3 + 5 ms over 4,000 tokens) and gc, where kept
    assert rows[0].endswith("| 3 / 1 / 1 | 0.004 | 2, 0.008, 2.000 | 40/3/1, 0.013, 9.1 | 0.00 / 0.00 / 0.01 / 0.00 "
                            "| - |")  # no matmul rate in the run: no prefill share
    # repeat 1 keeps no marks: its start-up is its makespan less its records' span (0.060 - 0.037)
    assert rows[1].endswith("| - | 0.023 | - | 30/2/1, 0.300, 250.0 (in the makespan: 0.050, 2.0) | - | - |")
    saved = json.loads((tmp_path / "t.json").read_text())["mux"]
    assert saved[1]["records"] == 5 and saved[1]["start_up_s"] == pytest.approx(0.023)
    assert saved[1]["submissions"] is None
    assert saved[0]["start_up_s"] == pytest.approx(0.004)
    assert step_times.main([str(path), "--schedules", "off"]) == 1  # nothing to show


def test_a_host_profile_is_printed_by_own_time(tmp_path, capsys):
    result = {"schedules": {"mux": {"repeats": [{"repeat": 0, "report": {"makespan_s": 0.05},
                                                 "steps": to_columns(RECORDS)}]}},
              "host_profile": {"mux": {"makespan_s": 0.3, "total_s": 0.25,
                                       "by_own": [["drafting.py:167(_look_up)", 40, 0.1, 0.12],
                                                  ["engine.py:381(_step)", 40, 0.01, 0.2]]},
                               "off": {"skipped": "deadline"}}}
    path = tmp_path / "rollout.json"
    path.write_text(json.dumps(result))
    assert step_times.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "mux under cProfile: makespan 0.30 s, profiled 0.25 s" in out and "off: deadline" in out
    assert out.index("(_look_up)") < out.index("(_step)")


def test_the_steps_with_prefill_are_set_against_the_matmul_rate():
    from benchmarks.bounds import model_costs
    from megatron_rollout.model.config import PRESETS

    costs = model_costs(PRESETS["qwen3-30b-a3b-12l"])
    recs = [StepRecord("P", 2, 400, 1, 1000, 1000 * 3000 + 1000 * 1001 // 2, 0.0, 0.5),
            StepRecord("D", 8, 800, 0, 0, 0, 0.5, 0.6),
            StepRecord("P", 0, 0, 2, 500, 500 * 501 // 2 * 2, 0.6, 0.8)]
    flops = (2.0 * costs.active_params_per_token * 1500 + costs.attn_flops_per_pair * (recs[0].prefill_pairs
             + recs[2].prefill_pairs) + 2.0 * costs.vocab_hidden * 3)
    got = step_times.prefill_steps(recs, costs, matmul_flops=1e12)
    assert (got["n"], got["span_s"]) == (2, pytest.approx(0.7))
    assert got["flops"] == pytest.approx(flops) and got["share_of_matmul_rate"] == pytest.approx(flops / 0.7 / 1e12)
    result = {"model": "qwen3-30b-a3b-12l", "ceilings": {"bf16_matmul_flops": 1e12},
              "schedules": {"off": {"repeats": [{"repeat": 0, "report": {"makespan_s": 1.0},
                                                 "steps": to_columns(recs)}]}}}
    assert step_times.step_times(result)["off"][0]["prefill_steps"]["flops"] == pytest.approx(flops)
    del result["ceilings"]  # no matmul rate measured (CPU): nothing to set them against
    assert step_times.step_times(result)["off"][0]["prefill_steps"] is None
