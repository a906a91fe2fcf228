"""`python -m benchmarks.step_times RESULT.json [--schedules A,B]`: where each timed replay's host
clock went, from its step records (`benchmarks.rollout` keeps them as `steps`).

Per schedule and repeat: the makespan, the records, the time inside steps (a record's span: the
step's inputs, its forward, the read-back of its samples and their bookkeeping; a drafting step's
verdicts too; a `mux` segment only its enqueue) and between them (planning, the n-gram lookups,
the engine's loop and waits, with the part in gaps longer than `--long-gap-ms`), and, for a
decode-only step by its decode rows (1, 2-4, 5-31, 32 and more), its median span and the median
gap before it (its planning, with a drafting row's lookup; gaps over the limit are waits, left out);
and `mux`'s P segment records (the host's time from the end of a round's decode iteration to the
end of the round: the segments' enqueue, during which the host issues no decode), the round that
starts an epoch (its record holds the epoch's tokens) apart from the later ones; and, where the
run kept them (CUDA), the caching allocator's cudaMalloc and cudaFree calls and retries in the
replay: a retry frees cached blocks, which waits for the whole device. Two repeats of one
schedule that differ show whether the steps or what runs between them took the difference. Left
out: the device's own time (records hold host clocks only), so a step's host and device parts
are not told apart: where decode is issued ahead (plain schedules on the CUDA runner) the host
part overlaps the device's, where it is not (drafting) they add up. A run with `--host-profile`
tells them apart for its profiled schedules: their functions by own time follow the table. The
replay's start-up (its start to its first forward, the first turns submitted:
`sim_replay.first_forward_s`) and, where the run kept them, its turns' submissions (host time
between forwards that no record covers), Python's garbage collections in the replay
(`benchmarks.pauses`) and the time between forwards split where each engine step began
(`StepLog.step_starts`) close each row. Where the run measured the matmul rate (CUDA), the steps
that computed prefill are summed too: their records' spans, their FLOPs (`bounds.counted_prefill_flops`
of their tokens, attention pairs and sampled rows) and the share of the matmul rate that makes; the spans are host
clocks, and a mixed step's decode rows ride along, so the share is a little low.
"""
from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bounds import ModelCosts, counted_prefill_flops, model_costs
from benchmarks.sim_replay import ROW_BUCKETS, bucket_name, first_forward_s, in_bucket, sleeps, submissions
from megatron_rollout.engine.records import StepRecord
from megatron_rollout.sim.cost import turn_cost
from megatron_rollout.trace.steps import from_columns


def prefill_steps(records: Sequence[StepRecord], costs: ModelCosts, matmul_flops: float) -> dict[str, Any]:
    """The records that computed prefill: how many, their spans' sum, their prefill FLOPs (linear layers
    for every new token, causal attention over each chunk's pairs, the output layer for each chunk's
    sampled row) and the share of `matmul_flops` (FLOP/s) that rate is."""
    picked = [r for r in records if r.prefill_tokens]
    span = sum(r.end - r.start for r in picked)
    flops = sum(counted_prefill_flops(costs, r.prefill_tokens, r.prefill_pairs, r.prefill_rows) for r in picked)
    return {"n": len(picked), "span_s": span, "flops": flops,
            "share_of_matmul_rate": flops / span / matmul_flops if span > 0 and matmul_flops > 0 else None}


