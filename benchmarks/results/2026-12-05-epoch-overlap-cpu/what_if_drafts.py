"""The seed-1 H200 run's schedules, and drafts under `off` and `chunked` (not run), simulated on each
command's out-of-sample linear fit; drafting statistics from the drafting schedule's repeat 0.
Run from the checkout's root: python benchmarks/results/2026-12-05-epoch-overlap-cpu/what_if_drafts.py"""
import json
import statistics

from benchmarks import sim_replay as sr
from megatron_rollout.sim.simulator import simulate
from megatron_rollout.trace.schema import load_trace

RUN = "benchmarks/results/2026-12-05-seed1-h200/"
DRAFTING = "mux@budget:24000~ngram:7"
SPECS = ("off~ngram:7", "chunked~ngram:7", "chunked", "mux", DRAFTING)

trace = load_trace(RUN + "trace64.jsonl")
for name in ("inter64", "drafts64"):
    result = json.load(open(RUN + name + ".json"))
    cost = sr._pooled_fits(result, trace, None)["linear"]
    drafting = sr._first(result["schedules"][DRAFTING])
    measured = {label: statistics.median(r["report"]["makespan_s"] for r in entry["repeats"] if r.get("finished"))
                for label, entry in result["schedules"].items()}
    print(name, "measured medians:", {k: round(v, 2) for k, v in measured.items()})
    for spec in SPECS:
        config = sr._sim_config(result, spec, 16384, drafting)
        own = sr._first(result["schedules"].get(spec, {})) or drafting
        simulated = simulate(trace, sr._segmented(cost, sr._mux_segments(config, own)), config).makespan_s
        print(f"   {spec:26s} simulated {simulated:.2f} s")
