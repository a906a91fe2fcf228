"""The simulator against a tiny CPU rollout's own step records: every schedule gets in- and
out-of-sample errors from both fits (CPU timing is noisy: finite, not small); a drafting schedule
is simulated with the Speculation lever, fitted in sample by its verify positions, or skipped with
its reason."""
from __future__ import annotations

import json
import math

import pytest

from benchmarks import rollout, sim_replay
from megatron_rollout.sim import cost as sim_cost
from megatron_rollout.sim.cost import turn_cost
from megatron_rollout.sim.levers import Overlap, Speculation
from megatron_rollout.sim.policy import POLICIES
from megatron_rollout.sim.simulator import simulate
from megatron_rollout.trace.schema import load_trace
from megatron_rollout.trace.steps import from_columns


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rec")
    code = rollout.main(["--model", "tiny-moe", "--device", "cpu", "--repeats", "2", "--conversations", "3",
                         "--scale", "0.003", "--budgets", "64", "--schedules", "off,chunked,mux", "--no-ablation",
                         "--out", str(out), "--no-progress"])
    assert code == 0
    return out, json.loads((out / "rollout.json").read_text())


@pytest.mark.timeout(120)
def test_every_schedule_gets_both_errors_from_both_fits(run, capsys):
    out, _ = run
    assert sim_replay.main([str(out / "rollout.json"), "--out", str(out / "sim.json"), "--plot",
                            str(out / "errors.png")]) == 0
    assert (out / "errors.png").stat().st_size > 0
    report = json.loads((out / "sim.json").read_text())
    assert report["moe"] == {"num_experts": 8, "top_k": 2}
    assert report["pooled"]["experts"]["routing"] == {"num_experts": 8, "top_k": 2}
    assert report["pooled"]["linear"]["routing"] is None
    assert list(report["schedules"]) == ["off", "chunked", "mux"]
    for label, row in report["schedules"].items():
        measured = json.loads((out / "rollout.json").read_text())["schedules"][label]["repeats"]
        assert row["in_sample"]["measured_s"] == measured[0]["report"]["makespan_s"]
        assert row["out_of_sample"]["measured_s"] == measured[1]["report"]["makespan_s"]  # median of one
        for part in (row["in_sample"], row["out_of_sample"]):
            for fit_name in sim_replay.FITS:
                r = part[fit_name]
                assert r["sim_s"] > 0 and math.isfinite(r["error"]), (label, fit_name, r)
                assert r["error"] == pytest.approx(r["sim_s"] / part["measured_s"] - 1)
    text = capsys.readouterr().out
    assert "lin_in" in text and "exp_out" in text and "skipped" not in text


@pytest.mark.timeout(60)
def test_a_dense_model_has_no_experts_fit_and_drafting_uses_the_lever(run):
    out, result = run
    trace = load_trace(out / "trace.jsonl")
    dense = sim_replay.sim_replay({**result, "moe": None}, trace)
    for row in dense["schedules"].values():
        assert row["in_sample"]["experts"] == {"skipped": "a dense model has no expert term"}
        assert math.isfinite(row["in_sample"]["linear"]["error"])
    first = result["schedules"]["chunked"]["repeats"][0]
    decode_rows = sum(n for n in first["steps"]["decode_rows"] if 0 < n <= 2)
    stats = {**first["engine_stats"], "drafted_tokens": 2 * decode_rows, "accepted_tokens": decode_rows}
    config = sim_replay._sim_config(result, "chunked~ngram:4:2", 64, {**first, "engine_stats": stats})
    # two drafts a row and iteration on average, half of them accepted
    assert config.levers.speculation == Speculation(max_rows=2, draft_tokens=2, acceptance=0.5)
    # with tail_k: each row drafts the same share of its most (4, or 6 while one row decodes)
    one = sum(n for n in first["steps"]["decode_rows"] if n == 1)
    stats = {**first["engine_stats"], "drafted_tokens": (2 * (decode_rows - one) + 3 * one),
             "accepted_tokens": decode_rows}
    tail = sim_replay._sim_config(result, "chunked~ngram:4:2+6@1", 64, {**first, "engine_stats": stats})
    assert one and tail.levers.speculation == Speculation(2, 2, acceptance=decode_rows / (2 * decode_rows + one),
                                                          tail_tokens=3, tail_rows=1)
    assert "not modelled" in sim_replay._sim_config(result, "chunked~mtp:1", 64, first)
    assert "not modelled" in sim_replay._sim_config(result, "mux~ngram:4^7", 64, first)
    assert "no `held` run" in sim_replay._sim_config(result, "mux/sms:24", 64, first)
    assert "(split): no `driver` run" in sim_replay._sim_config(result, "mux/split:24", 64, first)
    spec = {**result, "schedules": {"off": result["schedules"]["off"],
                                    "chunked~ngram:4": {**result["schedules"]["chunked"], "spec": "chunked~ngram:4"}}}
    row = sim_replay.sim_replay(spec, trace)["schedules"]["chunked~ngram:4"]
    assert math.isfinite(row["in_sample"]["linear"]["error"])  # its records carry decode_positions
    assert math.isfinite(row["out_of_sample"]["linear"]["error"])


