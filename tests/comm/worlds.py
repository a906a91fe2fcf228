"""The two multi-process worlds the comm tests share (starting one costs seconds per rank: its
groups, communicators and models), and the per-rank checks they run. Each check returns plain data that the test modules
assert on; `world(n)` runs the n-rank program once per pytest session and caches its results.

4 ranks: DistComm groups and collectives (ATP2/ADP2/EP4), exchanges against the single-process
reference, a P dispatch pending across D rounds, the sharded model for ATP2/ADP2, ATP1/ADP4 and
ATP4/ADP1, the same with counts consumed on the device (no host read inside a forward), and
finally a rendezvous with one rank gone and one late.
2 ranks: exchanges on ATP1/ADP2/EP2, the DeepEP-missing error, the dispatch-domain state machine,
a rank-order (sequence) mismatch, the same found by the deferred device-side check, and a count
exchange whose peer never arrives.
"""
from __future__ import annotations

import logging
import time
import traceback
from typing import Any, Callable

import torch

from megatron_rollout.types import Phase
from tests.world import run_world

logger = logging.getLogger(__name__)

TIMEOUT_S = 30.0  # generous for a loaded CI machine; the failure checks use their own short ones
SHORT_TIMEOUT_S = 2.0
SLACK_S = 10.0  # how late past a timeout a waiting rank may run on a loaded 2-core machine
CHECK_FAILED = "check failed"  # key of a check's traceback in its result


def check(results: dict, name: str, fn: Callable[..., Any], *args: Any) -> None:
    """Run one check; keep its traceback instead of losing the rest of the world's results."""
    try:
        results[name] = fn(*args)
    except Exception:  # noqa: BLE001 - reported by the test that reads this entry
        results[name] = {CHECK_FAILED: traceback.format_exc()}


def get(results: list[dict], name: str) -> list[Any]:
    """Per-rank results of one check; fails with the rank's traceback if it raised."""
    for rank, r in enumerate(results):
        if isinstance(r[name], dict) and CHECK_FAILED in r[name]:
            raise AssertionError(f"rank {rank}, check {name!r} raised:\n{r[name][CHECK_FAILED]}")
    return [r[name] for r in results]


# ---- fixtures built identically on every rank --------------------------------------------------
def moe_cfg():
    from megatron_rollout.model.config import preset

    # 4 query groups and 8 heads so that ATP4 divides attention.
    return preset("tiny-moe")  # 8 heads over 4 KV heads: ATP 1, 2 and 4 split it


def experts_pair(shard, seed: int = 0):
    """(all experts on one process, this rank's slice of the same weights)."""
    from megatron_rollout.comm.facade import Shard
    from megatron_rollout.model.layers import Experts

    cfg = moe_cfg()
    full = Experts(cfg, Shard())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    local = Experts(cfg, shard)
    for k in range(local.num_local):
        local.local_experts[k].load_state_dict(full.local_experts[local.first + k].state_dict())
    return full, local


def routed_tokens(n: int, excluded: set[int], seed: int, num_experts: int = 8, topk: int = 2, hidden: int = 64):
    """x [n, H], ids [n, k] (distinct per token, never in `excluded`), weights [n, k]."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in excluded])
    x = torch.randn(n, hidden, generator=gen)
    ids = torch.zeros(n, topk, dtype=torch.long)
    for t in range(n):
        ids[t] = allowed[torch.randperm(len(allowed), generator=gen)[:topk]]
    return x, ids, torch.rand(n, topk, generator=gen)


# Rounds of (tokens per ADP replica, experts nobody routes to): empty replicas, an all-empty round,
# and rounds where whole EP ranks (experts 6-7, or 0-3) receive nothing.
ROUNDS = [((6, 3), {3}), ((0, 5), {6, 7}), ((0, 0), set()), ((9, 0), {0, 1, 2, 3}), ((4, 7), set())]


def exchange_errors(comm, exchanges: dict[str, Any], rounds=ROUNDS, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> dict[str, list[float]]:
    """Max |exchange - LocalExchange| per round, for this replica's rows (reference: fp32, CPU)."""
    from megatron_rollout.comm.exchange import LocalExchange
    from megatron_rollout.model.layers import run_to_end
    from megatron_rollout.types import Axis

    full, local = experts_pair(comm.shard)
    local = local.to(device=device, dtype=dtype)
    replica = comm.rank(Axis.ADP)
    errors: dict[str, list[float]] = {name: [] for name in exchanges}
    for i, (counts, excluded) in enumerate(rounds):
        x, ids, w = routed_tokens(sum(counts), excluded, seed=100 + i)
        ref = run_to_end(LocalExchange().run(x, ids, w, full, 0))
        rows = slice(sum(counts[:replica]), sum(counts[: replica + 1]))
        mine = [t[rows].to(device) for t in (x, ids, w)]
        mine[0], mine[2] = mine[0].to(dtype), mine[2].to(dtype)
        for name, ex in exchanges.items():
            got = run_to_end(ex.run(*mine, local, i)).float().cpu()
            assert got.shape == ref[rows].shape, (name, got.shape, ref[rows].shape)
            errors[name].append((got - ref[rows]).abs().max().item() if got.numel() else 0.0)
    return errors