def summarize(records: Sequence[StepRecord], long_gap_s: float = 0.005,
              step_starts: Sequence[float] = (), slept_s: float = 0.0) -> dict[str, Any]:
    """Time inside and between `records`' forwards, and the median decode-only forward by rows and
    the median gap before it; with the engine steps' `step_starts`, the gaps' time split into the
    caller's between steps (the replay's loop: its submissions, and `slept_s` of sleeping with nothing
    to run, given apart), the steps' own before their first forward (planning, a drafting step's
    lookups) and the rest (within a step: a `mux` round between its decode iteration and its segment)."""
    recs = sorted(records, key=lambda r: r.start)
    inside = sum(r.end - r.start for r in recs)
    gaps = [0.0] + [max(0.0, b.start - a.end) for a, b in zip(recs, recs[1:])]  # gaps[i]: before recs[i]
    out: dict[str, Any] = {"records": len(recs), "inside_s": inside, "between_s": sum(gaps),
                           "long_gaps_s": sum(g for g in gaps if g > long_gap_s)}
    if step_starts:
        split = _split_gaps(recs, sorted(step_starts))
        out["gaps_split_s"] = {**split, "loop": split["loop"] - slept_s, "slept": slept_s}
    for lo, hi in ROW_BUCKETS:
        picked = [i for i, r in enumerate(recs) if r.phase == "D" and not r.prefill_tokens
                  and in_bucket(r.decode_rows, lo, hi)]
        spans = [recs[i].end - recs[i].start for i in picked]
        before = [gaps[i] for i in picked if i and gaps[i] <= long_gap_s]
        out[f"rows_{bucket_name(lo, hi)}"] = {"n": len(spans), "median_ms": _median_ms(spans),
                                          "gap_ms": _median_ms(before)}
    # a `mux` epoch's rows (its tokens) are on its first segment's record: the round that starts it
    for part, starts in (("epoch_starts", True), ("later_segments", False)):
        spans = [r.end - r.start for r in recs if r.epoch is not None and bool(r.prefill_tokens) is starts]
        out[part] = {"n": len(spans), "median_ms": _median_ms(spans), "total_s": sum(spans)}
    return out


def _split_gaps(recs: Sequence[StepRecord], starts: Sequence[float]) -> dict[str, float]:
    """The time between consecutive records, split at the engine step that began inside the gap (the
    last, where several did: the ones before ran no forward)."""
    loop = planning = within = 0.0
    for a, b in zip(recs, recs[1:]):
        if b.start <= a.end:
            continue
        i = bisect.bisect_right(starts, b.start) - 1
        if i >= 0 and starts[i] >= a.end:
            loop, planning = loop + starts[i] - a.end, planning + b.start - starts[i]
        else:
            within += b.start - a.end
    return {"loop": loop, "planning": planning, "within": within}


def _median_ms(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) * 1e3 if xs else None


def step_times(result: dict[str, Any], schedules: Sequence[str] | None = None,
               long_gap_s: float = 0.005) -> dict[str, list[dict[str, Any]]]:
    """`summarize` of every timed repeat with step records, per schedule (and `prefill_steps` where the
    run measured the matmul rate of a preset model)."""
    from megatron_rollout.model.config import PRESETS

    out: dict[str, list[dict[str, Any]]] = {}
    peak = (result.get("ceilings") or {}).get("bf16_matmul_flops")
    costs = model_costs(PRESETS[result["model"]]) if peak and result.get("model") in PRESETS else None
    for name, entry in result.get("schedules", {}).items():
        if schedules and name not in schedules:
            continue
        for rep in entry.get("repeats", []):
            if rep.get("steps") and rep.get("report"):
                marks = submissions(rep)
                tokens = sum(n for _, _, n in marks)
                row = {"repeat": rep.get("repeat"), "makespan_s": rep["report"]["makespan_s"],
                       "allocator": rep.get("allocator") or None, "gc": rep.get("gc"),
                       "start_up_s": first_forward_s(rep),
                       "submissions": {"n": len(marks), "total_s": sum(b - a for a, b, _ in marks),
                                       "us_per_token": 1e6 * turn_cost(marks)} if tokens else None}
                slept = sum(b - a for a, b in sleeps(rep) or ())
                records = from_columns(rep["steps"])
                row["prefill_steps"] = prefill_steps(records, costs, peak) if costs is not None else None
                out.setdefault(name, []).append(row | summarize(records, long_gap_s, rep.get("step_starts") or (),
                                                                slept))
    return out


