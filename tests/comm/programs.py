"""Per-rank checks run inside the comm worlds (see `worlds.py`). Each returns plain data; the test
modules assert on it. Every rank runs the same calls in the same order unless a check says not."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_rollout.types import Axis, Phase
from tests.comm.worlds import SHORT_TIMEOUT_S, exchange_errors, experts_pair, moe_cfg, routed_tokens


def error_of(fn: Callable[[], Any]) -> str | None:
    """'Type: message' of what fn raises, or None."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def _attempt(log: list, label: str, fn: Callable[[], Any]) -> None:
    error = error_of(fn)
    log.append((label, "ok" if error is None else error.split(":")[0]))


def _ref(x, ids, w, full):
    from megatron_rollout.comm.exchange import LocalExchange
    from megatron_rollout.model.layers import run_to_end

    return run_to_end(LocalExchange().run(x, ids, w, full, 0))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


# ---- DistComm --------------------------------------------------------------------------------
def groups_info(comm) -> dict:
    from megatron.core import parallel_state as ps

    from megatron_rollout.comm.groups import ParallelLayout, init_parallel

    ranks = dist.get_process_group_ranks
    g = comm.group
    return {
        "axes": {a.value: comm.groups.axes[a].groups for a in Axis},
        "mine": {a.value: comm.groups.ranks(a) for a in Axis},
        "megatron": {"ATP": tuple(ranks(ps.get_tensor_model_parallel_group())),
                     "ADP": tuple(ranks(ps.get_data_parallel_group())),
                     "EP": tuple(ranks(ps.get_expert_model_parallel_group()))},
        "rank": {a.value: comm.rank(a) for a in Axis},
        "size": {a.value: comm.size(a) for a in Axis},
        "shard": dataclasses.astuple(comm.shard),
        "phases_apart": all(g(a, Phase.P) is not g(a, Phase.D) for a in Axis),
        "ep_shares_full": g(Axis.EP, Phase.P) is g(Axis.FULL, Phase.P),
        "domain_apart": comm.domain(Phase.D).group not in (g(Axis.EP, Phase.D), g(Axis.EP, Phase.P)),
        "mismatch": error_of(lambda: init_parallel(ParallelLayout(4, 1, 4))),
    }


def collectives(comm) -> dict:
    """Uneven inputs on every axis and phase: rank r gathers [2,0,3,1][r] rows, and sends
    (r + j) % 3 rows to group rank j."""
    rank, out = dist.get_rank(), {}
    for phase in Phase:
        for axis in (Axis.ATP, Axis.ADP, Axis.FULL):
            rows = [2, 0, 3, 1][rank]
            gathered = comm.all_gather(torch.arange(rows * 2.0).view(rows, 2) + 10 * rank, axis, phase)
            chunks = [torch.full(((rank + j) % 3, 2), 100.0 * rank + j) for j in range(comm.size(axis))]
            out[f"{phase.value}/{axis.value}"] = {
                "all_reduce": comm.all_reduce(torch.full((2, 3), rank + 1.0), axis, phase).tolist(),
                "all_gather": [t.tolist() for t in gathered],
                "all_to_all": [t.tolist() for t in comm.all_to_all(chunks, axis, phase)]}
    return out


def pending_p_across_d(comm) -> dict:
    """P's notify is submitted and P stops at its MOE_DATA boundary; D runs three whole rounds on
    its own domain; then P resumes and finishes."""
    from megatron_rollout.model.layers import run_to_end

    full, local = experts_pair(comm.shard)
    replica = comm.rank(Axis.ADP)
    mine = lambda counts: slice(sum(counts[:replica]), sum(counts[: replica + 1]))  # noqa: E731
    p_counts = (7, 4)
    xp, idsp, wp = routed_tokens(sum(p_counts), {5}, seed=1)
    rows = mine(p_counts)
    forward_p = comm.exchange(Phase.P).run(xp[rows], idsp[rows], wp[rows], local, 9)
    point = next(forward_p)
    states, d_errors = [comm.domain(Phase.P).state.value], []
    for i, counts in enumerate([(2, 3), (0, 1), (3, 0)]):
        x, ids, w = routed_tokens(sum(counts), set(), seed=50 + i)
        got = run_to_end(comm.exchange(Phase.D).run(x[mine(counts)], ids[mine(counts)], w[mine(counts)], local, 0))
        d_errors.append(_err(got, _ref(x, ids, w, full)[mine(counts)]))
        states.append((comm.domain(Phase.P).state.value, comm.domain(Phase.D).state.value))
    p_error = _err(run_to_end(forward_p), _ref(xp, idsp, wp, full)[rows])
    return {"boundary": (point.layer, point.site.value), "states": states, "d_errors": d_errors,
            "p_error": p_error, "p_state": comm.domain(Phase.P).state.value,
            "seqs": (comm.domain(Phase.P).seq, comm.domain(Phase.D).seq)}


