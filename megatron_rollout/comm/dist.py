"""`DistComm`: the comm facade over torch.distributed, one communicator per (axis, phase) (docs/design.md §5).

Built once per process, on every rank in the same order (torch's `new_group` demands it):
1. a CPU gloo group over all ranks (`cpu_group`), for planning and rendezvous;
2. Megatron's parallel_state, initialised or read and checked (`groups.init_parallel`);
3. per phase, one communicator for every multi-rank group of every axis (gloo on CPU, NCCL on
   CUDA). Axes of one phase that name the same ranks (EP and FULL when ETP = 1) share that phase's
   communicator: one phase issues its collectives in one order, so sharing a sequence is safe;
   sharing across phases is what must not happen;
4. per phase, its expert exchange as configured: the all-gather path, or a dispatch domain with
   its own communicator (P: normal mode, D: low-latency mode; `CommConfig.backend` picks the
   all-to-all or the DeepEP implementation).

`all_gather_object(obj, context)` goes through the TCP store instead of a collective so that a
rank that died or never came is *named* when the others give up after `timeout_s`
(`RendezvousTimeout`), rather than every rank hanging in a collective. A collective that fails
(gloo's "Timed out waiting ...ms for recv", "Connection closed by peer") is re-raised as
`CrossRankTimeout` naming the dead or stopped ranks (`comm.errors`), with the time it waited.

Left out: pipeline/context parallel groups, communicator tuning (NCCL options, SM limits),
streams (the runner owns those), and rebuilding after a communicator failure (make a new DistComm).
"""
from __future__ import annotations

import importlib
import itertools
import logging
import math
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_rollout.comm.allgather import AllGatherExchange
from megatron_rollout.comm.alltoall import AllToAllExchange
from megatron_rollout.comm.domain import DispatchDomain
from megatron_rollout.comm.errors import CrossRankTimeout, absent_processes, describe, register_peers, this_process
from megatron_rollout.comm.exchange import ExpertExchange
from megatron_rollout.comm.facade import CollectiveRouter, CollectiveSite, Comm
from megatron_rollout.comm.groups import ParallelGroups, ParallelLayout, init_parallel
from megatron_rollout.types import Axis, Phase

logger = logging.getLogger(__name__)

_BACKENDS = ("alltoall", "deepep")
_EXCHANGES = ("allgather", "alltoall")
_COUNTS = ("auto", "host", "device")
# Which kind of dispatch domain each phase owns (docs/design.md §5): wired here, nowhere else.
_DOMAIN_MODE = {Phase.P: "normal", Phase.D: "low_latency"}
_DOMAINS = {("alltoall", "normal"): "megatron_rollout.comm.alltoall:NormalAllToAllDomain",
            ("alltoall", "low_latency"): "megatron_rollout.comm.alltoall:LowLatencyAllToAllDomain",
            ("alltoall", "padded"): "megatron_rollout.comm.alltoall:PaddedAllToAllDomain",
            ("deepep", "normal"): "megatron_rollout.comm.deepep:DeepEPNormalDomain",
            ("deepep", "low_latency"): "megatron_rollout.comm.deepep:DeepEPLowLatencyDomain"}


