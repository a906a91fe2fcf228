"""Both lower bounds on the same traces (`benchmarks.bounds` at the H200 ceilings, `sim.bounds` in
the micro-stage costs), with the sim bound's work split into what it counts."""
import json
import sys

from benchmarks.bounds import model_costs, trace_lower_bound
from benchmarks.policy_sim import MICRO, micro_cost
from megatron_rollout.model.config import PRESETS
from megatron_rollout.sim.bounds import lower_bound
from megatron_rollout.sim.cost import chunk_pairs
from megatron_rollout.trace.make import make_trace
from megatron_rollout.trace.schema import group_conversations

BANDWIDTH, PEAK = 4.22e12, 7.7e14  # the H200 ceilings the rollout benchmark measured (B/s, FLOP/s)
cost = micro_cost(MICRO, 1e-4)
model = model_costs(PRESETS["qwen3-30b-a3b-12l"])


def sim_work_parts(trace):
    """(prefill s, decode rows and context s, the longest conversation's decode steps)."""
    prefill = decode = 0.0
    longest = 0
    for turns in group_conversations(trace).values():
        context = steps = 0
        for t in turns:
            past, new = max(context - 1, 0), t.input_tokens + (1 if context else 0)
            prefill += cost.prefill_row_s + cost.prefill_token_s * new + cost.prefill_pair_s * chunk_pairs(past, new)
            first = past + new
            decode += (t.output_tokens - 1) * cost.decode_row_s \
                + cost.decode_context_s * sum(range(first + 1, first + t.output_tokens))
            steps += t.output_tokens - 1
            context += t.input_tokens + t.output_tokens
        longest = max(longest, steps)
    return prefill, decode, longest


rows = []
for n in (64, 128):
    for seed in (0, 1, 2):
        trace = make_trace(n, seed, 1.0, None, profile="prefill")
        roof = trace_lower_bound(trace, model, PEAK, BANDWIDTH, min(n, 256))
        sim = lower_bound(trace, cost, 256)
        prefill, decode, steps = sim_work_parts(trace)
        rows.append({"n": n, "seed": seed,
                     "flops_bound": {"chain": roof.chain_s, "work": roof.work_s, "flops_s": roof.total_flops / PEAK,
                                     "bytes_s": roof.total_bytes / BANDWIDTH},
                     "sim_bound": {"chain": sim.chain_s, "work": sim.work_s, "prefill_s": prefill,
                                   "decode_rows_context_s": decode, "decode_steps": steps,
                                   "decode_steps_s": steps * (cost.decode_base_s + cost.gap_s)}})
        print(json.dumps(rows[-1]), file=sys.stderr)
json.dump(rows, open("benchmarks/results/2026-12-03-sim-levers/bounds.json", "w"), indent=1)