def sharded_model(comm, lens: list[list[int]], count_reads: bool = False) -> dict:
    """Prefill (phase P) then one decode token per sequence (phase D) on this replica's sequences
    (`lens[replica]`, possibly none), against the unsharded model with the same seed. With
    `count_reads`, the host reads made by the sharded model's forwards are returned too."""
    from megatron_rollout.model.attention import DenseKVCache
    from megatron_rollout.model.layers import run_to_end
    from megatron_rollout.model.transformer import MoETransformer

    cfg = moe_cfg()
    gen = torch.Generator().manual_seed(11)
    prompts = [[torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in rl] for rl in lens]
    nexts = [[torch.randint(0, cfg.vocab_size, (1,), generator=gen) for _ in rl] for rl in lens]
    replica = comm.rank(Axis.ADP)

    reads = HostReads()

    def run(model, counted: bool = False) -> list[torch.Tensor]:
        cache, logits = DenseKVCache(cfg.num_layers, len(prompts[replica])), []
        for phase, toks in ((Phase.P, prompts[replica]), (Phase.D, nexts[replica])):
            cache.begin([len(t) for t in toks])
            tokens = torch.cat(toks) if toks else torch.zeros(0, dtype=torch.long)
            positions = cache.positions() if toks else torch.zeros(0, dtype=torch.long)
            forward = model.step(tokens, positions, cache, phase)
            if counted:
                with reads:
                    logits.append(run_to_end(forward))
            else:
                logits.append(run_to_end(forward))
            cache.end()
        return logits

    ref = run(MoETransformer(cfg).init_weights(seed=7))
    model = MoETransformer(cfg, comm=comm).init_weights(seed=7)
    got = run(model, counted=count_reads)
    out = {"errors": [_err(g, r) for g, r in zip(got, ref)], "shapes": [tuple(g.shape) for g in got],
           "local_experts": model.decoder.layers[1].mlp.experts.num_local,
           "qkv_rows": model.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]}
    return {**out, "host_reads": reads.calls} if count_reads else out


def rendezvous_failure(rank: int) -> dict:
    """A context mismatch first (everyone arrives); then rank 3 leaves (its process ends) and rank 2
    arrives only after the timeout: ranks 0 and 1 must raise RendezvousTimeout naming both."""
    from megatron_rollout.comm.dist import CommConfig, DistComm, RendezvousTimeout, StoreRendezvous
    from megatron_rollout.comm.groups import ParallelLayout

    comm = DistComm(ParallelLayout(2, 2, 4), CommConfig(timeout_s=SHORT_TIMEOUT_S, p_exchange="allgather",
                                                        d_exchange="allgather"))
    out: dict[str, Any] = {"mismatch": error_of(lambda: StoreRendezvous(rank, 4, SHORT_TIMEOUT_S)
                                                .all_gather_object(rank, f"step {1 if rank < 2 else 2}"))}
    if rank == 3:
        return {**out, "role": "left"}
    if rank == 2:
        time.sleep(SHORT_TIMEOUT_S + 2.5)
        return {**out, "role": "late"}
    start = time.monotonic()
    try:
        comm.all_gather_object({"rank": rank}, context="step 12")
        out["error"] = None
    except RendezvousTimeout as exc:
        out.update(error=str(exc), missing=list(exc.missing), context=exc.context)
    out["elapsed"] = time.monotonic() - start
    time.sleep(1.5)  # rank 0 hosts the store: stay until rank 1 has checked which keys are missing
    return out


# ---- dispatch domains --------------------------------------------------------------------------
def normal_transitions(comm) -> dict:
    """Every transition of P's normal domain, legal and illegal, on both ranks alike."""
    d, rank = comm.domain(Phase.P), dist.get_rank()
    full, local = experts_pair(comm.shard)
    x, ids, w = routed_tokens(5, set(), seed=3 + rank)
    ref, log = _ref(x, ids, w, full), []
    layout = d.layout(ids, 8)
    log.append(("start", d.state.value))
    p1 = d.notify(layout)
    _attempt(log, "notify while notified", lambda: d.notify(layout))
    r1 = d.dispatch(p1, x, ids, w)
    log.append(("after dispatch", d.state.value))
    _attempt(log, "dispatch again", lambda: d.dispatch(p1, x, ids, w))
    _attempt(log, "cancel dispatched", lambda: d.cancel(p1))
    _attempt(log, "notify while dispatched", lambda: d.notify(layout))
    y = d.compute(r1, local)
    errors = [_err(d.combine(r1.handle, y), ref)]
    _attempt(log, "combine again", lambda: d.combine(r1.handle, y))
    p2 = d.notify(layout)
    d.cancel(p2)
    log.append(("after cancel", d.state.value))
    _attempt(log, "dispatch cancelled", lambda: d.dispatch(p2, x, ids, w))
    r3 = d.dispatch(d.notify(layout), x, ids, w)
    d.abandon("test: result dropped")
    log.append(("after abandon", d.state.value))
    _attempt(log, "notify retired", lambda: d.notify(layout))
    _attempt(log, "combine retired", lambda: d.combine(r3.handle, y))
    generations = [d.generation]
    d.reset()
    log.append(("after reset", d.state.value))
    _attempt(log, "combine pre-reset handle", lambda: d.combine(r3.handle, d.compute(r3, local)))
    p4 = d.notify(layout)
    d.reset()  # quiescent: completes p4's count exchange first
    _attempt(log, "dispatch pre-reset pending", lambda: d.dispatch(p4, x, ids, w))
    r5 = d.dispatch(d.notify(layout), x, ids, w)
    errors.append(_err(d.combine(r5.handle, d.compute(r5, local)), ref))
    generations.append(d.generation)
    return {"log": log, "errors": errors, "generations": generations, "final": d.state.value}


