"""What making one kind of cost twice as fast does to the FIFO `mux` makespan (median over seeds
0-2): the decode step's base (weights, launches), its per-context cost (KV reads), the prefill's
every coefficient. Which of the engine's costs the makespan is made of."""
import dataclasses
import json
import statistics
import sys

from benchmarks.policy_sim import MICRO, micro_cost
from megatron_rollout.engine.scheduler import SchedulerConfig
from megatron_rollout.sim.simulator import SimConfig, simulate
from megatron_rollout.trace.make import make_trace

base = micro_cost(MICRO, 1e-4)
halves = {"none": {}, "decode_base": {"decode_base_s": base.decode_base_s / 2},
          "decode_context": {"decode_context_s": base.decode_context_s / 2},
          "prefill": {k: getattr(base, k) / 2 for k in ("prefill_base_s", "prefill_row_s", "prefill_token_s",
                                                         "prefill_pair_s")}}
out = {}
for n in (64, 128):
    for name, change in halves.items():
        cost = dataclasses.replace(base, **change)
        spans = [simulate(make_trace(n, seed, 1.0, None, profile="prefill"), cost,
                          SimConfig(SchedulerConfig("mux", max_batch_tokens=8192), 109_226)).makespan_s
                 for seed in (0, 1, 2)]
        out[f"{n}/{name}"] = {"makespans_s": spans, "median_s": statistics.median(spans)}
        print(n, name, [round(s, 2) for s in spans], file=sys.stderr)
json.dump(out, open(sys.argv[1], "w"), indent=1)