@pytest.mark.timeout(60)
def test_the_start_up_before_the_first_forward_is_charged_per_first_turn_token(run):
    out, result = run
    trace = load_trace(out / "trace.jsonl")
    first = result["schedules"]["off"]["repeats"][0]
    records = from_columns(first["steps"])
    seconds = sim_replay.first_forward_s(first)
    assert seconds == min(r.start for r in records) - first["replay_start"] >= 0
    tokens = sum(t.input_tokens for t in trace if t.turn == 0)  # every conversation starts at once
    assert all(t.wait_ms == 0 for t in trace if t.turn == 0)
    assert sim_replay.submit_cost(first, trace) == pytest.approx(seconds / tokens)
    # a result from before the field: its makespan less its records' span, which agrees with the mark but
    # for the bookkeeping between the last forward's end and the last turn's finish
    older = {k: v for k, v in first.items() if k != "replay_start"}
    assert abs(sim_replay.first_forward_s(older) - seconds) < 0.1 * first["report"]["makespan_s"]
    report = sim_replay.sim_replay(result, trace)
    cost = report["schedules"]["off"]["in_sample"]["cost"]["linear"]
    assert cost["submit_token_s"] == pytest.approx(seconds / tokens)
    pooled = [sim_replay.submit_cost(result["schedules"][n]["repeats"][0], trace) for n in ("off", "chunked")]
    assert report["pooled"]["linear"]["submit_token_s"] == pytest.approx(sum(pooled) / 2)
    marks = sim_replay.submissions(first)  # every turn's, the later ones charged at their own rate
    assert sorted(n for _, _, n in marks) == sorted(t.input_tokens for t in trace)
    assert cost["turn_token_s"] == pytest.approx(turn_cost(marks)) and cost["turn_token_s"] > 0
    assert sim_replay.submissions({k: v for k, v in first.items() if k != "submissions"}) == []
    slept = sim_replay.sleeps(first)  # marked: each gap less its sleeps and submissions is host time
    assert slept is not None and sim_replay.sleeps({k: v for k, v in first.items() if k != "sleeps"}) is None
    assert cost["gap_s"] == pytest.approx(sim_cost.fit(records, submissions=marks, sleeps=slept).gap_s)
    own = [report["schedules"][n]["in_sample"]["cost"]["linear"]["gap_s"] for n in ("off", "chunked")]
    assert min(own) <= report["pooled"]["linear"]["gap_s"] <= max(own)  # the time between the two replays is no gap
    starts = first["step_starts"]  # every engine step of the replay, each before its forward
    assert len(starts) == first["engine_stats"]["steps"] and starts == sorted(starts)
    assert first["replay_start"] <= starts[0] <= min(r.start for r in records)