def low_latency_transitions(comm) -> dict:
    """D's low-latency domain: two results outstanding (double buffer), not three; combines in
    dispatch order; more tokens than its static capacity refused before anything is issued."""
    d, rank = comm.domain(Phase.D), dist.get_rank()
    full, local = experts_pair(comm.shard)
    batches = [routed_tokens(4, set(), seed=20 + rank), routed_tokens(3, {0}, seed=30 + rank)]
    received, log = [d.dispatch(d.notify(d.layout(ids, 8)), x, ids, w) for x, ids, w in batches], []
    log.append(("two outstanding", d.state.value))
    _attempt(log, "third notify", lambda: d.notify(d.layout(batches[0][1], 8)))
    ys = [d.compute(r, local) for r in received]  # the first's rows survived the second dispatch
    _attempt(log, "combine out of order", lambda: d.combine(received[1].handle, ys[1]))
    errors = [_err(d.combine(r.handle, y), _ref(*b, full)) for r, y, b in zip(received, ys, batches)]
    _, big_ids, _ = routed_tokens(d.max_tokens + 1, set(), seed=0)
    _attempt(log, "over capacity", lambda: d.notify(d.layout(big_ids, 8)))
    log.append(("after refusal", d.state.value))
    return {"log": log, "errors": errors, "slots": [r.handle.state.slot for r in received],
            "static_rows": d._bufs["recv_x"].shape[1]}


def sequence_mismatch(comm, rank: int) -> dict:
    """Rank 1 resets D's domain alone after a good round, so the ranks disagree on which dispatch
    comes next: both must raise SequenceMismatch at once; a reset on both recovers."""
    from megatron_rollout.comm.domain import SequenceMismatch

    d, out = comm.domain(Phase.D), {}
    out["before"] = exchange_errors(comm, {"D": comm.exchange(Phase.D)}, rounds=[((2, 2), set())])["D"]
    if rank == 1:
        d.reset()
    x, ids, w = routed_tokens(3, set(), seed=40 + rank)
    pending = d.notify(d.layout(ids, 8))
    start = time.monotonic()
    try:
        d.dispatch(pending, x, ids, w)
        out["error"] = None
    except SequenceMismatch as exc:
        out["error"] = str(exc)
    out["elapsed"], out["state"] = time.monotonic() - start, d.state.value
    out["refused"] = error_of(lambda: d.notify(d.layout(ids, 8)))
    d.reset()
    out["after"] = exchange_errors(comm, {"D": comm.exchange(Phase.D)}, rounds=[((1, 3), {2})])["D"]
    return out


def peer_never_notifies(comm, rank: int) -> dict:
    """Rank 1 never issues P's count exchange: rank 0's dispatch raises DomainTimeout within the
    (short) timeout, and its domain refuses a reset (the communicator failed)."""
    from megatron_rollout.comm.domain import DomainTimeout

    d = comm.domain(Phase.P)
    if rank == 1:
        time.sleep(SHORT_TIMEOUT_S + 1.5)  # alive but absent
        return {"role": "absent"}
    x, ids, w = routed_tokens(3, set(), seed=5)
    pending = d.notify(d.layout(ids, 8))
    start, out = time.monotonic(), {}
    try:
        d.dispatch(pending, x, ids, w)
        out["error"] = None
    except DomainTimeout as exc:
        out["error"] = str(exc)
    out.update(elapsed=time.monotonic() - start, state=d.state.value, reset=error_of(d.reset))
    return out


