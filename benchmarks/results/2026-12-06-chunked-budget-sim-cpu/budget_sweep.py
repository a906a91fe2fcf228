"""`chunked` with and without 7-token drafts at other token budgets than the 16,384 measured,
simulated on the H100 seed-1 run's fits: each schedule's own (in sample, its repeat 0) and the
run's pooled linear fit (out of sample). A mixed step's decode rows wait for its prefill chunk, so a
smaller budget shortens every decode step and lengthens the prefills. Run from the checkout's root:
python benchmarks/results/2026-12-06-chunked-budget-sim-cpu/budget_sweep.py"""
import json
import statistics

from benchmarks import sim_replay as sr
from megatron_rollout.sim.simulator import simulate
from megatron_rollout.trace.schema import load_trace

RUN = "benchmarks/results/2026-12-05-chunked-drafts-h100/"
BUDGETS = (4096, 8192, 12288, 16384, 24576, 32768)

trace = load_trace(RUN + "trace64.jsonl")
out = {}
for name in ("inter64", "sync64"):
    result = json.load(open(RUN + name + ".json"))
    pooled = sr._pooled_fits(result, trace, None)["linear"]
    for spec in ("chunked", "chunked~ngram:7"):
        entry = result["schedules"][spec]
        first = sr._first(entry)
        measured = statistics.median(r["report"]["makespan_s"] for r in entry["repeats"] if r.get("finished"))
        own = sr._own_fits(result, trace, first, sr._sim_config(result, spec, 16384, first))["linear"]
        row = {}
        for budget in BUDGETS:
            config = sr._sim_config(result, spec, budget, first)
            row[budget] = {fit: simulate(trace, cost, config).makespan_s
                           for fit, cost in (("own", own), ("pooled", pooled))}
        out[f"{name} {spec}"] = {"measured_16384_s": measured, "simulated_s": row}
        cells = "  ".join(f"{b}: {v['own']:.2f}/{v['pooled']:.2f}" for b, v in row.items())
        print(f"{name} {spec:16s} measured {measured:.2f} s; simulated own/pooled  {cells}")
json.dump(out, open("benchmarks/results/2026-12-06-chunked-budget-sim-cpu/budget_sweep.json", "w"), indent=1)