# ---- the 4-rank program ------------------------------------------------------------------------
def four_ranks(rank: int) -> dict:
    from megatron_rollout.comm.dist import CommConfig, DistComm
    from megatron_rollout.comm.groups import ParallelLayout
    from tests.comm import programs

    out: dict[str, Any] = {}
    comm = DistComm(ParallelLayout(2, 2, 4), CommConfig(timeout_s=TIMEOUT_S))
    check(out, "groups", programs.groups_info, comm)
    check(out, "collectives", programs.collectives, comm)
    check(out, "all_gather_object", comm.all_gather_object, {"rank": rank, "square": rank * rank}, "step 1")
    check(out, "exchange_atp2", exchange_errors, comm, {"allgather_P": comm.exchange(Phase.P),
                                                        "alltoall_D": comm.exchange(Phase.D)})
    split = DistComm(ParallelLayout(2, 2, 4), CommConfig(timeout_s=TIMEOUT_S, p_exchange="alltoall"))
    check(out, "pending_p_across_d", programs.pending_p_across_d, split)
    check(out, "model_atp2_adp2_p_alltoall", programs.sharded_model, split, [[5, 3], [4]])
    split.close()
    check(out, "model_atp2_adp2", programs.sharded_model, comm, [[5, 3], [4]])
    check(out, "host_counts_reads", programs.host_reads_of_exchanges, comm)
    comm.close()
    for p_kind in ("alltoall", "allgather"):  # counts consumed on the device: P padded, D low-latency
        dev = DistComm(ParallelLayout(2, 2, 4), CommConfig(timeout_s=TIMEOUT_S, counts="device", p_exchange=p_kind,
                                                           p_max_tokens=24, d_max_tokens=16))
        check(out, f"device_counts_p_{p_kind}", programs.device_counts, dev)
        dev.close()
    for (atp, adp), lens in (((1, 4), [[3], [2, 4], [], [6]]), ((4, 1), [[4, 2, 3]])):
        comm = DistComm(ParallelLayout(atp, adp, 4), CommConfig(timeout_s=TIMEOUT_S))
        check(out, f"model_atp{atp}_adp{adp}", programs.sharded_model, comm, lens)
        comm.close()
    out["rendezvous_failure"] = programs.rendezvous_failure(rank)  # last: ranks 2 and 3 leave it
    return out


# ---- the 2-rank program ------------------------------------------------------------------------
def two_ranks(rank: int) -> dict:
    from megatron_rollout.comm.allgather import AllGatherExchange
    from megatron_rollout.comm.dist import CommConfig, DistComm
    from megatron_rollout.comm.groups import ParallelLayout
    from tests.comm import programs

    out: dict[str, Any] = {}
    layout = ParallelLayout(1, 2, 2)
    check(out, "deepep_missing", programs.error_of, lambda: DistComm(layout, CommConfig(backend="deepep")))
    comm = DistComm(layout, CommConfig(timeout_s=TIMEOUT_S, p_exchange="alltoall", d_max_tokens=16))
    P, D = Phase.P, Phase.D
    check(out, "exchange_atp1", exchange_errors, comm, {"allgather_P": AllGatherExchange(comm, P),
                                                        "alltoall_P": comm.exchange(P),
                                                        "alltoall_D": comm.exchange(D)})
    check(out, "normal_transitions", programs.normal_transitions, comm)
    check(out, "low_latency_transitions", programs.low_latency_transitions, comm)
    check(out, "sequence_mismatch", programs.sequence_mismatch, comm, rank)
    dev = DistComm(layout, CommConfig(timeout_s=TIMEOUT_S, counts="device", d_max_tokens=8))
    check(out, "device_sequence_mismatch", programs.device_sequence_mismatch, dev, rank)
    dev.close()
    short = DistComm(layout, CommConfig(timeout_s=SHORT_TIMEOUT_S, p_exchange="alltoall"))
    check(out, "peer_never_notifies", programs.peer_never_notifies, short, rank)
    return out


_RESULTS: dict[int, Any] = {}


def world(n: int) -> list[dict]:
    """The n-rank program's per-rank results (run once per session; a failure is re-raised)."""
    if n not in _RESULTS:
        program = {4: four_ranks, 2: two_ranks}[n]
        start = time.monotonic()
        try:
            _RESULTS[n] = run_world(program, n, timeout=300.0, pg_timeout=TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001 - cached so each test does not respawn
            _RESULTS[n] = exc
        logger.warning("%d-rank comm world: %.1fs", n, time.monotonic() - start)
    if isinstance(_RESULTS[n], BaseException):
        raise _RESULTS[n]
    return _RESULTS[n]