@pytest.mark.timeout(120)
def test_every_ordering_is_simulated_on_both_linear_fits_against_fifo(run, capsys):
    out, result = run
    assert sim_replay.main([str(out / "rollout.json"), "--orderings", "--out", str(out / "ord.json")]) == 0
    rows = json.loads((out / "ord.json").read_text())["orderings"]
    assert list(rows) == ["off", "chunked", "mux"]
    for row in rows.values():
        assert row["priority"] == "fifo"
        for part in ("in_sample", "out_of_sample"):
            assert list(row[part]) == list(POLICIES)  # the engine's priorities, then the oracle
            assert row[part]["fifo"]["over_fifo"] == 1.0
            fifo = row[part]["fifo"]["sim_s"]
            for cell in row[part].values():
                assert cell["sim_s"] > 0 and cell["over_fifo"] == pytest.approx(cell["sim_s"] / fifo)
    text = capsys.readouterr().out
    assert "| schedule | fit | FIFO s | most-turns / FIFO |" in text and "oracle / FIFO" in text
    assert text.count("| `mux` |") == 2
    # a partition's own records already hold the slow-down: no in-sample fit (the errors' check and orderings alike)
    split = {**result, "schedules": {**result["schedules"], "mux/split:24": {**result["schedules"]["mux"],
                                                                          "spec": "mux/split:24"}}}
    pd = {"runs": [{"method": "driver", "split": "108/24", "decode_factor": 1.5, "prefill_factor": 1.2}]}
    trace = load_trace(out / "trace.jsonl")
    config = sim_replay._sim_config(split, "mux/split:24", result["schedules"]["mux"]["budget"],
                                    sim_replay._first(result["schedules"]["mux"]), sim_replay.measured_overlaps(pd))
    assert "count the slow-down twice" in sim_replay._own_fits(split, trace, sim_replay._first(
        result["schedules"]["mux"]), config)


@pytest.mark.timeout(60)
def test_another_runs_off_and_chunked_can_make_the_out_of_sample_fit(run):
    out, result = run
    trace = load_trace(out / "trace.jsonl")
    only_mux = {**result, "schedules": {"mux": result["schedules"]["mux"]}}
    alone = sim_replay.sim_replay(only_mux, trace)
    assert "no repeat 0 with step records" in alone["schedules"]["mux"]["out_of_sample"]["linear"]["skipped"]
    helped = sim_replay.sim_replay(only_mux, trace, fit_from=result)
    assert helped["pooled"] == sim_replay.sim_replay(result, trace)["pooled"]
    assert math.isfinite(helped["schedules"]["mux"]["out_of_sample"]["linear"]["error"])
    with pytest.raises(SystemExit, match="its model is 'other'"):
        sim_replay.sim_replay(only_mux, trace, fit_from={**result, "model": "other"})


@pytest.mark.timeout(60)
def test_the_trace_may_be_named_apart_from_the_result(run, tmp_path):
    out, result = run
    moved = tmp_path / "r.json"
    moved.write_text(json.dumps(result))
    with pytest.raises(SystemExit, match="--trace"):
        sim_replay.main([str(moved)])
    assert sim_replay.main([str(moved), "--trace", str(out / "trace.jsonl"), "--out", str(tmp_path / "s.json")]) == 0
    assert list(json.loads((tmp_path / "s.json").read_text())["schedules"]) == ["off", "chunked", "mux"]


def test_completion_polls_of_older_records_are_not_segments():
    from megatron_rollout.engine.records import StepRecord

    def rec(start, end, tokens=0, epoch=1):
        return StepRecord("P", 0, 0, 1 if tokens else 0, tokens, 0, start, end, epoch)

    decode = StepRecord("D", 2, 10, 0, 0, 0, 4e-3, 5e-3)
    records = [rec(0.0, 1e-3, tokens=64), rec(1e-3, 1.2e-3), rec(2e-3, 2.005e-3), rec(3e-3, 3.008e-3),
               decode, rec(5e-3, 5.005e-3), rec(6e-3, 6.2e-3, epoch=2), rec(7e-3, 7.001e-3, epoch=2)]
    kept = sim_replay.without_polls(records)
    # an epoch's first record is kept however short, and so is a poll in a round that decoded
    assert kept == records[:2] + records[4:7]


