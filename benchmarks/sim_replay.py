"""`python -m benchmarks.sim_replay RESULT.json [--out X.json]`: the simulator against the replays of
one `benchmarks.rollout` run, its cost model fitted to those replays' own step records.

`benchmarks.rollout` keeps each timed replay's step records (`steps`), the model's routing (`moe`),
the KV blocks and the trace (`trace.jsonl` beside the JSON). Per schedule, for the linear fit and
the experts fit (`sim.cost`, the expert term on the model's routing; dense models: linear only):

- in-sample: a cost model fitted to the schedule's repeat-0 records, the schedule simulated on the
  trace (`sim.simulator`, its budget, block size, decode rows, KV blocks and priority), against
  repeat 0's measured makespan;
- out-of-sample: one cost model fitted to the repeat-0 records of `off` and `chunked` pooled (a
  forward costs the same under every schedule), each schedule simulated, against the median
  makespan of its later repeats (`--fit-from OTHER.json`: those of another run on the same model
  and device, for a run that measured neither).

Each fit also charges the replay's start-up: the host's time from its start to its first forward,
while the conversations' first turns are submitted, per input token of those turns
(`submit_cost`; `CostModel.submit_token_s`). No record covers it. Where the result marks each turn's
submission (`submissions`, kept since 2026-12-05), the later turns are charged too, at the rate the
marks measured (`CostModel.turn_token_s`), and their time comes out of the host gap; where it marks
the replay's sleeps (`sleeps`), what is left of each gap is host time, and no gap is taken for idle
by its length.

Errors are simulated / measured - 1. How a `mux` schedule cuts its epochs is its segment policy's,
not a cost: out of sample it takes its repeat 0's segments per epoch (`cost.segments_per_epoch`,
completion polls left out: `without_polls`).
A drafting schedule (`~ngram:K[:R][+T@W]`) is simulated with the simulator's `Speculation` lever
while at most R rows decode, drafting for every row the share of its most (K, or T while at most W
rows decode) that repeat 0 drafted on the whole (n-gram lookup drafts only where it finds a match:
rounded, at least 1) and accepting as many tokens as repeat 0 accepted. In sample its verify
forwards are fitted by their positions (`StepRecord.decode_positions`, a row and its drafts), the
unit the lever costs them in; records made before that field hold one row a request, and their
in-sample check is skipped. Other drafters (an MTP layer's own forward) and `streak_k` (a row's draft
length by its own verdicts) are not simulated. Decode
ahead (`/sync` or not) is not modelled: both run the same simulation.
A `mux` schedule with SMs held back from prefill (`/sms:N`, `/split:N`) is simulated with the
`Overlap` lever, its factors from a `benchmarks.pd_overlap` run of the same shape (`held`; `driver`
for a split) at a split that holds N back (`--overlap-from PD.json`), out of sample only: its own
decode records ran beside prefill, so a fit to them would count the slow-down twice. Without such
a measurement it is skipped.

Left out: the mux segment policies' other effects (a segment's own launch gap), which rows share
a prefix, and any sampling noise of repeat 0 itself (one replay's records are the whole fit).

`--verify-check` tells apart one part of a drafting schedule's out-of-sample error: its verify
forwards that ran with no prefill epoch around them (`prefill_free`), measured against what each
out-of-sample fit charges them, by their positions (the `Speculation` lever's unit) and by their
rows alone, per decode-row bucket (`verify_check`). `--epoch-check` splits each `mux` schedule's
makespan, measured (repeat 0) and simulated out of sample, into the time its epochs were in flight,
its decode forwards outside them and the rest (`epoch_check`), and sets the measured epochs against
each fit's serial charge for them (`epoch_charge`: under 1, prefill ran beside the decode forwards).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import orderings_table, segments, what_if_table
from benchmarks.specs import engine_config, split_spec, unpartitioned
from megatron_rollout.engine import Schedule
from megatron_rollout.engine.records import StepRecord
from megatron_rollout.sim.cost import CostModel, StepSize, fit, segments_per_epoch, startup_token_s
from megatron_rollout.sim.levers import Levers, Overlap, Speculation
from megatron_rollout.sim.policy import POLICIES, make_policy
from megatron_rollout.sim.simulator import SimConfig, SimulationError, simulate
from megatron_rollout.trace.schema import TraceRequest, group_conversations, load_trace
from megatron_rollout.trace.steps import SLEEP_COLUMNS, SUBMISSION_COLUMNS, from_columns, marks_from_columns

log = logging.getLogger("benchmarks.sim_replay")

POOLED = ("off", "chunked")
"""The schedules whose repeat-0 records make the out-of-sample fit: whole forwards only (a `mux`
prefill segment's device time lands in the decode iteration after it, `engine.records`)."""
FITS = ("linear", "experts")
ROW_BUCKETS = ((1, 1), (2, 4), (5, 31), (32, None))
"""Decode rows per forward, inclusive bounds (None: no upper bound)."""
POLL_S = 50e-6
"""A `mux` record that follows another of its epoch with no decode record between them, has no
tokens and took under this much host time, is a completion poll in a round that ran no decode: not
a round the simulator should cut the epoch at. The engine records none since commit `d85a928`
(`MuxSchedule._record_segment`), but older results hold hundreds in the epochs that ran with no
decode row (a poll takes ~10 us of host time; a segment's enqueue 100 us or more). A poll in a
round with decode rows is kept: that round ran a decode iteration, as the simulated rounds do."""


def without_polls(records: Sequence[StepRecord]) -> list[StepRecord]:
    """`records` less the completion polls of older results in rounds without decode (`POLL_S`)."""
    kept: list[StepRecord] = []
    for r in records:
        last = kept[-1] if kept else None
        if (r.epoch is not None and last is not None and last.epoch == r.epoch and r.prefill_tokens == 0
                and r.duration < POLL_S):
            continue
        kept.append(r)
    return kept


def _first(entry: dict) -> dict | None:
    """Repeat 0, when it finished with step records."""
    first = next((r for r in entry.get("repeats", []) if r.get("repeat") == 0), None)
    return first if first and first.get("finished") and first.get("steps") else None


def first_forward_s(repeat: dict) -> float:
    """Seconds from a replay's start to its first forward: from `replay_start` (the records' clock)
    where the result has it, else its makespan less the span of its records (older results: the last
    turn finishes as the last forward's samples come back)."""
    records = from_columns(repeat["steps"])
    first = min(r.start for r in records)
    if repeat.get("replay_start") is not None:
        return first - repeat["replay_start"]
    return repeat["report"]["makespan_s"] - (max(r.end for r in records) - first)


def submit_cost(repeat: dict, trace: Sequence[TraceRequest]) -> float:
    """`CostModel.submit_token_s` of a replay: its start-up over the input tokens of the conversations'
    first turns released by its first forward (`sim.cost.startup_token_s`)."""
    seconds = first_forward_s(repeat)
    released = sum(turns[0].input_tokens for turns in group_conversations(trace).values()
                   if turns[0].wait_ms / 1e3 <= seconds)
    return startup_token_s(seconds, released)


def submissions(repeat: dict) -> list[tuple[float, float, int]]:
    """A replay's turn submissions as (start, end, input tokens), where its result marks them (none
    before benchmarks.rollout kept them)."""
    return marks_from_columns(repeat.get("submissions") or {}, SUBMISSION_COLUMNS)


def sleeps(repeat: dict) -> list[tuple[float, float]] | None:
    """The spans a replay slept with nothing to run, where its result marks them (None before
    benchmarks.rollout kept them: the fit then tells idle gaps by their length)."""
    marks = repeat.get("sleeps")
    return None if marks is None else marks_from_columns(marks, SLEEP_COLUMNS)


def _fits(records: Sequence[StepRecord], moe: dict | None, submit_token_s: float = 0.0,
          marks: Sequence[tuple[float, float, int]] = (),
          idle: Sequence[tuple[float, float]] | None = None) -> dict[str, CostModel | str]:
    """Each of `FITS` fitted to `records`, the submissions' `marks` and the `idle` sleeps, with the
    start-up's `submit_token_s`, or why not."""
    out: dict[str, CostModel | str] = {}
    for name in FITS:
        if name == "experts" and not moe:
            out[name] = "a dense model has no expert term"
            continue
        try:
            cost = fit(records, **(moe if name == "experts" else {}), submissions=marks, sleeps=idle)
        except ValueError as exc:
            out[name] = str(exc)
            continue
        out[name] = dataclasses.replace(cost, submit_token_s=submit_token_s)
    return out


def _segmented(cost: CostModel, segments: float | None) -> CostModel:
    """`cost` with a `mux` schedule's own segments per epoch (`_mux_segments`; None: as it is)."""
    return cost if segments is None else dataclasses.replace(cost, mux_segments=segments)


def _compare(trace: Sequence[TraceRequest], fits: dict[str, CostModel | str], config: SimConfig,
             measured_s: float, mux_segments: float | None = None) -> dict[str, Any]:
    """Each fit's simulated makespan and error against `measured_s` (or why it has none)."""
    out: dict[str, Any] = {"measured_s": measured_s}
    for name, cost in fits.items():
        if isinstance(cost, str):
            out[name] = {"skipped": cost}
            continue
        try:
            sim_s = simulate(trace, _segmented(cost, mux_segments), config).makespan_s
        except SimulationError as exc:
            out[name] = {"skipped": f"simulation failed: {exc}"}
            continue
        out[name] = {"sim_s": sim_s, "error": sim_s / measured_s - 1}
    return out


PARTITION_METHODS = {"held": "held", "split": "driver"}
"""`RunnerConfig.partition` -> the `benchmarks.pd_overlap` method that measures its shape."""


def measured_overlaps(pd_overlap: dict) -> dict[tuple[str, int], Overlap]:
    """The `Overlap` that a `benchmarks.pd_overlap` result measured for each partition shape and
    held-back SM count, keyed by (`RunnerConfig.partition`, the count its split asked for)."""
    out = {}
    for partition, method in PARTITION_METHODS.items():
        for run in pd_overlap.get("runs", []):
            if run.get("method") == method and "error" not in run and run.get("split"):
                held = int(run["split"].split("/")[1])
                # D alone on its partition: "split" only ("held" leaves D every SM)
                alone = run.get("decode_partition_factor", 1.0) if partition == "split" else 1.0
                out[(partition, held)] = Overlap(max(1.0, run["decode_factor"]), max(1.0, run["prefill_factor"]),
                                                 max(1.0, run.get("prefill_partition_factor", 1.0)), max(1.0, alone))
    return out


def _sim_config(result: dict, spec: str, budget: int, first: dict,
                overlaps: dict[tuple[str, int], Overlap] | None = None) -> SimConfig | str:
    """The simulated twin of the schedule's engine, or why the simulator cannot represent it."""
    parts = split_spec(spec)
    drafts, args = parts.speculative, result["args"]
    engine = engine_config(argparse.Namespace(**args), result["num_blocks"], result["max_model_len"], parts, budget)
    levers = Levers()
    if parts.decode_sms:
        overlap = (overlaps or {}).get((parts.partition, parts.decode_sms))
        if overlap is None:
            return (f"{parts.decode_sms} SMs held back from prefill ({parts.partition}): no "
                    f"`{PARTITION_METHODS[parts.partition]}` run of benchmarks.pd_overlap at that count "
                    f"(--overlap-from) gives the simulator's Overlap factors")
        levers = Levers(overlap=overlap)
    if drafts is not None:
        if drafts.method != "ngram":
            return f"drafting by {drafts.method!r}: the drafter's own forward is not modelled"
        if drafts.streak_k is not None:
            return "streak_k: a row's draft length by its own last verdict is not modelled"
        max_rows = drafts.tail_rows or args["max_decode_rows"]
        steps = [r.decode_rows for r in from_columns(first["steps"]) if 0 < r.decode_rows <= max_rows]
        stats = first["engine_stats"]
        # every row drafts the same share of its most (lookup finds no match for the rest)
        most = sum(drafts.k_at(n) * n for n in steps)
        share = stats["drafted_tokens"] / most if most else 1.0
        drafting = Speculation(max_rows, min(drafts.k, max(1, round(share * drafts.k))), 0.0,
                               tail_tokens=None if drafts.tail_k is None else
                               min(drafts.tail_k, max(1, round(share * drafts.tail_k))), tail_rows=drafts.tail_k_rows)
        drafted = sum(drafting.tokens_at(n) * n for n in steps)
        acceptance = min(1.0, stats["accepted_tokens"] / drafted) if drafted else 0.0
        levers = dataclasses.replace(levers, speculation=dataclasses.replace(drafting, acceptance=acceptance))
    return dataclasses.replace(SimConfig.of_engine(engine), levers=levers)


def _mux_segments(config: SimConfig, first: dict) -> float | None:
    """A `mux` schedule's segments per epoch in its repeat 0 (its segment policy's, not a cost:
    module docstring); None for the other schedules."""
    if config.scheduler.schedule is not Schedule.MUX:
        return None
    return segments_per_epoch(without_polls(from_columns(first["steps"])))


def _own_fits(result: dict, trace: Sequence[TraceRequest], first: dict, config: SimConfig
              ) -> dict[str, CostModel | str] | str:
    """The in-sample cost models: fitted to the schedule's repeat 0 (`first`) alone, or why they
    cannot be."""
    if config.levers.overlap is not None:
        return ("its decode records ran beside prefill on the held-back SMs: fitted to them, the overlap "
                "lever would count the slow-down twice")
    records = from_columns(first["steps"])
    if config.levers.speculation is not None and any(r.decode_positions is None for r in records if r.decode_rows):
        return ("drafting: these records predate `decode_positions`, so a verify forward reads as one row a "
                "request (module docstring)")
    return _fits(records, result.get("moe"), submit_cost(first, trace), submissions(first), sleeps(first))


def fitted_in_sample(result: dict, trace: Sequence[TraceRequest], schedule: str, fit: str = "linear"
                     ) -> tuple[SimConfig, CostModel]:
    """The simulated engine of one schedule of the run and its in-sample cost model (`fit`: 'linear'
    or 'experts'), fitted to its repeat 0: what a what-if on that schedule starts from."""
    entry = result.get("schedules", {}).get(schedule)
    first = _first(entry) if entry else None
    if first is None:
        raise SystemExit(f"the run has no repeat 0 of {schedule!r} with step records")
    config = _sim_config(result, entry["spec"], entry["budget"], first)
    fits = config if isinstance(config, str) else _own_fits(result, trace, first, config)
    cost = fits if isinstance(fits, str) else fits.get(fit)
    if not isinstance(cost, CostModel):  # why it cannot be fitted, or a fit that does not exist
        raise SystemExit(f"{schedule}: {cost or f'no {fit!r} fit: one of {FITS}'}")
    return config, cost


def _pooled_fits(result: dict, trace: Sequence[TraceRequest], fit_from: dict | None) -> dict[str, CostModel | str]:
    """The out-of-sample cost models: fitted to repeat 0 of `off` and `chunked` pooled, of the run or
    of `fit_from` (same model and device, the same trace), their start-ups averaged."""
    if "num_blocks" not in result:
        raise SystemExit("the result has no 'num_blocks': it predates step records; run benchmarks.rollout again")
    source = result if fit_from is None else fit_from
    for key in ("model", "device") if fit_from is not None else ():
        if fit_from.get(key) != result.get(key):
            raise SystemExit(f"--fit-from: its {key} is {fit_from.get(key)!r}, the result's {result.get(key)!r}")
    firsts = [first for name in POOLED if name in source.get("schedules", {})
              and (first := _first(source["schedules"][name]))]
    if not firsts:
        return {n: f"no repeat 0 with step records of {POOLED}" for n in FITS}
    slept = [sleeps(first) for first in firsts]
    replays = sorted((from_columns(first["steps"]) for first in firsts), key=lambda recs: min(r.start for r in recs))
    # between two pooled replays nothing of theirs runs: idle, as their sleeps are
    between = [(max(r.end for r in a), min(r.start for r in b)) for a, b in zip(replays, replays[1:])]
    return _fits([rec for recs in replays for rec in recs], result.get("moe"),
                 statistics.fmean(submit_cost(first, trace) for first in firsts),
                 [mark for first in firsts for mark in submissions(first)],
                 None if None in slept else [span for spans in slept for span in spans] + between)


def what_if(result: dict, trace: Sequence[TraceRequest], specs: Sequence[str], fit_from: dict | None = None,
            overlap_from: dict | None = None) -> dict[str, Any]:
    """Schedules the run did not measure, simulated on the out-of-sample fit beside the schedule
    they extend: each spec less its '/sms:N' or '/split:N' suffix (its base) must be a schedule of
    the run, whose repeat 0 gives the segments per epoch and the drafting statistics; the overlap
    factors come from `overlap_from` (`measured_overlaps`). `over_base` is the prediction: the
    spec's simulated makespan over its base's, both simulated the same way."""
    fits, overlaps = _pooled_fits(result, trace, fit_from), measured_overlaps(overlap_from) if overlap_from else {}
    out: dict[str, Any] = {}
    for spec in specs:
        base = unpartitioned(spec)
        entry = result.get("schedules", {}).get(base)
        first = _first(entry) if entry else None
        if first is None:
            out[spec] = {"of": base, "skipped": f"the run has no repeat 0 of {base!r} with step records"}
            continue
        configs = [_sim_config(result, s, entry["budget"], first, overlaps) for s in (spec, base)]
        reason = next((c for c in configs if isinstance(c, str)), None)
        if reason is not None:
            out[spec] = {"of": base, "skipped": reason}
            continue
        segments = _mux_segments(configs[1], first)
        row: dict[str, Any] = {"of": base, "overlap": dataclasses.asdict(configs[0].levers.overlap)
                               if configs[0].levers.overlap else None}
        for name, cost in fits.items():
            if isinstance(cost, str):
                row[name] = {"skipped": cost}
                continue
            sim_s, base_s = (simulate(trace, _segmented(cost, segments), c).makespan_s for c in configs)
            row[name] = {"sim_s": sim_s, "base_sim_s": base_s, "over_base": sim_s / base_s}
        out[spec] = row
    return out


def segment_sweep(result: dict, trace: Sequence[TraceRequest], counts: Sequence[float],
                  fit_from: dict | None = None) -> dict[str, Any]:
    """The run's `mux` simulated with each count of P segments per epoch, beside its `off`, on the
    linear out-of-sample fit: makespan, mean TTFT and mean queueing of each, and mux's over off's.
    On one stream a segment only moves P's work behind a decode iteration, so it shows what the
    segments cost in TTFT and what they give in makespan; the run's own count is `measured_segments`."""
    cost = _pooled_fits(result, trace, fit_from)["linear"]
    if isinstance(cost, str):
        raise SystemExit(f"--mux-segments: no linear fit ({cost})")
    entries = result.get("schedules", {})
    firsts = {n: _first(entries.get(n) or {}) for n in ("off", "mux")}
    missing = [n for n, first in firsts.items() if first is None]
    if missing:
        raise SystemExit(f"--mux-segments needs a repeat 0 with step records of off and mux; missing: {missing}")
    configs = {n: _sim_config(result, entries[n]["spec"], entries[n]["budget"], first) for n, first in firsts.items()}

    def run(name: str, segments: float | None) -> dict[str, float]:
        sim = simulate(trace, _segmented(cost, segments), configs[name])
        return {"makespan_s": sim.makespan_s, "mean_ttft_s": statistics.mean(r.first_token - r.arrival
                                                                          for r in sim.requests),
                "mean_queue_s": statistics.mean(r.admitted - r.arrival for r in sim.requests)}

    off = run("off", None)
    rows = []
    for n in counts:
        row = {"segments": n, **run("mux", n)}
        rows.append({**row, "makespan_over_off": row["makespan_s"] / off["makespan_s"],
                     "ttft_over_off": row["mean_ttft_s"] / off["mean_ttft_s"]})
    measured = _mux_segments(configs["mux"], firsts["mux"])
    return {"fit": "linear, out of sample", "off": off, "measured_segments": measured, "mux": rows}


def orderings(result: dict, trace: Sequence[TraceRequest], fit_from: dict | None = None,
              names: Sequence[str] = tuple(POLICIES), parts: Sequence[str] = ("in_sample", "out_of_sample")
              ) -> dict[str, Any]:
    """Each schedule of the run simulated under every ordering the simulator knows (the engine's
    priorities and the oracle, `sim.policy.POLICIES`; or `names`, FIFO among them) on the linear
    fits, in sample (its repeat 0's records) and out of sample (`off` and `chunked` pooled; or the
    `parts` named): makespan, and over the same fit's simulation in arrival order (FIFO). The
    measured makespans are the run's, under its own ordering."""
    if "fifo" not in names:
        raise ValueError(f"orderings are given over FIFO's: names must include 'fifo', got {list(names)}")
    pooled = _pooled_fits(result, trace, fit_from)["linear"] if "out_of_sample" in parts else None
    out: dict[str, Any] = {}
    for label, entry in result.get("schedules", {}).items():
        first = _first(entry)
        config = _sim_config(result, entry["spec"], entry["budget"], first) if first else "no repeat 0 with records"
        if isinstance(config, str):
            out[label] = {"skipped": config}
            continue
        fits: dict[str, CostModel | str] = {"out_of_sample": pooled} if "out_of_sample" in parts else {}
        if "in_sample" in parts:
            own = _own_fits(result, trace, first, config)
            fits["in_sample"] = own if isinstance(own, str) else own["linear"]
        segments = _mux_segments(config, first)
        row: dict[str, Any] = {"priority": config.scheduler.priority}
        for part, cost in fits.items():
            if isinstance(cost, str):
                row[part] = {"skipped": cost}
                continue
            if part == "out_of_sample":  # as the errors' check does (`sim_replay`)
                cost = _segmented(cost, segments)
            made = {name: simulate(trace, cost, config, make_policy(name)).makespan_s for name in names}
            row[part] = {name: {"sim_s": v, "over_fifo": v / made["fifo"]} for name, v in made.items()}
        out[label] = row
    return out


def sim_replay(result: dict, trace: Sequence[TraceRequest], fit_from: dict | None = None,
               overlap_from: dict | None = None) -> dict[str, Any]:
    """In- and out-of-sample errors of every schedule of a `benchmarks.rollout` result (module docstring).
    `fit_from`: another run's result whose `off` and `chunked` make the out-of-sample fit (same model and
    device), to check schedules that a run measured without those two. `overlap_from`: a
    `benchmarks.pd_overlap` result whose `held` and `driver` runs give the '/sms:N' and '/split:N'
    schedules' overlap factors."""
    overlaps = measured_overlaps(overlap_from) if overlap_from else {}
    moe, schedules = result.get("moe"), result.get("schedules", {})
    pooled_fits = _pooled_fits(result, trace, fit_from)
    out: dict[str, Any] = {
        "model": result.get("model"), "profile": result.get("profile"), "device": result.get("device"),
        "trace": result.get("trace"), "num_blocks": result["num_blocks"], "moe": moe,
        "pooled": {n: c if isinstance(c, str) else c.to_dict() for n, c in pooled_fits.items()}, "schedules": {}}
    for label, entry in schedules.items():
        spec, budget = entry["spec"], entry["budget"]
        row: dict[str, Any] = {"spec": spec, "budget": budget}
        out["schedules"][label] = row
        first = _first(entry)
        if first is None:
            row["in_sample"] = row["out_of_sample"] = {"skipped": "repeat 0 did not finish or kept no step records"}
            continue
        config = _sim_config(result, spec, budget, first, overlaps)
        if isinstance(config, str):
            row["in_sample"] = row["out_of_sample"] = {"skipped": config}
            continue
        if config.levers.speculation is not None:
            row["speculation"] = {**dataclasses.asdict(config.levers.speculation),
                                  **{k: first["engine_stats"][k] for k in ("drafted_tokens", "accepted_tokens")}}
        if config.levers.overlap is not None:
            row["overlap"] = dataclasses.asdict(config.levers.overlap)
        fits = _own_fits(result, trace, first, config)
        if isinstance(fits, str):
            row["in_sample"] = {"skipped": fits}
        else:
            row["in_sample"] = _compare(trace, fits, config, first["report"]["makespan_s"])
            row["in_sample"]["cost"] = {n: c if isinstance(c, str) else c.to_dict() for n, c in fits.items()}
        later = [r["report"]["makespan_s"] for r in entry["repeats"] if r.get("repeat", 0) > 0 and r.get("finished")]
        if not later:
            row["out_of_sample"] = {"skipped": "no finished repeat after repeat 0"}
            continue
        row["out_of_sample"] = _compare(trace, pooled_fits, config, statistics.median(later),
                                        _mux_segments(config, first))
        row["out_of_sample"]["repeats"] = len(later)
    return out


def bucket_name(lo: int, hi: int | None) -> str:
    """A `ROW_BUCKETS` bucket as its tables name it: '1', '2-4', '32+'."""
    return f"{lo}" if lo == hi else f"{lo}+" if hi is None else f"{lo}-{hi}"


def in_bucket(rows: int, lo: int, hi: int | None) -> bool:
    """`rows` decode rows fall in the `ROW_BUCKETS` bucket (lo, hi)."""
    return lo <= rows and (hi is None or rows <= hi)


def prefill_free(records: Sequence[StepRecord]) -> list[StepRecord]:
    """The decode-only records that no `mux` epoch overlaps (an epoch: from its first record's start
    to its last one's end), so no prefill ran beside them."""
    spans = epoch_spans(records).values()
    return [r for r in records if r.phase == "D" and not r.prefill_tokens
            and all(r.end <= lo or r.start >= hi for lo, hi in spans)]


def verify_costs(records: Sequence[StepRecord], fits: dict[str, CostModel | str]) -> dict[str, Any]:
    """Per fit and decode-row bucket, the measured time of the verify forwards among `records` (decode
    records with drafted positions and no prefill beside them) over what the fit charges them
    (`over_charge`: their rows, `decode_draft_s` per drafted position and the experts those add), over
    a charge of each position as a row (`over_positions`, the rule before `decode_draft_s`) and over
    their rows alone (`over_rows`). Above 1 the fit charges them too little."""
    verify = [r for r in prefill_free(records) if r.decode_positions and r.decode_positions > r.decode_rows]
    out: dict[str, Any] = {"forwards": len(verify)}
    for name, cost in fits.items():
        if isinstance(cost, str):
            out[name] = {"skipped": cost}
            continue
        out[name] = {}
        for lo, hi in ROW_BUCKETS:
            picked = [r for r in verify if in_bucket(r.decode_rows, lo, hi)]
            if not picked:
                continue
            measured = sum(r.duration for r in picked)
            by_positions = sum(cost.step_s(StepSize(r.decode_positions, r.decode_context)) for r in picked)
            by_rows = sum(cost.step_s(StepSize(r.decode_rows, r.decode_context)) for r in picked)
            charged = sum(cost.step_s(StepSize.of(r)) for r in picked)
            out[name][bucket_name(lo, hi)] = {"n": len(picked), "measured_s": measured,
                                              "over_charge": measured / charged,
                                              "over_positions": measured / by_positions,
                                              "over_rows": measured / by_rows}
    return out


def verify_check(result: dict, trace: Sequence[TraceRequest], fit_from: dict | None = None) -> dict[str, Any]:
    """`verify_costs` of each drafting schedule's repeat 0 on the out-of-sample fits (module docstring)."""
    pooled = _pooled_fits(result, trace, fit_from)
    out: dict[str, Any] = {}
    for label, entry in result.get("schedules", {}).items():
        if split_spec(entry["spec"]).speculative is None:
            continue
        first = _first(entry)
        out[label] = {"skipped": "repeat 0 did not finish or kept no step records"} if first is None \
            else verify_costs(from_columns(first["steps"]), pooled)
    return out


def epoch_spans(records: Sequence[StepRecord]) -> dict[int, tuple[float, float]]:
    """Each `mux` epoch's span: from its first record's start to its last one's end."""
    spans: dict[int, tuple[float, float]] = {}
    for r in records:
        if r.epoch is not None:
            lo, hi = spans.get(r.epoch, (r.start, r.end))
            spans[r.epoch] = (min(lo, r.start), max(hi, r.end))
    return spans


def epoch_split(records: Sequence[StepRecord]) -> dict[str, float]:
    """A replay's span (first record's start to last one's end) split into the time some `mux` epoch
    was in flight, its decode forwards outside every epoch, and the rest (the host's gaps and
    idling outside epochs)."""
    spans = sorted(epoch_spans(records).values())
    merged: list[list[float]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    inside = sum(hi - lo for lo, hi in merged)
    outside = sum(r.duration for r in prefill_free(records))
    span = max(r.end for r in records) - min(r.start for r in records) if records else 0.0
    return {"span_s": span, "epochs": len(spans), "in_epochs_s": inside, "decode_outside_s": outside,
            "rest_s": span - inside - outside}


def epoch_charge(records: Sequence[StepRecord], cost: CostModel) -> dict[str, float]:
    """A replay's `mux` epochs, summed, against what `cost` charges their prefill alone and the decode
    forwards that ran inside them (by positions). A segment's record holds its enqueue, so the device
    time of an epoch's last segment shows in the decode forward after it: each epoch runs to the end
    of that forward (where it starts before the next epoch), and the forward is charged with it. A
    simulated round runs prefill and decode one after the other, so `over_serial` under 1 means the
    device ran prefill beside those forwards, or in the host's time between them; the records cannot
    tell which."""
    spans = epoch_spans(records)
    starts = sorted(lo for lo, _ in spans.values())
    segments: dict[int, list[StepRecord]] = {}
    for r in records:
        if r.epoch is not None:
            segments.setdefault(r.epoch, []).append(r)
    decodes = sorted((r for r in records if r.phase == "D" and r.epoch is None and not r.prefill_tokens),
                     key=lambda r: r.start)
    span = prefill = decode = 0.0
    for epoch, (lo, hi) in spans.items():
        prefill += cost.step_s(StepSize(0, 0, *(sum(getattr(r, f) for r in segments[epoch])
                                                for f in ("prefill_rows", "prefill_tokens", "prefill_pairs"))))
        after = next((r for r in decodes if r.start >= hi), None)
        following = next((s for s in starts if s > lo), math.inf)
        end = after.end if after is not None and after.start < following else hi
        decode += sum(cost.step_s(StepSize.of(r)) for r in decodes
                      if r.start < end and r.end > lo)
        span += end - lo
    serial = prefill + decode
    return {"span_s": span, "prefill_charge_s": prefill, "decode_charge_s": decode,
            "over_serial": span / serial if serial else math.nan}


def epoch_check(result: dict, trace: Sequence[TraceRequest], fit_from: dict | None = None) -> dict[str, Any]:
    """`epoch_split` of each `mux` schedule's repeat 0 beside the same of its out-of-sample simulations
    (module docstring; partition schedules are left out: they run prefill beside decode)."""
    pooled = _pooled_fits(result, trace, fit_from)
    out: dict[str, Any] = {}
    for label, entry in result.get("schedules", {}).items():
        parts = split_spec(entry["spec"])
        if parts.schedule != "mux" or parts.decode_sms:
            continue
        first = _first(entry)
        if first is None:
            out[label] = {"skipped": "repeat 0 did not finish or kept no step records"}
            continue
        config = _sim_config(result, entry["spec"], entry["budget"], first)
        if isinstance(config, str):
            out[label] = {"skipped": config}
            continue
        records = from_columns(first["steps"])
        row: dict[str, Any] = {"measured": epoch_split(records), "charged": {}}
        for name, cost in pooled.items():
            row[name] = {"skipped": cost} if isinstance(cost, str) else epoch_split(
                simulate(trace, _segmented(cost, _mux_segments(config, first)), config).records)
            if not isinstance(cost, str):
                row["charged"][name] = epoch_charge(records, cost)
        out[label] = row
    return out


def epoch_table(report: dict) -> str:
    """The printed `epoch_check`: seconds of each part, measured and simulated."""
    lines = [f"{'mux schedule':<40}{'of':>10}{'span_s':>9}{'epochs':>8}{'in_ep_s':>9}{'D_out_s':>9}{'rest_s':>8}"]
    for label, row in report["epoch_check"].items():
        if "skipped" in row:
            lines.append(f"{label:<40} {row['skipped']}")
            continue
        for name in ("measured", *FITS):
            v = row.get(name) or {}
            lines.append(f"{label:<40}{name:>10}" + (f"  {v['skipped']}" if "skipped" in v else
                         f"{v['span_s']:>9.2f}{v['epochs']:>8}{v['in_epochs_s']:>9.2f}{v['decode_outside_s']:>9.2f}"
                         f"{v['rest_s']:>8.2f}"))
    lines.append("measured epochs over their serial charge (prefill alone + the decode forwards inside them):")
    for label, row in report["epoch_check"].items():
        for name, v in row.get("charged", {}).items():
            lines.append(f"  {label} {name}: {v['span_s']:.2f} s over {v['prefill_charge_s']:.2f} + "
                         f"{v['decode_charge_s']:.2f} s = {v['over_serial']:.3f}")
    return "\n".join(lines)


def verify_table(report: dict) -> str:
    """The printed `verify_check`: measured over charged, and over each position charged as a row, per bucket."""
    lines = ["verify forwards with no prefill beside them, measured over what the out-of-sample fit charges "
             "(and over each position charged as a row):"]
    for label, row in report["verify_check"].items():
        if "skipped" in row:
            lines.append(f"  {label}: {row['skipped']}")
            continue
        for name in FITS:
            part = row.get(name) or {}
            cells = [f"{b} (n={v['n']}): {v['over_charge']:.2f} ({v['over_positions']:.2f})"
                     for b, v in part.items() if isinstance(v, dict)]
            lines.append(f"  {label} {name}: " + (part.get("skipped") or "; ".join(cells) or "none"))
    return "\n".join(lines)


def _cell(part: dict, fit_name: str) -> str:
    e = (part.get(fit_name) or {}).get("error")
    return f"{100 * e:+.1f}%" if e is not None else "-"


def table(report: dict) -> str:
    """The printed summary: each schedule's measured makespans and the fits' errors."""
    t = report.get("trace") or {}
    lines = [f"== sim_replay {report.get('model')} profile={report.get('profile')} {t.get('conversations')} "
             f"conversations, {t.get('requests')} requests, {report.get('device')}",
             f"{'schedule':<14}{'budget':>7}{'rep0_s':>9}{'lin_in':>9}{'exp_in':>9}{'later_s':>9}{'lin_out':>9}"
             f"{'exp_out':>9}"]
    skips = []
    for label, row in report["schedules"].items():
        ins, outs = row["in_sample"], row["out_of_sample"]
        rep0, later = ins.get("measured_s"), outs.get("measured_s")
        lines.append(f"{label:<14}{row['budget']:>7}{'-' if rep0 is None else f'{rep0:.3f}':>9}"
                     f"{_cell(ins, 'linear'):>9}{_cell(ins, 'experts'):>9}"
                     f"{'-' if later is None else f'{later:.3f}':>9}{_cell(outs, 'linear'):>9}"
                     f"{_cell(outs, 'experts'):>9}")
        for kind, part in (("in-sample", ins), ("out-of-sample", outs)):
            reasons = [part.get("skipped")] + [(part.get(n) or {}).get("skipped") for n in FITS]
            skips += [f"  {label} {kind}: {r}" for r in dict.fromkeys(reasons) if r]
    return "\n".join(lines + (["skipped:"] + skips if skips else []))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sim_replay", description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a benchmarks.rollout rollout.json (its trace.jsonl beside it)")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    ap.add_argument("--fit-from", default=None, metavar="RESULT.json",
                    help="fit the out-of-sample model to this run's off and chunked (same model and device)")
    ap.add_argument("--overlap-from", default=None, metavar="PD.json",
                    help="a benchmarks.pd_overlap result: its 'held' and 'driver' runs give the '/sms:N' and "
                         "'/split:N' schedules' overlap factors")
    ap.add_argument("--mux-segments", default=None, metavar="N,N,...",
                    help="also simulate the run's mux with each count of prefill segments per epoch, beside off "
                         "(makespan, TTFT; `segment_sweep`)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="draw the errors here (with --mux-segments: the sweep)")
    ap.add_argument("--what-if", default=None, metavar="SPEC,SPEC",
                    help="also simulate schedules the run did not measure: its schedules with '/sms:N' or '/split:N' "
                         "(factors from --overlap-from), each beside the schedule it extends (`what_if`)")
    ap.add_argument("--orderings", action="store_true",
                    help="also simulate each schedule under every ordering (the engine's priorities, the oracle) on "
                         "the linear fits, over arrival order (`orderings`)")
    ap.add_argument("--verify-check", action="store_true",
                    help="also set each drafting schedule's verify forwards with no prefill beside them against "
                         "what the out-of-sample fits charge them (`verify_check`)")
    ap.add_argument("--epoch-check", action="store_true",
                    help="also split each mux schedule's makespan, measured and simulated out of sample, into "
                         "its epochs in flight, decode outside them and the rest (`epoch_check`)")
    ap.add_argument("--trace", default=None, metavar="TRACE.jsonl",
                    help="the run's trace (default: trace.jsonl beside the result)")
    args = ap.parse_args(argv)
    path = Path(args.result)
    result = json.loads(path.read_text())
    fit_from = json.loads(Path(args.fit_from).read_text()) if args.fit_from else None
    trace_path = Path(args.trace) if args.trace else path.parent / "trace.jsonl"
    if not trace_path.exists():
        raise SystemExit(f"{trace_path} not found: benchmarks.rollout writes the trace beside rollout.json "
                         f"(or name it with --trace)")
    overlap_from = json.loads(Path(args.overlap_from).read_text()) if args.overlap_from else None
    trace = load_trace(trace_path)
    report = {"result": str(path), "fit_from": args.fit_from, "overlap_from": args.overlap_from,
              **sim_replay(result, trace, fit_from, overlap_from)}
    if args.mux_segments:
        try:
            counts = [float(n) for n in args.mux_segments.split(",") if n.strip()]
        except ValueError:
            raise SystemExit(f"--mux-segments takes positive numbers, got {args.mux_segments!r}") from None
        if not counts or min(counts) <= 0:
            raise SystemExit(f"--mux-segments takes positive numbers, got {args.mux_segments!r}")
        report["mux_segments"] = segment_sweep(result, trace, counts, fit_from)
    if args.what_if:
        report["what_if"] = what_if(result, trace, [x for x in args.what_if.split(",") if x], fit_from,
                                    overlap_from)
    if args.orderings:
        report["orderings"] = orderings(result, trace, fit_from)
    if args.verify_check:
        report["verify_check"] = verify_check(result, trace, fit_from)
    if args.epoch_check:
        report["epoch_check"] = epoch_check(result, trace, fit_from)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table(report), flush=True)
    if "what_if" in report:
        print(what_if_table(report), flush=True)
    if "orderings" in report:
        print(orderings_table(report), flush=True)
    if "mux_segments" in report:
        print(segments(report), flush=True)
    if "verify_check" in report:
        print(verify_table(report), flush=True)
    if "epoch_check" in report:
        print(epoch_table(report), flush=True)
    if args.plot:
        from benchmarks.plot import plot_segments, plot_sim_errors

        if "mux_segments" in report:
            plot_segments(report["mux_segments"], args.plot)
        else:
            plot_sim_errors(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
