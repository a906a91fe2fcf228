"""The all-gather expert exchange: P's full-group path (docs/design.md §5).

Every rank gathers the tokens (and their routing) of all ADP replicas over its ADP group, runs
its own experts on all of them, and a sum over the full group adds each expert's contribution
exactly once (ETP = 1, so every expert lives on exactly one rank of the full group). Each rank
then keeps its own replica's rows. The ATP ranks of a replica hold identical tokens, so each of
them gathers the same rows; they differ only in which experts they run.

This is the path whose full-group all-reduce conflicts with D's ADP all-gather (two ranks can
enqueue them in opposite orders; docs/design.md §5-6), so the exchange yields
`BoundaryPoint(layer, MOE_DATA)` right before that all-reduce: the turnstile orders it after D.

With a `capacity` (device-side counts, `CommConfig.counts`), every replica pads its rows to
`capacity` (padding rows carry expert id -1, so they compute nothing): the all-gathers then have
one shape on every rank, no count is exchanged or read back, each rank finds its own rows at
`replica * capacity`, and the experts run through `compute_local_sync_free`. The price is the
padding: the full-group all-reduce moves ADP x capacity rows whatever the batch.

Left out: sequence parallelism and reduce-scatter variants (every rank materialises all replicas'
rows, which is fine for P's batch sizes and the CPU tests, and is why D defaults to all-to-all).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_rollout.comm.exchange import (
    ExpertExchange,
    compute_local,
    compute_local_sync_free,
    pack_routing,
    unpack_routing,
)
from megatron_rollout.forward import BoundaryPoint, Site
from megatron_rollout.types import Axis, Phase

if TYPE_CHECKING:
    from megatron_rollout.comm.facade import Comm
    from megatron_rollout.forward import Experts, Forward


class AllGatherExchange(ExpertExchange):
    """ADP all-gather -> local experts on every replica's tokens -> FULL all-reduce -> own rows."""

    data_boundary = True
    kind = "allgather"

    def __init__(self, comm: "Comm", phase: Phase, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"AllGatherExchange capacity must be >= 1 or None, got {capacity}")
        self.comm, self.phase, self.capacity = comm, phase, capacity

    @property
    def sync_free(self) -> bool:
        return self.capacity is not None

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: "Experts",
            layer: int) -> "Forward":
        if self.capacity is not None:
            return (yield from self._run_padded(x, ids, weights, experts, layer))
        comm, phase = self.comm, self.phase
        xs = comm.all_gather(x, Axis.ADP, phase)  # per replica: [N_i, H]
        routing = comm.all_gather(pack_routing(ids, weights), Axis.ADP, phase)  # per replica: [N_i, 2k]
        all_ids, all_weights = unpack_routing(torch.cat(routing), x.dtype)
        partial = compute_local(torch.cat(xs), all_ids, all_weights, experts)  # [sum N_i, H]
        yield BoundaryPoint(layer, Site.MOE_DATA)
        total = comm.all_reduce(partial, Axis.FULL, phase)
        start = sum(t.shape[0] for t in xs[: comm.rank(Axis.ADP)])
        return total[start: start + x.shape[0]]

    def _run_padded(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: "Experts",
                    layer: int) -> "Forward":
        comm, phase, cap = self.comm, self.phase, self.capacity
        n, k = ids.shape
        if n > cap:
            field = "p_max_tokens" if phase is Phase.P else "d_max_tokens"
            raise ValueError(f"{phase.value} all-gather exchange at layer {layer}: {n} tokens exceed the padded "
                             f"capacity of {cap} per replica; raise CommConfig.{field}")
        pad = cap - n
        xp = torch.cat([x, x.new_zeros(pad, x.shape[1])])  # [C, H]
        no_expert = pack_routing(ids.new_full((pad, k), -1), weights.new_zeros(pad, k))
        rp = torch.cat([pack_routing(ids, weights), no_expert])  # [C, 2k]
        xs = comm.all_gather_into(xp, Axis.ADP, phase).flatten(0, 1)  # [ADP * C, H]
        all_ids, all_weights = unpack_routing(comm.all_gather_into(rp, Axis.ADP, phase).flatten(0, 1), x.dtype)
        partial = compute_local_sync_free(xs, all_ids, all_weights, experts)  # [ADP * C, H]
        yield BoundaryPoint(layer, Site.MOE_DATA)
        total = comm.all_reduce(partial, Axis.FULL, phase)
        start = comm.rank(Axis.ADP) * cap
        return total[start: start + n]
