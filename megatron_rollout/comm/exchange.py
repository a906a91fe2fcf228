"""Expert exchange: how routed tokens reach their experts and come back.

`ExpertExchange.run` is a generator (see `megatron_rollout.forward`): a distributed exchange yields a
`BoundaryPoint` between its count notification and its data movement. `LocalExchange` is the
single-rank case and the reference every distributed exchange is tested against.

Two ways to run this rank's experts on routed rows: `compute_local` sorts the pairs by expert with
per-expert counts read back to the host (exact sizes, the reference), and `compute_local_sync_free`
does the same on the device only (one-hot prefix sums or a stable argsort, masks for pairs of other
ranks and padded rows), so a forward that uses it never waits for the device and can be captured
in a CUDA graph. The sync-free path runs the grouped GEMM when the experts are stacked bf16 on
CUDA (`Experts.stacked`), else every local expert on every row with the pairs' weights as masks
(correct anywhere; meant for CPU tests and small models).
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_rollout.forward import Experts, Forward


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """ids: [N, k] expert ids. Returns (order, token_of_slot, counts): `order` sorts the N*k
    (token, slot) pairs by expert (stable), `token_of_slot[i]` is the token of sorted pair i, and
    `counts[e]` the pairs routed to expert e."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, order // ids.shape[1], counts


def compute_local(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: "Experts") -> torch.Tensor:
    """Weighted sum over this rank's experts of their outputs, for the tokens routed to them.

    x: [N, H]; ids, weights: [N, k] with *global* expert ids. Pairs routed to experts of other
    ranks contribute nothing. Returns [N, H]."""
    local = ids - experts.first
    mine = (local >= 0) & (local < experts.num_local)
    # Route foreign pairs to a sentinel expert past the local ones; they sort last and are dropped.
    order, token, counts = sort_by_expert(torch.where(mine, local, experts.num_local), experts.num_local + 1)
    n_mine = sum(counts[:-1])
    order, token = order[:n_mine], token[:n_mine]
    y = experts.grouped(x[token], counts[:-1])
    out = torch.zeros_like(x)
    return out.index_add_(0, token, y * weights.reshape(-1)[order, None])


ONE_HOT_LIMIT = 1 << 21
"""Pairs x experts up to which `sorted_destinations` uses the one-hot prefix sum (a few MB): on the
H200 at 128 experts and top-8 it is faster up to 2,048 tokens (67.8 against 91.4 us), the stable
argsort from 4,096 (85.0 against 117.3 us; `bench.kernels`' expert sort, docs/kernels.md)."""


def one_hot_ranks(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flat: [P] expert of each pair. Returns (counts [E] int32 pairs per expert, rank [P] int32 the
    pair's position among the pairs of its expert), from a one-hot prefix sum: few kernels, no
    host synchronisation, [E, P] int32 of scratch."""
    pairs = flat.numel()
    if pairs == 0:
        return torch.zeros(num_experts, dtype=torch.int32, device=flat.device), flat.new_empty(0, dtype=torch.int32)
    # [E, P]: the scan runs along the contiguous dim (a scan along dim 0 of [P, E] is a serial loop
    # per column in torch, ~P dependent steps: 0.25 ms per layer at decode sizes)
    onehot = torch.zeros(num_experts, pairs, dtype=torch.int32, device=flat.device)
    onehot.scatter_(0, flat[None, :], 1)
    csum = onehot.cumsum(1, dtype=torch.int32)
    return csum[:, -1], csum.gather(0, flat[None, :]).squeeze(0) - 1


def sorted_destinations(flat: torch.Tensor, num_experts: int, one_hot_limit: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """flat: [P] expert id of each pair, in [0, num_experts). Returns (dest [P] int64: the pair's row
    in expert-sorted, stable order; offsets [E] int32: cumulative pair counts, the groups' end rows).
    No host synchronisation. `one_hot_limit` (default `ONE_HOT_LIMIT`) picks the method."""
    pairs = flat.numel()
    if pairs * num_experts <= (ONE_HOT_LIMIT if one_hot_limit is None else one_hot_limit):
        counts, rank = one_hot_ranks(flat, num_experts)
        offsets = counts.cumsum(0, dtype=torch.int32)
        return ((offsets - counts)[flat] + rank).long(), offsets
    order = torch.argsort(flat, stable=True)
    dest = torch.empty_like(order)
    dest[order] = torch.arange(pairs, device=flat.device)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return dest, counts.cumsum(0, dtype=torch.int32)


def compute_local_sync_free(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                            experts: "Experts") -> torch.Tensor:
    """`compute_local` without a host read: x [N, H]; ids, weights [N, k] with global expert ids
    (ids of other ranks' experts and -1 contribute nothing). Returns [N, H] in x's dtype."""
    n, k = ids.shape
    local = ids - experts.first
    mine = (local >= 0) & (local < experts.num_local)  # [N, k]
    if n == 0:
        return x.new_zeros(x.shape)
    stacked = getattr(experts, "stacked", None)
    if x.is_cuda and stacked is not None and stacked() is not None:
        # Foreign pairs go to a sentinel group past the local experts: they sort last, the grouped
        # GEMM stops at the last local expert's end row, and the mask drops their (unwritten) rows.
        flat = torch.where(mine, local, experts.num_local).reshape(-1)
        dest, offsets = sorted_destinations(flat, experts.num_local + 1)
        token = torch.arange(n * k, device=x.device) // k
        xs = x.new_empty(n * k, x.shape[1])
        xs.index_copy_(0, dest, x.index_select(0, token))  # [P, H], expert-sorted
        ys = experts.grouped_offsets(xs, offsets[: experts.num_local])  # rows past the last offset: unwritten
        y = ys.index_select(0, dest).view(n, k, -1)
        y = torch.where(mine.unsqueeze(-1), y, y.new_zeros(()))
        return (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts.local_experts):  # a static loop: every expert on every row
        coef = (weights * (local == e)).sum(1, keepdim=True).to(x.dtype)  # [N, 1]
        out += coef * expert(x)
    return out


def pack_routing(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """ids, weights: [N, k] -> [N, 2k] float32, so routing crosses ranks in one message.

    Expert ids are exact in float32 (below 2**24); weights round-trip exactly from bf16/fp16/fp32."""
    return torch.cat([ids.to(torch.float32), weights.to(torch.float32)], dim=1)


def unpack_routing(packed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_routing`: [N, 2k] -> ids [N, k] int64, weights [N, k] in `dtype`."""
    k = packed.shape[1] // 2
    return packed[:, :k].to(torch.int64), packed[:, k:].to(dtype)


class ExpertExchange(abc.ABC):
    data_boundary: bool = False
    """`run` yields `BoundaryPoint(layer, MOE_DATA)` once per call (split-phase exchanges); the mux
    schedule's boundary plan reads this instead of guessing from the exchange's type."""
    kind: str | None = None
    """The `CommConfig.p_exchange` / `d_exchange` kind whose collectives it issues ("allgather",
    "alltoall": `multiplex.routing.EXCHANGE_PATHS`); None for an exchange that crosses no rank."""

    @abc.abstractmethod
    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: "Experts",
            layer: int) -> "Forward":
        """Route x [N, H] by ids/weights [N, k] to the experts, return the combined [N, H]."""


class LocalExchange(ExpertExchange):
    def run(self, x, ids, weights, experts, layer):
        return compute_local(x, ids, weights, experts)
        yield  # a generator with no boundary: nothing crosses ranks
