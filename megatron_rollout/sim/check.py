"""Check the simulator against the engine: fit one cost model on real replays of one trace,
simulate another trace, replay that one for real, and compare makespans; with the oracle's
makespan and the lower bound beside them.

    python -m megatron_rollout.sim.check --model tiny-moe --device cpu --scale 0.05 \
        --conversations 4 --fit-seed 1 --test-seed 2 --schedule off,chunked,mux --rounds 2 --json

What runs: a short warm-up replay per schedule (first-use costs stay out of the fit), then
`--rounds` rounds, each of them: a real replay of the fit trace under every schedule, one cost
model fitted from all of their step records (a forward costs the same under every schedule;
pooling lets mixed, prefill-only and decode-only steps pin each other's coefficients down), then
a real replay of the test trace under every schedule, compared with its simulation under that
round's model. Fitting and testing within one round, close in time, keeps a shared host's load
changes (which move a replay's makespan by several times on a busy 2-core machine) mostly out of
the comparison; the per-round errors and their median are reported. The test trace's error is the
check, the fit trace's is in-sample. Traces are
made with `trace.make.make_trace` from the seeds, or read from `--fit-trace` / `--test-trace`.
Progress goes to the log; the result is one JSON object on stdout.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rollout.engine import EngineConfig, RolloutEngine
from megatron_rollout.engine.records import StepRecord
from megatron_rollout.sim.bounds import lower_bound
from megatron_rollout.sim.cost import CostModel, fit
from megatron_rollout.sim.policy import POLICIES
from megatron_rollout.sim.simulator import SimConfig, simulate
from megatron_rollout.trace.replay import replay
from megatron_rollout.trace.schema import TraceRequest, load_trace

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckResult:
    """One schedule's check; one entry per round in each tuple (seconds)."""

    schedule: str
    fit_real_s: tuple[float, ...]
    fit_sim_s: tuple[float, ...]
    """The fit trace simulated with its own round's cost model (in-sample)."""
    test_real_s: tuple[float, ...]
    test_sim_s: tuple[float, ...]
    errors: tuple[float, ...]
    """test_sim_s / test_real_s - 1, per round."""
    test_error: float
    """The median of `errors`."""
    oracle_s: tuple[float, ...]
    """The test trace simulated with the longest-remaining-chain oracle ordering."""
    policies_s: tuple[dict[str, float], ...]
    """The test trace simulated under every ordering of `policy.POLICIES` (FIFO is the engine's)."""
    lower_bound_s: tuple[float, ...]
    sim_wall_s: float
    """Wall time of simulating the test trace once (the last round)."""


def real_replay(model, config: EngineConfig, trace: Sequence[TraceRequest], seed: int
                ) -> tuple[float, list[StepRecord]]:
    """(makespan, step records) of one replay on a fresh engine."""
    engine = RolloutEngine(model, config)
    details: dict[str, Any] = {}
    report, _ = replay(engine, trace, seed=seed, progress=False, vocab_size=model.cfg.vocab_size,
                       schedule=config.schedule, details=details)
    if report.requests != len(trace):
        raise RuntimeError(f"the replay completed {report.requests} of {len(trace)} requests ({report.summary()}); "
                           f"raise --num-blocks")
    return report.makespan_s, details["records"]


def check(model, configs: Sequence[EngineConfig], fit_trace: Sequence[TraceRequest],
          test_trace: Sequence[TraceRequest], warmup: Sequence[TraceRequest], rounds: int = 1,
          seed: int = 0) -> tuple[list[CostModel], list[CheckResult]]:
    """Each round's cost model and each config's check (module docstring)."""
    for config in configs:
        real_replay(model, config, warmup, seed)
    costs, rows = [], {c.schedule: [] for c in configs}
    for _ in range(rounds):
        fit_real, records = {}, []
        for config in configs:
            fit_real[config.schedule], recs = real_replay(model, config, fit_trace, seed)
            records += recs
        cost = fit(records)
        costs.append(cost)
        logger.info("cost model: %s", cost)
        for config in configs:
            test_real = real_replay(model, config, test_trace, seed)[0]
            sim_config = SimConfig.of_engine(config)
            t0 = time.perf_counter()
            test_sim = simulate(test_trace, cost, sim_config).makespan_s
            wall = time.perf_counter() - t0
            policies = {name: simulate(test_trace, cost, sim_config, policy()).makespan_s
                        for name, policy in POLICIES.items()}
            rows[config.schedule].append((
                fit_real[config.schedule], simulate(fit_trace, cost, sim_config).makespan_s, test_real, test_sim,
                test_sim / test_real - 1, policies["oracle"], policies,
                lower_bound(test_trace, cost, config.scheduler.max_decode_rows).makespan_s, wall))
            logger.info("%s: test trace real %.3f s, simulated %.3f s (%+.1f%%)", config.schedule.value, test_real,
                        test_sim, 100 * (test_sim / test_real - 1))
    results = []
    for config in configs:
        cols = list(zip(*rows[config.schedule]))
        results.append(CheckResult(config.schedule.value, *cols[:5], statistics.median(cols[4]), *cols[5:8],
                                   cols[8][-1]))
    return costs, results


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_rollout.sim.check", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-moe", help="preset name or Hugging Face checkpoint directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--schedule", default="off,chunked,mux", help="comma-separated schedules to check")
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--scale", type=float, default=0.01)
    ap.add_argument("--wait-scale", type=float, default=None)
    ap.add_argument("--profile", default="current")
    ap.add_argument("--fit-seed", type=int, default=1)
    ap.add_argument("--test-seed", type=int, default=2)
    ap.add_argument("--fit-trace", default=None, help="JSONL trace to fit on (instead of --fit-seed)")
    ap.add_argument("--test-trace", default=None, help="JSONL trace to check on (instead of --test-seed)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of fit and test replays (module docstring)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: steadier timings on a shared host)")
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    import torch

    from megatron_rollout.model.checkpoint import load_model
    from megatron_rollout.trace.make import make_trace

    torch.set_num_threads(args.threads)

    def trace(path: str | None, seed: int) -> list[TraceRequest]:
        if path:
            return load_trace(path)
        return make_trace(args.conversations, seed, args.scale, args.wait_scale, profile=args.profile)

    model = load_model(args.model, device=args.device)
    fit_trace, test_trace = trace(args.fit_trace, args.fit_seed), trace(args.test_trace, args.test_seed)
    warmup = make_trace(2, 0, args.scale, args.wait_scale, profile=args.profile)
    configs = [EngineConfig(schedule=name, max_batch_tokens=args.max_batch_tokens, num_blocks=args.num_blocks)
               for name in args.schedule.split(",")]
    costs, results = check(model, configs, fit_trace, test_trace, warmup, args.rounds)
    for r in results:
        logger.info("%s: median error %+.1f%% over %d rounds", r.schedule, 100 * r.test_error, len(r.errors))
    out = {"fit_requests": len(fit_trace), "test_requests": len(test_trace), "costs": [c.to_dict() for c in costs],
           "results": [dataclasses.asdict(r) for r in results]}
    sys.stdout.write((json.dumps(out) if args.json else json.dumps(out, indent=1)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
