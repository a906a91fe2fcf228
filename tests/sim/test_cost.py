"""The cost model: fitted from records made by a known model, it gives that model back."""
import dataclasses

import pytest

from megatron_rollout.engine.records import StepRecord
from megatron_rollout.sim.cost import (
    CostModel,
    Routing,
    StepSize,
    fit,
    observations,
    segments_per_epoch,
    startup_token_s,
    turn_cost,
)

TRUE = CostModel(decode_base_s=0.004, decode_row_s=0.0002, decode_context_s=1e-7, prefill_base_s=0.01,
                 prefill_row_s=0.0005, prefill_token_s=3e-5, prefill_pair_s=2e-9)


def records(cost: CostModel, sizes, gap=0.001, epoch_of=lambda i: None):
    out, t = [], 0.0
    for i, s in enumerate(sizes):
        d = cost.step_s(s)
        out.append(StepRecord("P" if s.prefill_tokens else "D", s.decode_rows, s.decode_context, s.prefill_rows,
                              s.prefill_tokens, s.prefill_pairs, t, t + d, epoch_of(i),
                              decode_positions=s.decode_rows + s.decode_drafts if s.decode_drafts else None))
        t += d + gap
    return out


def sizes():
    out = []
    for i in range(1, 40):
        rows = 1 + (i * 7) % 33
        out.append(StepSize(decode_rows=rows, decode_context=rows * (100 + 37 * i)))
        tokens = 16 + (i * 53) % 700
        out.append(StepSize(prefill_rows=1 + i % 3, prefill_tokens=tokens, prefill_pairs=tokens * (50 + 90 * i)))
        if i % 4 == 0:  # a chunked step: both
            out.append(StepSize(rows, rows * 300, 1, 100 + i, (100 + i) * 400))
    return out