@pytest.mark.timeout(300)
def test_a_drafting_replay_is_fitted_in_sample_by_its_positions(tmp_path):
    """Verify forwards record their positions (a row and its drafts), so a drafting replay gets an
    in-sample fit in the unit the Speculation lever costs it; older records skip with the reason."""
    from megatron_rollout.trace.steps import from_columns

    assert rollout.main(["--model", "tiny-moe", "--device", "cpu", "--repeats", "1", "--conversations", "2",
                         "--profile", "decode", "--scale", "0.02", "--budgets", "64", "--schedules", "off~ngram:3",
                         "--no-ablation", "--out", str(tmp_path), "--no-progress"]) == 0
    result = json.loads((tmp_path / "rollout.json").read_text())
    first = result["schedules"]["off~ngram:3"]["repeats"][0]
    records = from_columns(first["steps"])
    assert first["engine_stats"]["drafted_tokens"] > 0
    assert any(r.positions > r.decode_rows for r in records)  # some rows verified drafts
    trace = load_trace(tmp_path / "trace.jsonl")
    row = sim_replay.sim_replay(result, trace)["schedules"]["off~ngram:3"]
    assert math.isfinite(row["in_sample"]["linear"]["error"]) and row["speculation"]["draft_tokens"] >= 1
    old = {**first, "steps": {k: v for k, v in first["steps"].items() if k != "decode_positions"}}
    stale = {**result, "schedules": {"off~ngram:3": {**result["schedules"]["off~ngram:3"], "repeats": [old]}}}
    assert "predate `decode_positions`" in sim_replay.sim_replay(stale, trace)["schedules"]["off~ngram:3"][
        "in_sample"]["skipped"]


@pytest.mark.timeout(120)
def test_sms_held_back_are_simulated_with_the_held_methods_overlap_factors(run):
    out, result = run
    trace = load_trace(out / "trace.jsonl")
    mux = result["schedules"]["mux"]
    spec = {**result, "schedules": {"off": result["schedules"]["off"], "chunked": result["schedules"]["chunked"],
                                    "mux": mux, "mux/sms:24": {**mux, "spec": "mux/sms:24"}}}
    pd = {"runs": [{"method": "driver", "split": "108/24", "decode_factor": 9.0, "prefill_factor": 9.0,
                    "prefill_partition_factor": 1.25, "decode_partition_factor": 1.5},
                   {"method": "held", "split": "116/16", "error": "RuntimeError: refused"},
                   {"method": "held", "split": "108/24", "decode_factor": 1.0, "prefill_factor": 1.0}]}
    assert sim_replay.measured_overlaps(pd) == {("held", 24): Overlap(1.0, 1.0),  # "held": D keeps every SM
                                                ("split", 24): Overlap(9.0, 9.0, 1.25, 1.5)}
    rows = sim_replay.sim_replay(spec, trace, overlap_from=pd)["schedules"]
    held = rows["mux/sms:24"]
    assert held["overlap"] == {"decode_factor": 1.0, "prefill_factor": 1.0, "alone_factor": 1.0,
                               "decode_alone_factor": 1.0}
    assert "count the slow-down twice" in held["in_sample"]["skipped"]
    # P and D side by side at no cost to either: shorter than the serial mux on the same costs
    assert held["out_of_sample"]["linear"]["sim_s"] < rows["mux"]["out_of_sample"]["linear"]["sim_s"]
    skipped = sim_replay.sim_replay(spec, trace)["schedules"]["mux/sms:24"]
    assert "no `held` run of benchmarks.pd_overlap" in skipped["out_of_sample"]["skipped"]
    split = sim_replay.sim_replay({**spec, "schedules": {**spec["schedules"], "mux/split:24": {
        **mux, "spec": "mux/split:24"}}}, trace, overlap_from=pd)["schedules"]["mux/split:24"]
    assert split["overlap"] == {"decode_factor": 9.0, "prefill_factor": 9.0, "alone_factor": 1.25,
                                "decode_alone_factor": 1.5}  # the driver run's


