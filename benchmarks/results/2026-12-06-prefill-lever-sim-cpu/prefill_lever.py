"""Faster prefill, simulated: the fitted per-token and per-pair prefill costs of a schedule (what its
chunks' matmuls and attention take) scaled down as if its prefill steps ran at a larger share of the
matmul rate than measured, everything else (decode, step bases, the host's gaps) as fitted. The cost
model is the experts fit, in sample, to the schedule's repeat 0 of RESULT, on the run's own trace;
SHARE is the run's own share (`benchmarks.step_times`, the median over the schedule's repeats).
Beside it, the decode steps' per-context cost (the KV read) scaled by 0.75 and 0.5 (0.5: a KV cache
of half the bytes, e.g. FP8), alone and with prefill at 0.75 of the rate.

    PYTHONPATH=$PWD python benchmarks/results/2026-12-06-prefill-lever-sim-cpu/prefill_lever.py \
        benchmarks/results/2026-12-06-h100-pdl-peer/t1-inproc8192.json chunked/pdl > t1.json
"""
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from benchmarks.sim_replay import fitted_in_sample
from benchmarks.step_times import step_times
from megatron_rollout.sim.simulator import simulate
from megatron_rollout.trace.schema import load_trace

SHARES = (0.65, 0.7, 0.75, 0.8, 0.9)
KV_FACTORS = (0.75, 0.5)


def main(path: str, schedule: str) -> dict:
    result = json.loads(Path(path).read_text())
    trace = load_trace(Path(path).with_name("trace64.jsonl"))
    config, cost = fitted_in_sample(result, trace, schedule, "experts")
    share = statistics.median(r["prefill_steps"]["share_of_matmul_rate"] for r in step_times(result)[schedule])
    fitted = simulate(trace, cost, config).makespan_s
    vllm = (result.get("vllm") or {}).get("median", {}).get("makespan_s")

    def cell(target: float | None, kv: float = 1.0) -> dict:
        """Prefill at `target` of the matmul rate (None: as measured), the KV read times `kv`."""
        prefill = 1.0 if target is None else share / target
        scaled = dataclasses.replace(cost, prefill_token_s=cost.prefill_token_s * prefill,
                                     prefill_pair_s=cost.prefill_pair_s * prefill,
                                     decode_context_s=cost.decode_context_s * kv)
        sim = simulate(trace, scaled, config).makespan_s
        return {"sim_s": sim, "over_fitted": sim / fitted, "over_vllm": sim / vllm if vllm else None}

    return {"result": path, "schedule": schedule, "fit": f"experts, in sample ({schedule} repeat 0)",
            "measured_s": result["schedules"][schedule]["median"]["makespan_s"], "vllm_s": vllm,
            "measured_share": share, "fitted_sim_s": fitted,
            "shares": [{"share": t, **cell(t)} for t in SHARES],
            "kv_reads": [{"factor": f, "prefill_share": t, **cell(t, f)} for f in KV_FACTORS for t in (None, 0.75)]}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3]), indent=1))