# ---- GPU programs (run by tests marked gpu / multigpu) --------------------------------------------
def cuda_exchanges(rank: int, backend: str = "alltoall", dtype: torch.dtype = torch.float32) -> dict:
    """Every exchange on CUDA tensors with NCCL communicators (or DeepEP buffers), one GPU per rank."""
    from megatron_rollout.comm.allgather import AllGatherExchange
    from megatron_rollout.comm.dist import CommConfig, DistComm
    from megatron_rollout.comm.groups import ParallelLayout

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    n = dist.get_world_size()
    comm = DistComm(ParallelLayout(1, n, n), CommConfig(backend=backend, timeout_s=60, p_exchange="alltoall",
                                                        d_max_tokens=32), device=device)
    exchanges = {"allgather_P": AllGatherExchange(comm, Phase.P), "alltoall_P": comm.exchange(Phase.P),
                 "alltoall_D": comm.exchange(Phase.D)}
    errors = exchange_errors(comm, exchanges, device=device, dtype=dtype)
    comm.close()
    return {"errors": errors}


# ---- device-side counts (CommConfig.counts="device") ----------------------------------------------
HOST_READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
"""Tensor methods that read a tensor's values on the host (a device sync on CUDA)."""


class HostReads:
    """Counts calls of `HOST_READS` on tensors while active (and where they came from)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __enter__(self) -> "HostReads":
        import traceback

        self._saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        for name, fn in self._saved.items():
            def counting(t, *a, _fn=fn, _name=name, **k):
                self.calls.append(f"{_name} at {traceback.format_stack(limit=3)[0].strip()}")
                return _fn(t, *a, **k)
            setattr(torch.Tensor, name, counting)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)


def device_counts(comm) -> dict:
    """Every exchange of a comm with counts="device" against the reference, with the host reads made
    while they ran (the reference runs outside the count); then the same for the sharded model."""
    from megatron_rollout.comm.allgather import AllGatherExchange
    from megatron_rollout.model.layers import run_to_end

    full, local = experts_pair(comm.shard)
    replica = comm.rank(Axis.ADP)
    exchanges = {"P": comm.exchange(Phase.P), "D": comm.exchange(Phase.D),
                 "allgather_D": AllGatherExchange(comm, Phase.D, capacity=comm.config.d_max_tokens)}
    errors: dict[str, list[float]] = {name: [] for name in exchanges}
    reads = HostReads()
    for i, (counts, excluded) in enumerate([((6, 3), {3}), ((0, 5), {6, 7}), ((0, 0), set()), ((4, 7), set())]):
        x, ids, w = routed_tokens(sum(counts), excluded, seed=200 + i)
        ref = _ref(x, ids, w, full)
        rows = slice(sum(counts[:replica]), sum(counts[: replica + 1]))
        for name, ex in exchanges.items():
            with reads:
                got = run_to_end(ex.run(x[rows], ids[rows], w[rows], local, i))
            errors[name].append(_err(got, ref[rows]))
    kinds = {name: type(getattr(ex, "domain", ex)).__name__ for name, ex in exchanges.items()}
    from megatron_rollout.comm.alltoall import check_domains

    check_domains(comm)  # no mismatch: must not raise
    return {"errors": errors, "host_reads": reads.calls, "kinds": kinds, "sync_free": comm.sync_free,
            "model": sharded_model(comm, [[5, 3], [4]], count_reads=True)}


def device_sequence_mismatch(comm, rank: int) -> dict:
    """Rank 1 resets D's sync-free domain alone: the next dispatch completes on both ranks (nothing
    is read inside it) and `check_domains` afterwards raises SequenceMismatch on both."""
    from megatron_rollout.comm.alltoall import check_domains
    from megatron_rollout.model.layers import run_to_end

    _, local = experts_pair(comm.shard)
    d, out = comm.domain(Phase.D), {}
    x, ids, w = routed_tokens(3, set(), seed=60 + rank)
    run_to_end(comm.exchange(Phase.D).run(x, ids, w, local, 0))
    check_domains(comm)
    if rank == 1:
        d.reset()
    run_to_end(comm.exchange(Phase.D).run(x, ids, w, local, 1))
    out["error"] = error_of(lambda: check_domains(comm))
    out["state"] = d.state.value
    d.reset()
    got = run_to_end(comm.exchange(Phase.D).run(x, ids, w, local, 2))
    out["after"] = error_of(lambda: check_domains(comm))
    out["rows"] = tuple(got.shape)
    return out


def host_reads_of_exchanges(comm) -> int:
    """Host reads made by one run of each of the comm's exchanges (counts="host": the control)."""
    from megatron_rollout.model.layers import run_to_end

    _, local = experts_pair(comm.shard)
    x, ids, w = routed_tokens(4, set(), seed=7)
    reads = HostReads()
    with reads:
        for phase in Phase:
            run_to_end(comm.exchange(phase).run(x, ids, w, local, 0))
    return len(reads.calls)
