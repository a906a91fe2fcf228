"""Every ordering the simulator knows, on the `prefill` traces of seeds 0-9 (64 conversations), under
the drafting schedule of the seed-1 H200 run, on that schedule's in-sample linear fit (its repeat 0:
within 6.5% of its replay). Makespan over FIFO's per seed, then median, min and max over the seeds.
Run from the checkout's root: python benchmarks/results/2026-12-05-orderings-ten-seeds-cpu/orderings_seeds.py"""
import json
import statistics

from benchmarks import sim_replay as sr
from megatron_rollout.sim.policy import POLICIES, make_policy
from megatron_rollout.sim.simulator import simulate
from megatron_rollout.trace.make import make_trace
from megatron_rollout.trace.schema import load_trace

RUN = "benchmarks/results/2026-12-05-seed1-h200/"
LABEL = "mux@budget:24000~ngram:7"

result = json.load(open(RUN + "inter64.json"))
entry = result["schedules"][LABEL]
first = sr._first(entry)
config = sr._sim_config(result, entry["spec"], entry["budget"], first)
cost = sr._own_fits(result, load_trace(RUN + "trace64.jsonl"), first, config)["linear"]
names = list(POLICIES)
rows = []
for seed in range(10):
    trace = make_trace(64, seed, 1.0, None, profile="prefill")
    made = {name: simulate(trace, cost, config, make_policy(name)).makespan_s for name in names}
    rows.append(made)
    print(f"seed {seed}: FIFO {made['fifo']:.2f} s;", ", ".join(f"{n} {made[n] / made['fifo']:.3f}" for n in names[1:]))
for name in names[1:]:
    ratios = [m[name] / m["fifo"] for m in rows]
    print(f"{name}: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
with open("benchmarks/results/2026-12-05-orderings-ten-seeds-cpu/orderings_seeds.json", "w") as f:
    json.dump({"schedule": LABEL, "fit": "in sample, linear, inter64.json repeat 0", "makespan_s": rows}, f, indent=1)