def test_fit_recovers_the_model_that_made_the_records():
    fitted = fit(records(TRUE, sizes()))
    for name in ("decode_base_s", "decode_row_s", "decode_context_s", "prefill_base_s", "prefill_row_s",
                 "prefill_token_s", "prefill_pair_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-4, abs=1e-12), name
    assert fitted.gap_s == pytest.approx(0.001)
    assert fitted.mux_segments == 1.0


def test_drafted_positions_are_their_own_term_and_free_where_no_record_drafted():
    """A drafting row is one row over one context plus its drafted positions: fitted from records with
    drafts, `decode_draft_s` comes back; from records without, it is 0, and a drafted forward is
    charged its rows and, with the expert term, the experts its drafts add."""
    true = dataclasses.replace(TRUE, decode_draft_s=3e-5)
    drafted = [dataclasses.replace(s, decode_drafts=(i % 8) * s.decode_rows)
               for i, s in enumerate(sizes()) if s.decode_rows and not s.prefill_tokens]
    recs = records(true, sizes() + drafted)
    assert StepSize.of(recs[-1]) == drafted[-1]
    assert fit(recs).decode_draft_s == pytest.approx(3e-5, rel=1e-4)
    plain = fit(records(TRUE, sizes()))
    assert plain.decode_draft_s == 0.0
    row = StepSize(decode_rows=16, decode_context=16_000)
    assert plain.step_s(dataclasses.replace(row, decode_drafts=7 * 16)) == plain.step_s(row)
    routing = Routing(128, 8)
    experts = dataclasses.replace(plain, expert_s=1e-5, routing=routing)
    added = experts.step_s(dataclasses.replace(row, decode_drafts=7 * 16)) - experts.step_s(row)
    assert added == pytest.approx(1e-5 * (routing.touched(16 * 8) - routing.touched(16)))


def test_a_mux_epoch_is_one_observation_over_its_segments():
    s = [StepSize(prefill_rows=2, prefill_tokens=50, prefill_pairs=900), StepSize(), StepSize(),
         StepSize(decode_rows=3, decode_context=30)]
    recs = records(TRUE, s, epoch_of=lambda i: 1 if i < 3 else None)
    obs = observations(recs)
    assert [o[0] for o in obs] == [s[3], s[0]]
    assert obs[1][1] == pytest.approx(sum(r.duration for r in recs[:3]))
    segmented = records(TRUE, sizes() + s, epoch_of=lambda i: 7 if i >= len(sizes()) and i < len(sizes()) + 3 else None)
    assert fit(segmented).mux_segments == 3.0


def test_refusals():
    with pytest.raises(ValueError, match="needs decode-only and prefill forwards"):
        fit(records(TRUE, [StepSize(prefill_rows=1, prefill_tokens=5, prefill_pairs=15)]))
    with pytest.raises(ValueError, match=r"CostModel.decode_row_s must be a finite number >= 0, got -1"):
        CostModel(decode_row_s=-1)
    with pytest.raises(ValueError, match="mux_segments must be >= 1"):
        CostModel(mux_segments=0.5)


ROUTING = Routing(num_experts=64, top_k=4)
MOE = dataclasses.replace(TRUE, decode_row_s=0.0, expert_s=5e-5, routing=ROUTING)


def test_routing_counts_expected_distinct_experts():
    assert ROUTING.touched(0) == 0.0
    assert ROUTING.touched(1) == pytest.approx(4.0)  # one token: its top_k
    assert ROUTING.touched(2) == pytest.approx(64 * (1 - (60 / 64) ** 2))
    assert ROUTING.touched(10_000) == pytest.approx(64.0)
    with pytest.raises(ValueError, match=r"top_k \(9\) must be at most num_experts \(8\)"):
        Routing(8, 9)


def test_the_expert_term_is_fitted_when_asked_for():
    recs = records(MOE, sizes())
    fitted = fit(recs, num_experts=64, top_k=4)
    assert fitted.routing == ROUTING
    for name in ("decode_base_s", "decode_row_s", "decode_context_s", "prefill_base_s", "prefill_row_s",
                 "prefill_token_s", "prefill_pair_s", "expert_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(MOE, name), rel=1e-3, abs=1e-10), name
    # a decode step pays it, a prefill-only one does not; a mixed one counts all its tokens
    assert MOE.step_s(StepSize(decode_rows=1)) == pytest.approx(0.004 + 5e-5 * 4)
    assert MOE.step_s(StepSize(prefill_rows=1, prefill_tokens=1)) == pytest.approx(0.01 + 0.0005 + 3e-5)
    mixed = StepSize(decode_rows=2, prefill_rows=1, prefill_tokens=3)
    assert MOE.step_s(mixed) == pytest.approx(0.004 + 0.01 + 0.0005 + 9e-5 + 5e-5 * ROUTING.touched(5))


def test_the_expert_term_is_used_only_when_asked_for():
    recs = records(MOE, sizes())
    linear = fit(recs)
    assert linear.routing is None and linear.expert_s == 0.0
    assert linear.step_s(StepSize(decode_rows=3)) == pytest.approx(linear.decode_base_s + 3 * linear.decode_row_s)
    with pytest.raises(ValueError, match="needs both num_experts and top_k"):
        fit(recs, num_experts=64)
    with pytest.raises(ValueError, match="expert_s is 0.1 but routing is None"):
        CostModel(expert_s=0.1)
    assert segments_per_epoch(recs) == 1.0


def test_the_start_up_is_spread_over_the_tokens_submitted_before_the_first_forward():
    assert startup_token_s(0.25, 50_000) == pytest.approx(5e-6)
    assert startup_token_s(0.25, 0) == 0.0  # nothing was submitted: nothing to charge it to
    assert startup_token_s(-1e-4, 10) == 0.0  # clocks a hair apart: no saving
    with pytest.raises(ValueError, match="first_forward_s must be finite"):
        startup_token_s(float("nan"), 10)
    with pytest.raises(ValueError, match="tokens must be an int >= 0"):
        startup_token_s(0.1, -1)
    with pytest.raises(ValueError, match="CostModel.submit_token_s must be a finite number >= 0"):
        CostModel(submit_token_s=-1e-6)


def test_submissions_marked_between_forwards_come_out_of_the_gap_and_are_charged_per_token():
    recs = records(TRUE, sizes())
    marks = []  # a turn of 1,000 tokens submitted in every fifth gap, 2 us a token
    for i in range(0, len(recs) - 1, 5):
        later = 0.002
        recs[i + 1:] = [dataclasses.replace(r, start=r.start + later, end=r.end + later) for r in recs[i + 1:]]
        marks.append((recs[i].end + 0.0004, recs[i].end + 0.0004 + later, 1000))
    assert fit(recs).gap_s > 0.0013  # unmarked, the submissions swell the gaps
    fitted = fit(recs, submissions=marks)
    assert fitted.gap_s == pytest.approx(0.001)
    assert fitted.turn_token_s == pytest.approx(2e-6) == turn_cost(marks)
    assert fitted.decode_base_s == pytest.approx(TRUE.decode_base_s, rel=1e-4)
    assert turn_cost([]) == 0.0 and fit(recs).turn_token_s == 0.0


def test_with_the_replays_sleeps_every_gap_less_them_is_host_time():
    recs = records(TRUE, sizes())
    # one 3 ms gap of host work, and a 50 ms sleep in every seventh gap (nothing to run)
    recs[3:] = [dataclasses.replace(r, start=r.start + 0.002, end=r.end + 0.002) for r in recs[3:]]
    idle = []
    for i in range(0, len(recs) - 1, 7):
        recs[i + 1:] = [dataclasses.replace(r, start=r.start + 0.05, end=r.end + 0.05) for r in recs[i + 1:]]
        idle.append((recs[i].end + 0.0005, recs[i].end + 0.0505))
    n = len(recs) - 1
    assert fit(recs, sleeps=idle).gap_s == pytest.approx((0.001 * n + 0.002) / n)
    unmarked = fit(recs).gap_s  # the sleeps' gaps are long enough to be left out by their length
    assert unmarked == pytest.approx((0.001 * (n - len(idle)) + 0.002) / (n - len(idle)))
