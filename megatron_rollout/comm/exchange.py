"""Expert exchange: how routed tokens reach their experts and come back.

`ExpertExchange.run` is a generator (see `megatron_rollout.forward`): a distributed exchange yields a
`BoundaryPoint` between its count notification and its data movement. `LocalExchange` is the
single-rank case and the reference every distributed exchange is tested against.
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

    @abc.abstractmethod
    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: "Experts",
            layer: int) -> "Forward":
        """Route x [N, H] by ids/weights [N, k] to the experts, return the combined [N, H]."""


class LocalExchange(ExpertExchange):
    def run(self, x, ids, weights, experts, layer):
        return compute_local(x, ids, weights, experts)
        yield  # a generator with no boundary: nothing crosses ranks