@pytest.mark.timeout(120)
def test_mux_segment_sweep_prices_each_count_against_off(run, capsys):
    out, result = run
    assert sim_replay.main([str(out / "rollout.json"), "--mux-segments", "1,4", "--out", str(out / "seg.json"),
                            "--plot", str(out / "seg.png")]) == 0
    assert (out / "seg.png").stat().st_size > 0
    sweep = json.loads((out / "seg.json").read_text())["mux_segments"]
    assert [r["segments"] for r in sweep["mux"]] == [1.0, 4.0] and sweep["measured_segments"] >= 1
    for row in sweep["mux"]:
        assert row["makespan_over_off"] == pytest.approx(row["makespan_s"] / sweep["off"]["makespan_s"])
        assert row["ttft_over_off"] == pytest.approx(row["mean_ttft_s"] / sweep["off"]["mean_ttft_s"])
        assert 0 <= row["mean_queue_s"] <= row["mean_ttft_s"]
    one, four = sweep["mux"]
    assert one["makespan_s"] != four["makespan_s"] or one["mean_ttft_s"] != four["mean_ttft_s"]  # the count is used
    assert "| mux segments per epoch |" in capsys.readouterr().out
    for bad in ("0", "x", ","):
        with pytest.raises(SystemExit, match="positive numbers"):
            sim_replay.main([str(out / "rollout.json"), "--mux-segments", bad])
    no_mux = {**result, "schedules": {n: e for n, e in result["schedules"].items() if n != "mux"}}
    with pytest.raises(SystemExit, match="missing: \\['mux'\\]"):
        sim_replay.segment_sweep(no_mux, load_trace(out / "trace.jsonl"), [1])


