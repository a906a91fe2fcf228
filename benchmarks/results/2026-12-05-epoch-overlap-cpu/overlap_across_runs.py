"""The `Overlap` factors that fit the seed-1 drafting replays, (3.0, 1.0) and (2.5, 1.0), applied to
every `mux` schedule of the stored H200 runs with a later repeat, beside the serial simulation:
simulated (out-of-sample linear fit) over the median of the later repeats, minus 1.
Run from the checkout's root: python benchmarks/results/2026-12-05-epoch-overlap-cpu/overlap_across_runs.py"""
import dataclasses
import json
import statistics
from pathlib import Path

from benchmarks import sim_replay as sr
from megatron_rollout.sim.levers import Overlap
from megatron_rollout.sim.simulator import simulate
from megatron_rollout.trace.schema import load_trace

RUNS = ("2026-12-04-interleaved-peer-h200/inter64.json", "2026-12-05-interleaved-peer-h200/inter64.json",
        "2026-12-05-seed1-h200/inter64.json", "2026-12-05-seed1-h200/drafts64.json")
OVERLAPS = {"serial": None, "3.0/1.0": Overlap(3.0, 1.0), "2.5/1.0": Overlap(2.5, 1.0)}

for run in RUNS:
    path = Path("benchmarks/results") / run
    result = json.loads(path.read_text())
    trace = load_trace(sorted(path.parent.glob("*.jsonl"))[0])
    cost = sr._pooled_fits(result, trace, None)["linear"]
    for label, entry in result["schedules"].items():
        parts, first = sr.split_spec(entry["spec"]), sr._first(entry)
        later = [r["report"]["makespan_s"] for r in entry["repeats"] if r.get("repeat") and r.get("finished")]
        if parts.schedule != "mux" or parts.decode_sms or first is None or not later:
            continue
        config = sr._sim_config(result, entry["spec"], entry["budget"], first)
        segmented = sr._segmented(cost, sr._mux_segments(config, first))
        errors = {}
        for name, overlap in OVERLAPS.items():
            c = config if overlap is None else dataclasses.replace(
                config, levers=dataclasses.replace(config.levers, overlap=overlap))
            errors[name] = simulate(trace, segmented, c).makespan_s / statistics.median(later) - 1
        print(f"{run:46s} {label:42s} " + ", ".join(f"{k} {v:+.1%}" for k, v in errors.items()))
