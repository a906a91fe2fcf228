"""`python -m benchmarks.policy_sim`: every priority's simulated makespan on the `prefill` profile,
beside the engine's default, the oracle and the lower bound (issue 33), on the CPU in minutes.

The costs are the H200's, fitted (`sim.cost`, non-negative least squares) to the benchmark's
micro-stage timings of the 12-layer preset (`--micro` of `benchmarks.rollout`: CUDA-graph decode
steps by rows and context, prefill forwards by chunks), stored in the JSON files named by
`--micro`; `--gap-us` is the host's time between forwards (decode ahead hides most of it on the
GPU). The simulator is the engine's planner on modelled state (`sim.simulator`); its error against
real replays is in docs/benchmarks.md. For each trace (`--conversations` x `--seeds`, made by
`trace.make.make_trace` as the rollout benchmark makes them), schedule and budget, every
ordering of `sim.policy.POLICIES` is simulated, and each `--stretch` value of
`SchedulerConfig.stretch_tokens` under `chunked`; the result is one JSON object (`--out`).

`--check` is the bench check of the engine's default priority (`SchedulerConfig.priority`): it
exits 1 when that choice stops being the evidence's. A default other than FIFO must shorten the
median simulated makespan against FIFO on every row (size, schedule, budget); FIFO, the default
while no priority gains (2026-12-02: none, the oracle included, gained more than 0.7%), must not
be beaten by any priority by more than `MARGIN`. Any makespan under the lower bound fails it too
(a broken simulator or bound).

`--levers` runs instead the levers on the critical chain that the engine does not have
(`sim.levers`: decode priority, P/D overlap under `mux`, speculative decoding of the tail; and the
RL-group orderings), each alone against FIFO, the oracle and the lower bound, with the breakdown of
every run (`benchmarks.sim_levers`). Left out: real replays (`benchmarks.rollout --schedules
'mux+most-turns'` runs a priority on the GPU).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from megatron_rollout.engine.api import Schedule
from megatron_rollout.engine.records import StepRecord
from megatron_rollout.engine.scheduler import SchedulerConfig
from megatron_rollout.sim.bounds import lower_bound
from megatron_rollout.sim.cost import CostModel, fit
from megatron_rollout.sim.policy import POLICIES, make_policy
from megatron_rollout.sim.simulator import SimConfig, simulate
from megatron_rollout.trace.make import make_trace

log = logging.getLogger("benchmarks.policy_sim")

MARGIN = 0.01
"""How much shorter than FIFO's a priority's median makespan may be before FIFO stops being the
right default (the simulator's own noise between orderings is about 0.5%)."""

MICRO = ("benchmarks/results/2026-12-02-rollout-vllm-two-settings/micro-flash.json",
         "benchmarks/results/2026-12-02-prefill-fa3-kernels-pdl/micro-fa3/micro-flash.json")
"""Decode steps (the first) and prefill forwards (the second) of the 12-layer preset on one H200, FA3."""
PREFILL_CHUNKS = ([(0, 4096)], [(0, 2048)] * 4, [(2048, 512)] * 8, [(0, 256)])
"""The (past, new) chunks of each micro-stage prefill timing, in its order (`benchmarks.rollout.run_micro`)."""


def micro_cost(paths: tuple[str, ...], gap_s: float) -> CostModel:
    """A cost model fitted to micro-stage timings: each decode step and prefill forward becomes one
    step record (the fit only reads sizes and durations)."""
    records = []
    for path in paths:
        micro = json.loads(Path(path).read_text())["micro"]
        for d in micro.get("decode") or []:
            records.append(StepRecord("D", d["rows"], d["rows"] * d["context"], 0, 0, 0, 0.0, d["graph_ms"] / 1e3))
        for chunks, p in zip(PREFILL_CHUNKS, micro.get("prefill") or []):
            pairs = sum(new * past + new * (new + 1) // 2 for past, new in chunks)
            records.append(StepRecord("P", 0, 0, len(chunks), sum(n for _, n in chunks), pairs, 0.0, p["ms"] / 1e3))
    return dataclasses.replace(fit(records), gap_s=gap_s, mux_segments=1.0)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_levers(args: argparse.Namespace) -> dict[str, Any]:
    """`--levers` (module docstring): one JSON object with every run and the summary."""
    from benchmarks import sim_levers

    cost = micro_cost(tuple(args.micro.split(",")), args.gap_us / 1e6)
    out: dict[str, Any] = {
        "command": "python -m benchmarks.policy_sim " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cost": cost.to_dict(), "micro": args.micro, "profile": args.profile, "num_blocks": args.num_blocks,
        "traces": []}
    for conversations in (int(c) for c in args.conversations.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            out["traces"].append(sim_levers.run_trace(conversations, seed, cost, args, log))
            Path(args.out).write_text(json.dumps(out, indent=1))
    out["summary"] = sim_levers.summary(out["traces"])
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    cost = micro_cost(tuple(args.micro.split(",")), args.gap_us / 1e6)
    log.info("cost model: %s", cost)
    schedules = [Schedule(s) for s in args.schedules.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    stretches = [int(s) for s in args.stretch.split(",") if s]
    out: dict[str, Any] = {
        "command": "python -m benchmarks.policy_sim " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cost": cost.to_dict(), "micro": args.micro, "profile": args.profile, "num_blocks": args.num_blocks,
        "default_priority": SchedulerConfig().priority, "traces": []}
    for conversations in (int(c) for c in args.conversations.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            trace = make_trace(conversations, seed, 1.0, None, profile=args.profile)
            bound = lower_bound(trace, cost, args.max_decode_rows)
            entry: dict[str, Any] = {"conversations": conversations, "seed": seed, "requests": len(trace),
                                     "lower_bound_s": bound.makespan_s, "chain_s": bound.chain_s,
                                     "work_s": bound.work_s, "runs": []}
            for schedule in schedules:
                for budget in budgets:
                    variants = [(name, None) for name in POLICIES]
                    if schedule is Schedule.CHUNKED:
                        variants += [("fifo", s) for s in stretches]
                    for name, stretch in variants:
                        sched = SchedulerConfig(schedule, max_batch_tokens=budget, max_decode_rows=args.max_decode_rows,
                                                stretch_tokens=stretch)
                        t0 = time.perf_counter()
                        sim = simulate(trace, cost, SimConfig(sched, args.num_blocks), make_policy(name))
                        entry["runs"].append({"schedule": schedule.value, "budget": budget, "policy": name,
                                              "stretch_tokens": stretch, "makespan_s": sim.makespan_s,
                                              "preemptions": sim.preemptions, "steps": sim.steps,
                                              "wall_s": time.perf_counter() - t0})
                        log.info("%d conversations seed %d %s@%d %s%s: %.2f s (%.1f s to simulate)", conversations,
                                 seed, schedule.value, budget, name, f" stretch {stretch}" if stretch else "",
                                 sim.makespan_s, entry["runs"][-1]["wall_s"])
            out["traces"].append(entry)
            Path(args.out).write_text(json.dumps(out, indent=1))
    out["summary"] = summary(out)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per (conversations, schedule, budget, policy[, stretch]): the median over seeds of the
    makespan over FIFO's, over the oracle's and over the lower bound."""
    rows: dict[str, dict[str, list[float]]] = {}
    for t in result["traces"]:
        runs = t["runs"]
        for r in runs:
            def same(name):
                return next(x["makespan_s"] for x in runs if x["schedule"] == r["schedule"]
                            and x["budget"] == r["budget"] and x["policy"] == name and x["stretch_tokens"] is None)
            label = f"{t['conversations']}/{r['schedule']}@{r['budget']}/{r['policy']}"
            label += f"/stretch:{r['stretch_tokens']}" if r["stretch_tokens"] else ""
            row = rows.setdefault(label, {"makespan_s": [], "over_fifo": [], "over_oracle": [], "over_bound": []})
            row["makespan_s"].append(r["makespan_s"])
            row["over_fifo"].append(r["makespan_s"] / same("fifo"))
            row["over_oracle"].append(r["makespan_s"] / same("oracle"))
            row["over_bound"].append(r["makespan_s"] / t["lower_bound_s"])
    return {label: {k: _median(v) for k, v in row.items()} for label, row in rows.items()}


def check(result: dict[str, Any]) -> list[str]:
    """What the bench check finds wrong (module docstring); empty when it passes."""
    wrong = []
    chosen = result["default_priority"]
    for t in result["traces"]:
        for r in t["runs"]:
            if r["makespan_s"] < t["lower_bound_s"] * (1 - 1e-9):
                wrong.append(f"{r['policy']} under {r['schedule']}@{r['budget']} on {t['conversations']} conversations "
                             f"seed {t['seed']}: {r['makespan_s']:.3f} s beats the lower bound "
                             f"{t['lower_bound_s']:.3f} s")
    for label, row in result["summary"].items():
        policy = label.split("/")[2]
        if "stretch" in label or policy == "oracle":
            continue
        if chosen != "fifo" and policy == chosen and not row["over_fifo"] < 1.0:
            wrong.append(f"{label}: the default priority {chosen!r} no longer shortens the simulated makespan "
                         f"(median {row['over_fifo']:.4f} of FIFO's)")
        if chosen == "fifo" and row["over_fifo"] < 1.0 - MARGIN:
            wrong.append(f"{label}: {policy!r} is {100 * (1 - row['over_fifo']):.1f}% faster than the default FIFO "
                         f"(median over seeds): make it SchedulerConfig's default, or say why not")
    return wrong


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.policy_sim", description=__doc__.splitlines()[0])
    ap.add_argument("--micro", default=",".join(MICRO), help="micro-stage JSON files the costs are fitted to")
    ap.add_argument("--gap-us", type=float, default=100.0, help="host time between forwards (microseconds)")
    ap.add_argument("--profile", default="prefill")
    ap.add_argument("--conversations", default="64,128")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--schedules", default="off,chunked,mux")
    ap.add_argument("--budgets", default="8192", help="token budgets (max_batch_tokens)")
    ap.add_argument("--stretch", default="65536,262144", help="chunked stretch_tokens values tried under FIFO")
    ap.add_argument("--max-decode-rows", type=int, default=256)
    ap.add_argument("--num-blocks", type=int, default=109_226,
                    help="KV blocks (40 GiB of the 12-layer preset's KV at 16 positions a block, as "
                         "benchmarks.rollout --kv-gb 40)")
    ap.add_argument("--out", default="policy-sim.json")
    ap.add_argument("--check", action="store_true", help="exit 1 when the check fails (module docstring)")
    ap.add_argument("--levers", action="store_true",
                    help="simulate the levers on the critical chain instead of the orderings (module docstring)")
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    if args.levers:
        for label, row in run_levers(args)["summary"].items():
            print(f"{label:<56} makespan {row['makespan_s']:7.2f} s  /fifo {row['over_fifo']:.3f}  "
                  f"/oracle {row['over_oracle']:.3f}  /bound {row['over_bound']:.2f}  "
                  f"critical decode {row['critical_decode_s']:6.2f} s")
        return 0
    result = run(args)
    for label, row in result["summary"].items():
        print(f"{label:<48} makespan {row['makespan_s']:7.2f} s  /fifo {row['over_fifo']:.3f}  "
              f"/oracle {row['over_oracle']:.3f}  /bound {row['over_bound']:.2f}")
    wrong = check(result)
    for line in wrong:
        print("CHECK FAILED:", line)
    return 1 if args.check and wrong else 0


if __name__ == "__main__":
    sys.exit(main())