@dataclass(frozen=True)
class CommConfig:
    """How the rollout communicates."""

    backend: str = "alltoall"
    """Dispatch-domain implementation: "alltoall" (torch.distributed; gloo or NCCL; always there) or
    "deepep" (DeepEP V1 buffers; 2-8 NVLink GPUs per node; fails with an install hint if missing)."""
    timeout_s: float = 60.0
    """Every wait in comm (collectives, count exchanges, rendezvous) fails after this, naming what it
    waited for."""
    p_exchange: str = "allgather"
    """P's expert exchange: "allgather" (ADP all-gather + full-group all-reduce) or "alltoall"
    (P's normal dispatch domain, split at notify)."""
    d_exchange: str = "alltoall"
    """D's expert exchange: "alltoall" (D's low-latency domain) or "allgather"."""
    d_max_tokens: int = 256
    """Most tokens one ADP replica sends through D's low-latency domain per layer (its largest decode
    batch); each ATP rank's static buffers hold ceil(d_max_tokens / ATP) per peer. With device-side
    counts it is also the capacity of D's padded ADP all-gather (`d_exchange="allgather"`)."""
    counts: str = "auto"
    """Where the exchanged counts are consumed: "host" (exact sizes: the host reads every count
    exchange, so a forward waits for the device once per MoE layer), "device" (capacity-padded
    exchanges whose counts travel in header tensors and are consumed by masking on the device: no
    host read inside a P or D forward, decode graphs can capture the exchange; sequence checks are
    deferred to `check_domains`), or "auto" (device on CUDA, host on CPU)."""
    p_max_tokens: int = 4096
    """With device-side counts: most tokens one ADP replica runs through P per layer (at least the
    scheduler's max_batch_tokens); sizes P's padded domain (ceil(p_max_tokens / ATP) per peer) and
    its padded ADP all-gather."""
    trivial_groups: bool = False
    """Build communicators for one-rank groups too, so that a world of one rank issues every
    collective of the multi-rank path through its backend (how that path is tested on one GPU)."""

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"CommConfig.backend must be one of {_BACKENDS}, got {self.backend!r}")
        for name in ("p_exchange", "d_exchange"):
            if getattr(self, name) not in _EXCHANGES:
                raise ValueError(f"CommConfig.{name} must be one of {_EXCHANGES}, got {getattr(self, name)!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"CommConfig.timeout_s must be positive, got {self.timeout_s}")
        if self.d_max_tokens < 1:
            raise ValueError(f"CommConfig.d_max_tokens must be >= 1, got {self.d_max_tokens}")
        if self.counts not in _COUNTS:
            raise ValueError(f"CommConfig.counts must be one of {_COUNTS}, got {self.counts!r}")
        if type(self.p_max_tokens) is not int or self.p_max_tokens < 1:
            raise ValueError(f"CommConfig.p_max_tokens must be an int >= 1, got {self.p_max_tokens!r}")


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup) -> None:
    """`x` from every rank of `group`, concatenated into `out`. torch 2.13 names this
    `all_gather_single` and warns (FutureWarning, once per rank and call site) on the older
    `all_gather_into_tensor`, which is all that torch before it has. Looked up at each call, so a
    test that wraps `torch.distributed`'s collectives sees it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


class RendezvousTimeout(CrossRankTimeout):
    """Some ranks did not reach a rendezvous within the timeout (or the store's host is gone)."""

    def __init__(self, message: str, missing: tuple[int, ...], context: str, elapsed_s: float | None = None,
                 rank: int | None = None, states: dict[int, str] | None = None) -> None:
        super().__init__(message, missing=missing, where=context, elapsed_s=elapsed_s, rank=rank, states=states)
        self.context = context


_FIRST_WAIT_S = 1.0  # a store wait blocks this long, then polls (and checks for dead ranks) this often:
_POLL_S = 0.05


class RendezvousMismatch(RuntimeError):
    """Ranks met at the same rendezvous round with different contexts: their schedules diverged."""


class StoreRendezvous:
    """`all_gather_object` through the TCP store: each rank posts its value under (round, rank) and
    waits for all keys, so on a timeout it can check which ranks' keys are missing. Rounds are
    counted locally; ranks must call in the same order, which the context check verifies."""

    _instances = itertools.count()  # one prefix per instance; instances are built in rank order

    def __init__(self, rank: int, ranks: int | Sequence[int], timeout_s: float, prefix: str | None = None,
                 store: dist.Store | None = None) -> None:
        """`ranks`: the global ranks that meet (an int n means 0..n-1); `prefix` names the keys
        (default: one per instance, instances built in the same order on every rank)."""
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        prefix = prefix or f"megatron_rollout/comm/all_gather_object/{next(self._instances)}/"
        self._store = dist.PrefixStore(prefix, base)
        self.ranks = tuple(range(ranks)) if isinstance(ranks, int) else tuple(ranks)
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not among the rendezvous ranks {list(self.ranks)}")
        self.rank, self.timeout_s = rank, timeout_s
        self._round = 0
        self._failed: str | None = None  # after a failure the ranks' round counters no longer agree

    def all_gather_object(self, obj: Any, context: str) -> list[Any]:
        if self._failed is not None:
            raise RuntimeError(f"all_gather_object {context!r} refused: an earlier rendezvous failed "
                               f"({self._failed}); build a new DistComm")
        k, self._round = self._round, self._round + 1
        keys = [f"{k}/{r}" for r in self.ranks]
        started = time.monotonic()
        try:
            self._store.set(f"{k}/{self.rank}", pickle.dumps((context, obj)))
            self._wait(keys, started)
            values = [pickle.loads(v) for v in self._store.multi_get(keys)]
        except (dist.DistError, RuntimeError) as exc:  # a store timeout, or its host gone
            err = self._timeout(k, keys, context, exc, time.monotonic() - started)
            self._failed = str(err)
            raise err from exc
        contexts = {r: c for r, (c, _) in zip(self.ranks, values)}
        if len(set(contexts.values())) > 1:
            self._failed = f"context mismatch in round {k}"
            raise RendezvousMismatch(f"rendezvous round {k} on rank {self.rank}: ranks arrived with different "
                                     f"contexts {contexts}; their schedules diverged")
        if self._store.add(f"{k}/read", 1) == len(self.ranks):  # the last reader clears the round
            for key in keys + [f"{k}/read"]:
                self._store.delete_key(key)
        return [v for _, v in values]

    def _wait(self, keys: list[str], started: float) -> None:
        """Wait for every key until the timeout: blocking for the first second (the usual case),
        then polling, so that a missing rank whose process is gone (on this host, `comm.errors`)
        ends the wait at once, naming it. (Polling, not repeated short blocking waits: c10d logs a
        warning for each of those that times out.) A stopped rank may resume: it gets the timeout."""
        deadline = started + self.timeout_s
        try:
            self._store.wait(keys, timedelta(seconds=min(_FIRST_WAIT_S, self.timeout_s)))
            return
        except (dist.DistError, RuntimeError) as exc:
            if "timeout" not in str(exc).lower() or time.monotonic() >= deadline:
                raise  # the deadline, or the store's host is gone
        while not self._store.check(keys):
            missing = [r for r, key in zip(self.ranks, keys) if not self._store.check([key])]
            dead = {r: s for r, s in absent_processes(missing).items() if s == "dead"}
            if dead:
                raise RuntimeError(f"ranks {missing} missing: {describe(dead)}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"store wait timeout after {self.timeout_s}s")
            time.sleep(_POLL_S)

    def _timeout(self, k: int, keys: list[str], context: str, exc: Exception, elapsed: float) -> RendezvousTimeout:
        try:
            missing = tuple(r for r, key in zip(self.ranks, keys) if not self._store.check([key]))
            why = "did not arrive"
        except (dist.DistError, RuntimeError):
            missing, why = (0,), "is unreachable (it hosts the TCP store)"
        states = absent_processes()
        how = f"within {self.timeout_s}s" if elapsed >= 0.95 * self.timeout_s else \
            f"(the wait failed after {elapsed:.1f} s of {self.timeout_s}s)"
        msg = (f"rendezvous {context!r} (round {k}) on rank {self.rank}: rank(s) {list(missing)} {why} {how}"
               + (f": {describe(states)}" if states else "") + f" ({type(exc).__name__})")
        logger.error(msg)
        return RendezvousTimeout(msg, missing, context, elapsed_s=elapsed, rank=self.rank, states=states)


def _load(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


class DistComm(Comm):
    """Collectives by (axis, phase) over torch.distributed; see the module docstring for the wiring."""

    def __init__(self, layout: ParallelLayout, config: CommConfig = CommConfig(),
                 device: torch.device | str | None = None, router: CollectiveRouter | None = None) -> None:
        if device is None:  # follow the trainer's default group: NCCL means CUDA tensors, gloo CPU ones
            on_cuda = "nccl" in dist.get_backend()
            device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        self.config, self.device = config, torch.device(device)
        self.router = router
        """Puts the registered conflicting P collective on D's route inside the turnstile's window
        (a `multiplex.routing.Router`); used only while `routing` is on, see `route_collectives`."""
        self.routing = False
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if config.backend == "deepep" and "alltoall" in (config.p_exchange, config.d_exchange):
            from megatron_rollout.comm.deepep import require_deep_ep

            require_deep_ep()  # before any collective, so every rank fails the same way
        self._timeout = timedelta(seconds=config.timeout_s)
        self._owned: list[dist.ProcessGroup] = []
        self.cpu_group = self._new_group(list(range(dist.get_world_size())), "gloo")
        self.groups: ParallelGroups = init_parallel(layout, self.cpu_group, config.timeout_s)
        self._axis_groups = {phase: self._phase_groups(backend) for phase in Phase}
        self._rendezvous = StoreRendezvous(dist.get_rank(), dist.get_world_size(), config.timeout_s)
        # Every rank's (host, pid), so that a failed wait can say which rank is dead or stopped.
        register_peers(dict(enumerate(self._rendezvous.all_gather_object(this_process(), context="processes"))))
        self._domains: dict[Phase, DispatchDomain] = {}
        self.sync_free = config.counts == "device" or (config.counts == "auto" and self.device.type == "cuda")
        """Counts are consumed on the device: no exchange reads them back inside a forward."""
        if self.sync_free and config.backend != "alltoall":
            logger.warning("CommConfig.counts=%r: the %s backend reads its counts on the host; only the all-gather "
                           "paths are sync-free", config.counts, config.backend)
        kinds = {Phase.P: config.p_exchange, Phase.D: config.d_exchange}
        self._exchanges = {phase: self._build_exchange(phase, kinds[phase], backend) for phase in Phase}
        logger.info("DistComm on rank %d: %s, P=%s, D=%s, backend=%s", dist.get_rank(), layout,
                    config.p_exchange, config.d_exchange, backend)

    @classmethod
    def create(cls, layout: ParallelLayout, device: torch.device | str | None = None,
               router: CollectiveRouter | None = None, **config: Any) -> "DistComm":
        """`DistComm(layout, CommConfig(**config), device, router)`, e.g. `create(layout, timeout_s=30)`."""
        return cls(layout, CommConfig(**config), device, router)

    # ---- construction ------------------------------------------------------------------------
    def _new_group(self, ranks: list[int], backend: str) -> dist.ProcessGroup:
        group = dist.new_group(ranks, timeout=self._timeout, backend=backend)
        self._owned.append(group)
        return group

    def _phase_groups(self, backend: str) -> dict[Axis, dist.ProcessGroup | None]:
        """One phase's communicators; every rank creates every group, in one order."""
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for axis in Axis:
            for ranks in self.groups.axes[axis].groups:
                if (len(ranks) > 1 or self.config.trivial_groups) and ranks not in made:
                    made[ranks] = self._new_group(list(ranks), backend)
        return {axis: made.get(self.groups.ranks(axis)) for axis in Axis}

    def _build_exchange(self, phase: Phase, kind: str, backend: str) -> ExpertExchange:
        capacity = self.config.p_max_tokens if phase is Phase.P else self.config.d_max_tokens
        if kind == "allgather":
            return AllGatherExchange(self, phase, capacity if self.sync_free else None)
        padded = self.sync_free and self.config.backend == "alltoall"
        mode = "padded" if padded and phase is Phase.P else _DOMAIN_MODE[phase]
        mine = None
        for ranks in self.groups.axes[Axis.EP].groups:  # the domain's own communicator
            group = self._new_group(list(ranks), backend)
            mine = group if ranks == self.groups.ranks(Axis.EP) else mine
        cls = _load(_DOMAINS[(self.config.backend, mode)])
        per_rank = math.ceil(capacity / self.size(Axis.ATP))
        extra = {"sync_free": True} if padded else {}
        domain = cls(f"{phase.value}/{mode}", mine, self.device, self.config.timeout_s, per_rank, **extra)
        self._domains[phase] = domain
        return AllToAllExchange(self, phase, domain)

    def close(self) -> None:
        """Destroy the communicators this object made (and parallel_state, if it initialised it)."""
        for group in self._owned:
            dist.destroy_process_group(group)
        self._owned.clear()
        if self.groups.owns_parallel_state:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()

    # ---- the facade --------------------------------------------------------------------------
    def size(self, axis: Axis) -> int:
        return self.groups.size(axis)

    def rank(self, axis: Axis) -> int:
        return self.groups.rank_in(axis)

    def group(self, axis: Axis, phase: Phase) -> dist.ProcessGroup | None:
        """The communicator `phase` owns on `axis` (None when the axis has one rank)."""
        return self._axis_groups[phase][axis]

    def exchange(self, phase: Phase) -> ExpertExchange:
        return self._exchanges[phase]

    def domain(self, phase: Phase) -> DispatchDomain | None:
        """The dispatch domain `phase` owns (None when its exchange is the all-gather path)."""
        return self._domains.get(phase)

    def route_collectives(self, on: bool) -> None:
        """Route collectives through `router` (a turnstile-ordered `mux` engine) or run them in
        place (every other schedule: P and D never overlap, so nothing needs ordering)."""
        if on and self.router is None:
            raise ValueError("this DistComm has no router: build it with DistComm(..., router=Router(...)) "
                             "to run the turnstile across ranks")
        self.routing = on

    def _on_route(self, phase: Phase, op: str, axis: Axis, fn, inputs: tuple[torch.Tensor, ...] = ()):
        if not self.routing:
            return self._waiting(f"{op} over {axis.value} ({phase.value})", axis, phase, fn)
        return self.router.run(self.router.route(phase, CollectiveSite(op, axis)),
                               lambda: self._waiting(f"{op} over {axis.value} ({phase.value})", axis, phase, fn),
                               inputs)

    def _waiting(self, what: str, axis: Axis, phase: Phase, fn):
        """Run a collective; a communication failure becomes `CrossRankTimeout` naming who is gone."""
        started = time.monotonic()
        try:
            return fn()
        except CrossRankTimeout:
            raise
        except Exception as exc:
            group = self.group(axis, phase)
            ranks = dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]
            err = CrossRankTimeout.from_collective(f"{what} on rank {dist.get_rank()} (group {ranks})", ranks,
                                                   dist.get_rank(), started, exc, self.config.timeout_s)
            if err is None:
                raise
            logger.error("%s", err)
            raise err from exc

    def all_reduce(self, x: torch.Tensor, axis: Axis, phase: Phase) -> torch.Tensor:
        group = self.group(axis, phase)
        if group is None:
            return x
        x = x.contiguous()
        self._on_route(phase, "all_reduce", axis, lambda: dist.all_reduce(x, group=group), (x,))
        return x

    def all_gather(self, x: torch.Tensor, axis: Axis, phase: Phase) -> list[torch.Tensor]:
        group = self.group(axis, phase)
        if group is None:
            return [x]
        counts = self._waiting(f"all_gather counts over {axis.value} ({phase.value})", axis, phase,
                               lambda: self._gather_counts(x.shape[0], group))
        padded = x.new_zeros((max(counts), *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = [torch.empty_like(padded) for _ in counts]
        self._on_route(phase, "all_gather", axis, lambda: dist.all_gather(out, padded, group=group), (padded,))
        return [t[:n] for t, n in zip(out, counts)]

    def all_gather_into(self, x: torch.Tensor, axis: Axis, phase: Phase) -> torch.Tensor:
        """`x` from every rank of the axis, stacked: [size, *x.shape]. Every rank passes the same shape,
        so no count is exchanged and nothing is read back (capturable in a CUDA graph)."""
        group = self.group(axis, phase)
        if group is None:
            return x.unsqueeze(0)
        x = x.detach().contiguous()  # collectives carry no gradient (gloo refuses to fill views of one)
        out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))  # concatenated: what gloo and NCCL both take
        self._on_route(phase, "all_gather", axis, lambda: _all_gather_single(out, x, group), (x,))
        return out.view(group.size(), *x.shape)

    def all_to_all(self, chunks: list[torch.Tensor], axis: Axis, phase: Phase) -> list[torch.Tensor]:
        if len(chunks) != self.size(axis):
            raise ValueError(f"all_to_all over {axis.value} ({self.size(axis)} ranks) got {len(chunks)} chunks")
        group = self.group(axis, phase)
        if group is None:
            return list(chunks)
        send = [c.shape[0] for c in chunks]
        recv = torch.empty(len(send), dtype=torch.int64, device=self.device)
        counts = torch.tensor(send, device=self.device)
        self._waiting(f"all_to_all counts over {axis.value} ({phase.value})", axis, phase,
                      lambda: dist.all_to_all_single(recv, counts, group=group))
        recv_rows = recv.tolist()
        out = chunks[0].new_empty((sum(recv_rows), *chunks[0].shape[1:]))
        # gloo's list all_to_all needs equal sizes; the single-tensor form takes per-rank splits.
        rows = torch.cat(chunks).contiguous()
        self._waiting(f"all_to_all over {axis.value} ({phase.value})", axis, phase,
                      lambda: dist.all_to_all_single(out, rows, recv_rows, send, group=group))
        return list(out.split(recv_rows))

    def all_gather_object(self, obj: Any, context: str = "") -> list[Any]:
        """`obj` from every rank (rank order). Raises RendezvousTimeout naming the ranks that did not
        arrive within `timeout_s`, and RendezvousMismatch if ranks passed different contexts."""
        return self._rendezvous.all_gather_object(obj, context)

    def _gather_counts(self, n: int, group: dist.ProcessGroup) -> list[int]:
        counts = torch.empty(group.size(), dtype=torch.int64, device=self.device)
        _all_gather_single(counts, torch.tensor([n], device=self.device), group)
        return counts.tolist()
