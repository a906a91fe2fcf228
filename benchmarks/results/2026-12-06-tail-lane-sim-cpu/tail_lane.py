"""A tail lane, simulated (`sim.levers.TailLane`): after each engine step with more than R decode
rows, E decode-only steps of just the R decoding requests ranked first (`LANE_RANKS`: by the tokens
their conversation has generated, by its context, or by the oracle's remaining chain); beside it,
`chunked` at other token budgets. The cost model is the experts fit, in sample, to `chunked`'s
repeat 0 of RESULT, on the run's own trace.

    PYTHONPATH=$PWD python benchmarks/results/2026-12-06-tail-lane-sim-cpu/tail_lane.py \
        benchmarks/results/2026-12-06-h100-fused-draw/t1-inter64.json > tail_lane.json
"""
import dataclasses
import json
import sys
from pathlib import Path

from benchmarks.sim_replay import fitted_in_sample
from megatron_rollout.sim.levers import LANE_RANKS, Levers, TailLane
from megatron_rollout.sim.simulator import simulate
from megatron_rollout.trace.schema import load_trace


def main(path: str) -> dict:
    result = json.loads(Path(path).read_text())
    trace = load_trace(Path(path).with_name("trace64.jsonl"))
    config, cost = fitted_in_sample(result, trace, "chunked", "experts")
    fifo = simulate(trace, cost, config).makespan_s
    out = {"result": path, "fit": "experts, in sample (chunked repeat 0)",
           "measured_s": result["schedules"]["chunked"]["median"]["makespan_s"], "fifo_sim_s": fifo,
           "measured_budget": config.scheduler.max_batch_tokens, "lanes": [], "budgets": []}
    for rows in (1, 2, 4, 8):
        for steps in (1, 2, 3):
            for rank in LANE_RANKS:
                lane = dataclasses.replace(config, levers=Levers(tail_lane=TailLane(rows, steps, rank)))
                sim = simulate(trace, cost, lane).makespan_s
                out["lanes"].append({"rows": rows, "extra": steps, "key": rank, "sim_s": sim, "over_fifo": sim / fifo})
    for budget in (2048, 4096, 8192, 16384, 32768):
        at = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_batch_tokens=budget))
        out["budgets"].append({"budget": budget, "sim_s": simulate(trace, cost, at).makespan_s})
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), indent=1))
