"""`chunked` at other token budgets, simulated on the same fit as tail_lane.py (the experts fit, in
sample, to `chunked`'s repeat 0 of RESULT), on the run's own trace: makespan per budget.

    PYTHONPATH=$PWD python benchmarks/results/2026-12-06-tail-lane-sim-cpu/budgets.py \
        benchmarks/results/2026-12-06-h100-fused-draw/t1-inter64.json > budgets.json
"""
import dataclasses
import json
import sys
from pathlib import Path

from benchmarks.sim_replay import fitted_in_sample
from megatron_rollout.sim.simulator import simulate
from megatron_rollout.trace.schema import load_trace


def main(path: str) -> dict:
    result = json.loads(Path(path).read_text())
    trace = load_trace(Path(path).with_name("trace64.jsonl"))
    config, cost = fitted_in_sample(result, trace, "chunked", "experts")
    out = {"result": path, "fit": "experts, in sample (chunked repeat 0)",
           "measured_budget": config.scheduler.max_batch_tokens, "budgets": []}
    for budget in (2048, 4096, 8192, 16384, 32768):
        at = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_batch_tokens=budget))
        out["budgets"].append({"budget": budget, "sim_s": simulate(trace, cost, at).makespan_s})
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), indent=1))
