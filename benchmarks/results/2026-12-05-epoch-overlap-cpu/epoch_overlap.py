"""Where the drafting schedule's out-of-sample surplus sits, from the seed-1 H200 run's stored records
(CPU only). For each `mux` schedule's repeat 0: its epochs' spans (each from its first record's start
to the end of the decode forward after its last segment, `sim_replay.epoch_charge`) against what the
out-of-sample linear fit (`benchmarks.sim_replay`, fitted to `chunked`, or `off` and `chunked`)
charges their prefill alone and the decode forwards that ran inside them, by their positions; then
the whole replay simulated with the simulator's `Overlap` lever on plain streams, for a grid of
(decode_factor, prefill_factor), against the median of the later repeats. Last, the span ratio of
every stored H200 run whose `off` or `chunked` gives that fit.
Run from the checkout's root:
    python benchmarks/results/2026-12-05-epoch-overlap-cpu/epoch_overlap.py > .../epoch_overlap.log"""
import dataclasses
import glob
import json
import statistics
from pathlib import Path

from benchmarks import sim_replay as sr
from megatron_rollout.sim.cost import StepSize
from megatron_rollout.sim.levers import Overlap
from megatron_rollout.sim.simulator import simulate
from megatron_rollout.trace.schema import load_trace
from megatron_rollout.trace.steps import from_columns

RUN = "benchmarks/results/2026-12-05-seed1-h200/"
FACTORS = [(df, pf) for df in (1.0, 1.5, 2.0, 2.5, 3.0, 4.0) for pf in (1.0, 1.2, 1.4)]


def epochs(records, cost):
    """(span, prefill charge, decode charge) of the replay's epochs (`sim_replay.epoch_charge`: each to
    the end of the decode forward after its last segment, which holds that segment's device time)."""
    c = sr.epoch_charge(records, cost)
    return c["span_s"], c["prefill_charge_s"], c["decode_charge_s"]


def main() -> None:
    trace = load_trace(RUN + "trace64.jsonl")
    out = {}
    for name in ("inter64", "drafts64"):
        result = json.load(open(RUN + name + ".json"))
        cost = sr._pooled_fits(result, trace, None)["linear"]
        off = sr._first(result["schedules"]["off"]) if "off" in result["schedules"] else None
        if off is not None:
            pre = [r for r in from_columns(off["steps"]) if r.prefill_tokens and not r.decode_rows]
            charged = sum(cost.step_s(StepSize(0, 0, r.prefill_rows, r.prefill_tokens, r.prefill_pairs)) for r in pre)
            measured = sum(r.duration for r in pre)
            print(f"{name} off: prefill forwards measured {measured:.2f} s, charged {charged:.2f} s")
        for label, entry in result["schedules"].items():
            parts = sr.split_spec(entry["spec"])
            if parts.schedule != "mux" or parts.decode_sms:
                continue
            first = sr._first(entry)
            span, p, d = epochs(from_columns(first["steps"]), cost)
            print(f"{name} {label}: epochs span {span:.2f} s; charged prefill {p:.2f} + decode inside {d:.2f} = "
                  f"{p + d:.2f} s (span over it {span / (p + d):.3f})")
            config = sr._sim_config(result, entry["spec"], entry["budget"], first)
            later = statistics.median(r["report"]["makespan_s"] for r in entry["repeats"]
                                      if r.get("repeat") and r.get("finished"))
            grid = {}
            for df, pf in FACTORS:
                c = dataclasses.replace(config, levers=dataclasses.replace(config.levers, overlap=Overlap(df, pf)))
                sim = simulate(trace, sr._segmented(cost, sr._mux_segments(config, first)), c).makespan_s
                grid[f"{df}/{pf}"] = sim / later - 1
            serial = simulate(trace, sr._segmented(cost, sr._mux_segments(config, first)), config).makespan_s
            print("   simulated over measured (later repeats' median): serial " f"{serial / later - 1:+.1%}; overlap "
                  + ", ".join(f"{k} {v:+.1%}" for k, v in grid.items()))
            out[f"{name}/{label}"] = {"span_s": span, "prefill_charge_s": p, "decode_charge_s": d,
                                      "later_median_s": later,
                                      "serial_error": serial / later - 1, "overlap_error": grid}
    out["runs"] = scan()
    with open("benchmarks/results/2026-12-05-epoch-overlap-cpu/epoch_overlap.json", "w") as f:
        json.dump(out, f, indent=1)


def scan() -> list[dict]:
    """Every stored H200 run with `mux` epochs and an out-of-sample fit: span over the serial charge."""
    rows = []
    for path in sorted(glob.glob("benchmarks/results/*-h200/*.json")):
        result = json.loads(Path(path).read_text())
        traces = sorted(Path(path).parent.glob("*.jsonl"))
        if not isinstance(result, dict) or not isinstance(result.get("schedules"), dict) or not traces:
            continue
        if not any(sr._first(result["schedules"].get(s, {})) for s in sr.POOLED):
            continue
        cost = sr._pooled_fits(result, load_trace(traces[0]), None)["linear"]
        for label, entry in result["schedules"].items():
            parts = sr.split_spec(entry["spec"])
            first = sr._first(entry)
            if parts.schedule != "mux" or parts.decode_sms or first is None:
                continue
            span, p, d = epochs(from_columns(first["steps"]), cost)
            rows.append({"run": path.split("results/")[1], "schedule": label, "span_s": span, "prefill_charge_s": p,
                         "decode_charge_s": d, "span_over_serial": span / (p + d), "span_over_prefill": span / p})
            print(f"{rows[-1]['run']:52s} {label:42s} span {span:5.2f} s = {span / (p + d):.3f} of prefill + "
                  f"decode charged ({p:.2f} + {d:.2f}), {span / p:.3f} of prefill alone")
    return rows


if __name__ == "__main__":
    main()