def table(times: dict[str, list[dict[str, Any]]]) -> str:
    from benchmarks.report import markdown, num

    buckets = [bucket_name(lo, hi) for lo, hi in ROW_BUCKETS]
    head = ["schedule", "repeat", "makespan s", "records", "in forwards s", "between s", "gaps > limit s"]
    rows = [[name, str(r["repeat"]), num(r["makespan_s"], ".2f"), str(r["records"]), num(r["inside_s"], ".2f"),
             num(r["between_s"], ".2f"), num(r["long_gaps_s"], ".2f")]
            + [f"{r[f'rows_{b}']['n']}, {num(r[f'rows_{b}']['median_ms'], '.2f')}, "
               f"{num(r[f'rows_{b}']['gap_ms'], '.2f')}" for b in buckets]
            + [_segments(r["epoch_starts"]), _segments(r["later_segments"]), _allocator(r["allocator"]),
               num(r.get("start_up_s"), ".3f"), _marks(r.get("submissions")), _gc(r.get("gc")),
               _split(r.get("gaps_split_s")), _prefill(r.get("prefill_steps"))]
            for name, reps in times.items() for r in reps]
    return markdown(head + [f"{b} rows: n, median ms, gap before ms" for b in buckets]
                    + ["mux epoch starts: n, median ms, total s", "later segments: n, median ms, total s",
                       "cudaMalloc / cudaFree / retries", "start-up s", "turn submissions: n, total s, us/token",
                       "gc: collections by generation, total s, longest ms (begun in the makespan: total s, "
                       "longest ms)",
                       "between, s: slept / loop / step's planning / within a step",
                       "steps with prefill: n, s, share of the matmul rate"], rows)


def _prefill(steps: dict[str, Any] | None) -> str:
    from benchmarks.report import num

    return "-" if not steps else f"{steps['n']}, {steps['span_s']:.2f}, {num(steps['share_of_matmul_rate'], '.3f')}"


def _split(split: dict[str, float] | None) -> str:
    return "-" if not split else "/".join(f" {split[k]:.2f} " for k in ("slept", "loop", "planning", "within")).strip()


def _gc(pauses: dict[str, Any] | None) -> str:
    """Python's collections in the replay (`benchmarks.pauses`), where the run kept them."""
    if not pauses:
        return "-"
    text = f"{'/'.join(map(str, pauses['collections']))}, {pauses['total_s']:.3f}, {1e3 * pauses['longest_s']:.1f}"
    inside = pauses.get("in_window")
    if inside is None:
        return text
    return f"{text} (in the makespan: {inside['total_s']:.3f}, {1e3 * inside['longest_s']:.1f})"


def _marks(sub: dict[str, Any] | None) -> str:
    return "-" if sub is None else f"{sub['n']}, {sub['total_s']:.3f}, {sub['us_per_token']:.3f}"


def _allocator(counts: dict[str, int] | None) -> str:
    """The caching allocator's device calls in the replay (`benchmarks.rollout`'s `allocator`)."""
    if not counts:
        return "-"
    return " / ".join(str(counts.get(k, "-")) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries"))


def _segments(seg: dict[str, Any]) -> str:
    from benchmarks.report import num

    if not seg["n"]:
        return "-"
    return f"{seg['n']}, {num(seg['median_ms'], '.2f')}, {num(seg['total_s'], '.2f')}"


def profile_table(result: dict[str, Any], top: int = 15) -> str:
    """The `top` functions by own time of each profiled replay (`benchmarks.rollout --host-profile`)."""
    from benchmarks.report import markdown, num

    parts = []
    for spec, prof in result.get("host_profile", {}).items():
        if "by_own" not in prof:
            parts.append(f"{spec}: {prof.get('skipped', 'no profile')}")
            continue
        rows = [[name, str(calls), num(own, ".3f"), num(cum, ".3f")] for name, calls, own, cum in prof["by_own"][:top]]
        parts.append(f"{spec} under cProfile: makespan {num(prof.get('makespan_s'), '.2f')} s, profiled "
                     f"{num(prof['total_s'], '.2f')} s\n"
                     + markdown(["function", "calls", "own s", "cumulative s"], rows))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_times", description=__doc__.splitlines()[0])
    ap.add_argument("result", help="a benchmarks.rollout rollout.json")
    ap.add_argument("--schedules", default="", help="comma-separated; default: every schedule")
    ap.add_argument("--long-gap-ms", type=float, default=5.0)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    result = json.loads(Path(args.result).read_text())
    names = [s.strip() for s in args.schedules.split(",") if s.strip()]
    times = step_times(result, names or None, args.long_gap_ms / 1e3)
    if not times:
        print(f"{args.result}: no timed repeat with step records" + (f" among {names}" if names else ""),
              file=sys.stderr)
        return 1
    if args.out:
        Path(args.out).write_text(json.dumps(times, indent=1))
    print(table(times))
    if result.get("host_profile"):
        print("\n" + profile_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
