"""The levers on the critical chain, simulated (`benchmarks.policy_sim --levers`; issue 33).

For each trace, schedule and budget: FIFO and the oracle as the engine runs them, then each lever
of `sim.levers` (and the RL-group orderings of `sim.policy.GROUP_POLICIES`) alone:
- `critical-first:1` (decode priority) under FIFO and under the oracle's ranking, and under `mux`
  with prefill keeping each share of `CRITICAL_SHARE` while the oracle's critical row decodes;
- `overlap:DxP` (P/D side by side, `mux` only) for every decode factor in `OVERLAP_DECODE` and
  prefill factor in `OVERLAP_PREFILL`;
- `spec:R/k/a/c` for every row limit in `SPEC_ROWS`, acceptance in `SPEC_ACCEPTANCE` and overhead
  in `SPEC_OVERHEAD`, drafting `SPEC_DRAFT` tokens;
- `group-stragglers` and `least-generated` with groups of `GROUP_SIZE` consecutive conversations.
Each run keeps its makespan and the breakdown figures of `benchmarks.rollout.BREAKDOWN_FIGURES`
(`SimResult.breakdown`: the critical conversation's queueing, prefill, decode, tool waits; the
engine's busy shares), so a lever's gain can be read off the critical path it shortened.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.rollout import breakdown_figures
from megatron_rollout.engine.api import Schedule
from megatron_rollout.engine.scheduler import SchedulerConfig
from megatron_rollout.sim.bounds import lower_bound
from megatron_rollout.sim.cost import CostModel
from megatron_rollout.sim.levers import Levers, Overlap, Speculation
from megatron_rollout.sim.policy import GROUP_POLICIES, make_policy
from megatron_rollout.sim.simulator import SimConfig, simulate
from megatron_rollout.trace.make import make_trace

CRITICAL_SHARE = (0.25, 0.5, 0.75)
OVERLAP_DECODE = (1.0, 1.25, 1.5, 2.0, 3.3)
OVERLAP_PREFILL = (1.0, 1.2, 1.5)
SPEC_ROWS = (16, 256)
SPEC_DRAFT = 4
SPEC_ACCEPTANCE = (0.25, 0.5, 0.75)
SPEC_OVERHEAD = (1.0, 1.5)
GROUP_SIZE = 8


def variants(schedule: Schedule) -> Iterator[tuple[str, Levers]]:
    """(policy, levers) of every run on one schedule (module docstring)."""
    yield "fifo", Levers()
    yield "oracle", Levers()
    yield "fifo", Levers(critical_first=1)
    yield "oracle", Levers(critical_first=1)
    if schedule is Schedule.MUX:
        for share in CRITICAL_SHARE:
            yield "oracle", Levers(critical_first=1, critical_share=share)
    if schedule is Schedule.MUX:
        for decode_factor in OVERLAP_DECODE:
            for prefill_factor in OVERLAP_PREFILL:
                yield "fifo", Levers(overlap=Overlap(decode_factor, prefill_factor))
    for rows in SPEC_ROWS:
        for a in SPEC_ACCEPTANCE:
            for c in SPEC_OVERHEAD:
                yield "fifo", Levers(speculation=Speculation(rows, SPEC_DRAFT, a, c))
    for name in GROUP_POLICIES:
        yield name, Levers()


def label(policy: str, levers: Levers) -> str:
    return f"{policy}+{levers.label}" if levers.label else policy


def run_trace(conversations: int, seed: int, cost: CostModel, args: Any, log) -> dict[str, Any]:
    """Every variant on one trace; the lower bound beside them."""
    trace = make_trace(conversations, seed, 1.0, None, profile=args.profile)
    bound = lower_bound(trace, cost, args.max_decode_rows)
    entry: dict[str, Any] = {"conversations": conversations, "seed": seed, "requests": len(trace),
                             "lower_bound_s": bound.makespan_s, "chain_s": bound.chain_s, "work_s": bound.work_s,
                             "runs": []}
    for schedule in (Schedule(s) for s in args.schedules.split(",")):
        for budget in (int(b) for b in args.budgets.split(",")):
            sched = SchedulerConfig(schedule, max_batch_tokens=budget, max_decode_rows=args.max_decode_rows)
            for policy, levers in variants(schedule):
                t0 = time.perf_counter()
                config = SimConfig(sched, args.num_blocks, levers, GROUP_SIZE)
                sim = simulate(trace, cost, config, make_policy(policy))
                entry["runs"].append({"schedule": schedule.value, "budget": budget, "variant": label(policy, levers),
                                      "makespan_s": sim.makespan_s, "steps": sim.steps,
                                      "wall_s": time.perf_counter() - t0,
                                      "breakdown": breakdown_figures(sim.breakdown().to_dict())})
                log.info("%d conversations seed %d %s@%d %s: %.2f s", conversations, seed, schedule.value, budget,
                         label(policy, levers), sim.makespan_s)
    return entry


def summary(traces: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per conversations/schedule@budget/variant: medians over seeds of the makespan, of it over
    FIFO's, the oracle's and the lower bound, and of the critical conversation's decode seconds."""
    rows: dict[str, dict[str, list[float]]] = {}
    for t in traces:
        for r in t["runs"]:
            def same(name):
                return next(x["makespan_s"] for x in t["runs"] if x["schedule"] == r["schedule"]
                            and x["budget"] == r["budget"] and x["variant"] == name)
            row = rows.setdefault(f"{t['conversations']}/{r['schedule']}@{r['budget']}/{r['variant']}",
                                  {k: [] for k in ("makespan_s", "over_fifo", "over_oracle", "over_bound",
                                                   "critical_decode_s")})
            row["makespan_s"].append(r["makespan_s"])
            row["over_fifo"].append(r["makespan_s"] / same("fifo"))
            row["over_oracle"].append(r["makespan_s"] / same("oracle"))
            row["over_bound"].append(r["makespan_s"] / t["lower_bound_s"])
            row["critical_decode_s"].append(r["breakdown"].get("critical_decode_s") or float("nan"))
    return {k: {f: statistics.median(v) for f, v in row.items()} for k, row in rows.items()}