@pytest.mark.timeout(120)
def test_what_if_predicts_a_partition_against_the_schedule_it_extends(run, capsys):
    out, result = run
    pd = out / "pd.json"
    pd.write_text(json.dumps({"runs": [{"method": "driver", "split": "108/24", "decode_factor": 1.0,
                                        "prefill_factor": 1.0}]}))
    assert sim_replay.main([str(out / "rollout.json"), "--overlap-from", str(pd), "--out", str(out / "wi.json"),
                            "--what-if", "mux/split:24,mux/sms:24,mux+most-turns/split:24"]) == 0
    rows = json.loads((out / "wi.json").read_text())["what_if"]
    split = rows["mux/split:24"]
    assert split["of"] == "mux" and split["overlap"] == {"decode_factor": 1.0, "prefill_factor": 1.0,
                                                         "alone_factor": 1.0, "decode_alone_factor": 1.0}
    for fit in sim_replay.FITS:  # side by side at no cost to either: shorter than the serial mux
        assert split[fit]["over_base"] == pytest.approx(split[fit]["sim_s"] / split[fit]["base_sim_s"])
        assert split[fit]["over_base"] < 1
    assert "no `held` run" in rows["mux/sms:24"]["skipped"]
    assert "no repeat 0 of 'mux+most-turns'" in rows["mux+most-turns/split:24"]["skipped"]
    assert "| `mux/split:24` | `mux` | 1.00 / 1.00 / 1.00 / 1.00 |" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_verify_forwards_are_set_against_the_fit_by_positions_and_by_rows_with_no_prefill_beside(run):
    """A verify forward costs `measured / charged` of what the fit charges it (its rows and, at
    `decode_draft_s`, its drafted positions), of its positions charged as rows and of its rows alone;
    forwards inside a mux epoch's span, plain decode rows and prefill are left out; a run without
    drafting schedules has nothing to check."""
    from megatron_rollout.engine.records import StepRecord

    cost = sim_cost.CostModel(decode_base_s=1e-3, decode_row_s=1e-4, decode_context_s=1e-7, decode_draft_s=1e-5)

    def decode(start: float, rows: int, positions: int, context: int, seconds: float) -> StepRecord:
        return StepRecord("D", rows, context, 0, 0, 0, start, start + seconds, decode_positions=positions)

    records = [
        decode(0.0, 1, 5, 1000, 2 * (1e-3 + 5e-4 + 1e-4)),  # 1 row, 5 positions: twice its charge
        decode(1.0, 4, 20, 4000, 1e-3 + 20e-4 + 4e-4),  # 4 rows, 20 positions: exactly its charge
        decode(2.0, 3, 3, 3000, 1.0),  # no drafts: not a verify forward
        StepRecord("P", 0, 0, 1, 512, 0, 3.0, 3.1, epoch=1),  # epoch 1: 3.0 to 3.5
        decode(3.2, 2, 10, 2000, 1.0),  # beside epoch 1's prefill
        StepRecord("P", 0, 0, 0, 0, 0, 3.4, 3.5, epoch=1),
        StepRecord("P", 0, 0, 1, 512, 0, 4.0, 4.1),  # a whole prefill step: not decode
    ]
    assert [r.start for r in sim_replay.prefill_free(records)] == [0.0, 1.0, 2.0]
    checked = sim_replay.verify_costs(records, {"linear": cost, "experts": "a dense model has no expert term"})
    assert checked["forwards"] == 2
    assert checked["experts"] == {"skipped": "a dense model has no expert term"}
    one, few = checked["linear"]["1"], checked["linear"]["2-4"]
    assert one["n"] == 1 and one["over_positions"] == pytest.approx(2.0)
    assert one["over_rows"] == pytest.approx(2 * (1e-3 + 5e-4 + 1e-4) / (1e-3 + 1e-4 + 1e-4))
    assert few["n"] == 1 and few["over_positions"] == pytest.approx(1.0) and few["over_rows"] > 1
    assert one["over_charge"] == pytest.approx(2 * (1e-3 + 5e-4 + 1e-4) / (1e-3 + 1e-4 + 1e-4 + 4e-5))
    assert set(checked["linear"]) == {"1", "2-4"}
    out, result = run
    assert sim_replay.verify_check(result, load_trace(out / "trace.jsonl")) == {}
    assert sim_replay.main([str(out / "rollout.json"), "--verify-check", "--out", str(out / "verify.json")]) == 0
    assert json.loads((out / "verify.json").read_text())["verify_check"] == {}


@pytest.mark.timeout(120)
def test_a_mux_replay_splits_into_its_epochs_decode_outside_them_and_the_rest(run):
    """`epoch_split` counts overlapping epochs once, decode forwards outside every epoch apart, and
    the rest of the span; `epoch_check` gives the measured split and each fit's simulated one."""
    from megatron_rollout.engine.records import StepRecord

    def rec(phase: str, start: float, end: float, epoch: int | None = None, prefill: int = 0) -> StepRecord:
        return StepRecord(phase, 0 if phase == "P" else 2, 0 if phase == "P" else 100, int(prefill > 0), prefill,
                          0, start, end, epoch=epoch)

    records = [rec("D", 0.0, 1.0), rec("P", 1.5, 2.0, 1, 64), rec("D", 2.0, 2.5), rec("P", 2.5, 3.0, 1),
               rec("P", 2.8, 3.5, 2, 64), rec("D", 4.0, 4.5), rec("P", 5.0, 6.0, prefill=64)]
    split = sim_replay.epoch_split(records)
    assert split == pytest.approx({"span_s": 6.0, "epochs": 2, "in_epochs_s": 2.0, "decode_outside_s": 1.5,
                                   "rest_s": 2.5})
    out, result = run
    checked = sim_replay.epoch_check(result, load_trace(out / "trace.jsonl"))
    assert list(checked) == ["mux"]
    measured = checked["mux"]["measured"]
    records = from_columns(result["schedules"]["mux"]["repeats"][0]["steps"])
    assert measured["span_s"] == pytest.approx(max(r.end for r in records) - min(r.start for r in records))
    assert measured["epochs"] == len({r.epoch for r in records if r.epoch is not None}) > 0
    for name in sim_replay.FITS:
        part = checked["mux"][name]
        assert part["epochs"] > 0 and part["span_s"] > 0
        assert part["in_epochs_s"] + part["decode_outside_s"] + part["rest_s"] == pytest.approx(part["span_s"])
    assert sim_replay.main([str(out / "rollout.json"), "--epoch-check"]) == 0
    for name in sim_replay.FITS:
        charged = checked["mux"]["charged"][name]
        assert charged["span_s"] >= measured["in_epochs_s"] - 1e-9 and charged["prefill_charge_s"] > 0


