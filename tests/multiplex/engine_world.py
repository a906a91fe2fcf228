"""Engine-level multiplex checks on gloo worlds of 2 and 4 ranks, one spawn per world size.

`run_engine_checks(rank, atp, adp)` builds one `DistComm` (default exchanges: P all-gather, D
all-to-all; the router's conflicts derived from them) and runs, in order: the boundary-plan check
and the two fault injections of test_boundary_faults.py, then (4 ranks) the recording of what each
phase really issues for test_conflicts.py, and last the cases of test_engine_ordering.py (one
4-process spawn fewer). A part that raises returns its traceback text.
"""
from __future__ import annotations

import traceback
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron_rollout.engine import EngineConfig, MuxConfig, SamplingParams, SchedulerConfig
from megatron_rollout.forward import BoundaryPoint
from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.types import Axis, Phase

CFG = preset("tiny-moe")
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13]]
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=4)
FAULTS = {2: (1, 3), 4: (2, 4)}  # world size -> (faulty rank, which yield of its first P forward)


def relabel(gen, plan: tuple[BoundaryPoint, ...], kind: str, at: int, seen: list):
    """Test-only fault: P's `at`-th yield reports the next boundary of the plan ("skip") or the
    previous one ("repeat") instead of the real one. The forward itself runs unchanged, so every
    collective still pairs up with the peers': only what the rank *reports* diverges."""
    n = 0
    try:
        while True:
            try:
                point = next(gen)
            except StopIteration as stop:
                return stop.value
            n += 1
            if n == at and kind != "none":
                point = plan[plan.index(point) + (1 if kind == "skip" else -1)]
            seen.append(point)
            yield point
    finally:
        gen.close()


def _run_engine(runtime, model, kind: str, faulty: int, at: int) -> dict:
    from megatron_rollout.engine.schedules.mux import boundary_plan
    from megatron_rollout.multiplex.controller import BoundaryError

    engine = runtime.engine(model, EngineConfig(scheduler=SchedulerConfig(schedule="mux", block_size=4),
                                                mux=MuxConfig(span="fixed:1")))
    plan, seen, forwards = boundary_plan(model, Phase.P), [], [0]
    inner = engine.executor.forward

    def forward(rows, phase):
        gen = inner(rows, phase)
        if phase is not Phase.P:
            return gen
        forwards[0] += 1
        wrong = kind if (dist.get_rank() == faulty and forwards[0] == 1) else "none"
        return relabel(gen, plan, wrong, at, seen if forwards[0] == 1 else [])

    engine.executor.forward = forward
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS] if runtime.leader else []
    try:
        done = {o.request_id: o.result.token_ids for o in runtime.drain(engine)}
    except BoundaryError as exc:
        return {"error": str(exc), "reason": exc.reason, "rank": exc.rank, "seen": seen}
    return {"tokens": [done[i] for i in ids], "seen": seen, "plan": plan,
            "published": engine.schedule.turnstile.records[-1].last_boundary}


@contextmanager
def recording(log: list):
    """Record (op, ranks of the group) of every torch.distributed collective issued inside."""
    names = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
             "all_gather_single": "all_gather", "all_to_all_single": "all_to_all"}
    saved = {name: getattr(dist, name) for name in names if hasattr(dist, name)}  # all_gather_single: torch >= 2.13

    def wrap(name, fn):
        def call(*args, group=None, **kwargs):
            log.append((names[name], tuple(dist.get_process_group_ranks(group))))
            return fn(*args, group=group, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _issued(rank: int, atp: int, adp: int) -> dict:
    """What each phase issues in one forward, per exchange kind: {(phase, kind): sorted (op, ranks)}."""
    from megatron_rollout.comm.dist import CommConfig, DistComm
    from megatron_rollout.comm.groups import ParallelLayout

    out = {}
    for kind in ("allgather", "alltoall"):
        comm = DistComm(ParallelLayout(atp, adp, atp * adp), CommConfig(timeout_s=30, p_exchange=kind,
                                                                          d_exchange=kind))
        model = MoETransformer(CFG, comm=comm).init_weights(seed=3)
        ids = torch.arange(5 + comm.rank(Axis.ADP))[None]  # ATP peers are mirrors: same tokens
        for phase in Phase:
            log: list = []
            with torch.no_grad(), recording(log):
                model(ids, phase)
            out[(phase.value, kind)] = sorted(set(log))
        out["groups"] = {axis.value: comm.groups.ranks(axis) for axis in Axis}
        comm.close()
    return out


def run_engine_checks(rank: int, atp: int, adp: int) -> dict:
    from megatron_rollout.comm.dist import CommConfig, DistComm
    from megatron_rollout.comm.groups import ParallelLayout
    from megatron_rollout.distributed import Runtime
    from megatron_rollout.multiplex.routing import Router, derive_for_exchanges

    out: dict = {}
    config = CommConfig(timeout_s=20)
    comm = DistComm(ParallelLayout(atp, adp, atp * adp), config,
                    router=Router(derive_for_exchanges(atp, adp, config.p_exchange, config.d_exchange)))
    runtime = Runtime(comm, comm.device, timeout_s=20)
    model = MoETransformer(CFG, comm=comm).init_weights(seed=5)
    faulty, at = FAULTS[atp * adp]
    for kind in ("none", "skip", "repeat"):
        try:
            out[kind] = _run_engine(runtime, model, kind, faulty, at)
        except Exception:  # noqa: BLE001 - reported to the test that owns the part
            out[kind] = f"rank {rank} {kind} failed:\n{traceback.format_exc()}"
    comm.close()
    if atp * adp == 4:
        try:
            out["issued"] = _issued(rank, atp, adp)
        except Exception:  # noqa: BLE001
            out["issued"] = f"rank {rank} issued failed:\n{traceback.format_exc()}"
        from tests.multiplex.test_engine_ordering import all_cases

        try:  # last: its naive ATP2/ADP2 case deadlocks on purpose
            out["ordering"] = all_cases(rank)
        except Exception:  # noqa: BLE001
            out["ordering"] = f"rank {rank} ordering failed:\n{traceback.format_exc()}"
    return out
