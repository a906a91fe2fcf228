"""Where the simulated makespan goes under FIFO (and the oracle), per trace: the critical
conversation's path and the engine's busy shares (`SimResult.breakdown`), and what the last tenth
of the makespan ran (mean decode rows of its forwards, its prefill share)."""
import json
import sys

from benchmarks.policy_sim import MICRO, micro_cost
from benchmarks.rollout import breakdown_figures
from megatron_rollout.engine.scheduler import SchedulerConfig
from megatron_rollout.sim.policy import make_policy
from megatron_rollout.sim.simulator import SimConfig, simulate
from megatron_rollout.trace.make import make_trace

cost = micro_cost(MICRO, 1e-4)
rows = []
for n in (64, 128):
    for seed in (0, 1, 2):
        trace = make_trace(n, seed, 1.0, None, profile="prefill")
        for schedule in ("off", "mux"):
            for policy in ("fifo", "oracle"):
                sim = simulate(trace, cost, SimConfig(SchedulerConfig(schedule, max_batch_tokens=8192), 109_226),
                               make_policy(policy))
                b = sim.breakdown()
                tail = [r for r in sim.records if r.start >= 0.9 * sim.makespan_s]
                decode_tail = [r for r in tail if r.decode_rows]
                c = b.critical
                rows.append({
                    "conversations": n, "seed": seed, "schedule": schedule, "policy": policy,
                    "makespan_s": sim.makespan_s, **breakdown_figures(b.to_dict()),
                    "critical_output_tokens": c.output_tokens,
                    "critical_decode_steps": c.output_tokens - c.requests,
                    "decode_forwards": b.forwards["decode"] + b.forwards["mixed"],
                    "tail_mean_decode_rows": sum(r.decode_rows for r in decode_tail) / max(len(decode_tail), 1),
                    "tail_prefill_share": sum(r.duration for r in tail if r.prefill_tokens) / (0.1 * sim.makespan_s),
                })
                print(json.dumps(rows[-1]), file=sys.stderr)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