def test_epochs_are_set_against_their_serial_charge():
    """`epoch_charge`: each epoch's span, to the end of the decode forward after its last segment
    (which holds that segment's device time), against its prefill alone plus the decode forwards in
    that span, as the model charges them (rows, and each drafted position at `decode_draft_s`); decode
    further out is not charged."""
    from megatron_rollout.engine.records import StepRecord
    from megatron_rollout.sim.cost import CostModel

    cost = CostModel(decode_base_s=0.5, decode_row_s=0.25, prefill_base_s=1.0, prefill_token_s=0.01,
                     decode_draft_s=0.05)
    records = [StepRecord("P", 0, 0, 1, 100, 0, 0.0, 0.1, epoch=1),
               StepRecord("D", 2, 50, 0, 0, 0, 0.1, 0.6, decode_positions=6),  # inside: 0.5 + 2 * 0.25 + 4 * 0.05
               StepRecord("P", 0, 0, 0, 100, 0, 0.6, 0.7, epoch=1),
               StepRecord("D", 1, 50, 0, 0, 0, 0.7, 1.5),  # the last segment's device time: 0.5 + 0.25
               StepRecord("D", 1, 50, 0, 0, 0, 2.0, 2.5),  # after the epoch: not charged to it
               StepRecord("P", 0, 0, 1, 10, 0, 3.0, 3.2, epoch=2)]  # no decode after it: its span is its own
    got = sim_replay.epoch_charge(records, cost)
    assert got["span_s"] == pytest.approx(1.5 + 0.2)
    assert got["prefill_charge_s"] == pytest.approx(1.0 + 200 * 0.01 + 1.0 + 10 * 0.01)
    assert got["decode_charge_s"] == pytest.approx(1.2 + 0.75)
    assert got["over_serial"] == pytest.approx(1.7 / (3.0 + 1.1 + 1.95))


@pytest.mark.timeout(60)
def test_fitted_in_sample_gives_the_schedules_engine_and_the_fit_the_report_uses(run):
    """What a what-if script starts from: the same simulation as the report's in-sample cell, and
    an error that names what is missing."""
    out, result = run
    trace = load_trace(out / "trace.jsonl")
    config, cost = sim_replay.fitted_in_sample(result, trace, "chunked", "experts")
    assert config.scheduler.max_batch_tokens == 64 and cost.expert_s >= 0 and cost.routing is not None
    cell = sim_replay.sim_replay(result, trace)["schedules"]["chunked"]["in_sample"]["experts"]
    assert simulate(trace, cost, config).makespan_s == pytest.approx(cell["sim_s"])
    with pytest.raises(SystemExit, match="no 'cubic' fit"):
        sim_replay.fitted_in_sample(result, trace, "chunked", "cubic")
    with pytest.raises(SystemExit, match="no repeat 0 of 'mux@budget:9'"):
        sim_replay.fitted_in_sample(result, trace, "mux@budget:9")
