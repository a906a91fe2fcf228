"""Dispatch domains on torch.distributed all-to-all (gloo on CPU, NCCL on GPU), and the exchange.

The portable backend: it runs wherever torch.distributed does, and is what CPU tests and machines
without DeepEP use (docs/design.md §8). Two domains, one per phase's needs:

- `NormalAllToAllDomain` (P): variable-size all-to-all. The host reads the exchanged counts to
  size the receive, as DeepEP's normal mode does; buffers are allocated per dispatch.
- `LowLatencyAllToAllDomain` (D): static shapes. Each rank sends every peer exactly `max_tokens`
  slots (real rows first, the rest masked with expert id -1), from buffers allocated once, so
  dispatch and combine need no host read of the counts. Two receive slots alternate: at most two
  dispatched results are held at once. With `sync_free` (`CommConfig.counts="device"`) nothing
  in a dispatch reads the device at all: the layout is built without validation reads, the count
  header is consumed where it lies, the sequence number lives on the device (so graph replays and
  eager dispatches count alike) and a disagreement is accumulated there and raised by `check()`
  (`check_domains`) once the forward is over; the experts run through `compute_local_sync_free`.
  This is what a decode CUDA graph captures.
- `PaddedAllToAllDomain` (P, `CommConfig.counts="device"`): the low-latency domain's
  capacity-padded exchange for P's variable-size batches (`CommConfig.p_max_tokens`), one
  dispatch in flight: P is enqueued without the host ever waiting for its counts.

Both send a token once to each EP rank holding at least one of its experts, with its global expert
ids and weights; the receiver runs its own experts on it (weights applied there), and combine sums
the partial results of every rank per token.

`AllToAllExchange` is the model's view (`ExpertExchange.run`): notify -> yield
`BoundaryPoint(layer, MOE_DATA)` -> dispatch -> expert compute -> combine. The ATP ranks of one
replica hold identical tokens, so each dispatches only its 1/ATP slice (rows
[N*r/ATP, N*(r+1)/ATP)) and the combined slices are all-gathered over ATP: every token crosses
the EP group once per replica instead of ATP times, and every ATP rank ends with all N rows.

In sync-free mode the ATP all-gather of the combined slices needs no count exchange either: the
ATP ranks of a replica hold the same N, so every slice's size is known on the host.

Left out: token dropping/capacity factors (a padded domain refuses more than `max_tokens`), FP8
dispatch, expert-major receive layouts (DeepEP low-latency has one: `deepep.py`), and the
count-exchange timeout of the sync-free domains (a missing peer is found by the process group's
own timeout / NCCL watchdog, since no host thread waits on the exchange).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from megatron_rollout.comm.domain import (
    HEADER,
    DispatchDomain,
    DomainState,
    Handle,
    Layout,
    PendingDispatch,
    Received,
    RecvMeta,
    SequenceMismatch,
)
from megatron_rollout.comm.exchange import ExpertExchange, compute_local_sync_free, pack_routing, unpack_routing
from megatron_rollout.forward import BoundaryPoint, Site
from megatron_rollout.types import Axis, Phase

if TYPE_CHECKING:
    from megatron_rollout.comm.facade import Comm
    from megatron_rollout.forward import Experts, Forward

logger = logging.getLogger(__name__)


def _all_to_all(rows: torch.Tensor, send_rows: list[int], recv_rows: list[int], group) -> torch.Tensor:
    out = rows.new_empty((sum(recv_rows), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_rows, send_rows, group=group)
    return out


class _Route(NamedTuple):
    token: torch.Tensor  # [S] source token of each sent row, grouped by destination rank
    send_rows: list[int]  # rows sent to each EP rank
    recv_rows: list[int]  # rows received from each EP rank


class NormalAllToAllDomain(DispatchDomain):
    """P's domain: exact-size all-to-all; one dispatch in flight."""

    max_outstanding = 1

    def __init__(self, name: str, group: dist.ProcessGroup, device: torch.device, timeout_s: float,
                 max_tokens: int = 0) -> None:
        super().__init__(name, group, device, timeout_s)

    def _dispatch(self, pending: PendingDispatch, header: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> tuple[torch.Tensor, RecvMeta, _Route]:
        layout = pending.layout
        _, token = layout.is_token_in_rank.t().nonzero(as_tuple=True)  # by destination rank, then token
        send_rows, recv_rows = layout.tokens_per_rank.tolist(), header[:, 1].tolist()
        recv_x = _all_to_all(x[token], send_rows, recv_rows, self.group)  # [n, H]
        routing = _all_to_all(pack_routing(topk_ids[token], topk_weights[token]), send_rows, recv_rows, self.group)
        ids, weights = unpack_routing(routing, x.dtype)
        meta = RecvMeta(ids, weights, header[:, 1], header[:, HEADER:].sum(0))
        return recv_x, meta, _Route(token, send_rows, recv_rows)

    def _combine(self, handle: Handle, y: torch.Tensor) -> torch.Tensor:
        route: _Route = handle.state
        back = _all_to_all(y, route.recv_rows, route.send_rows, self.group)  # [S, H]
        return y.new_zeros(handle.num_tokens, y.shape[1]).index_add_(0, route.token, back)


class _Slots(NamedTuple):
    grid: torch.Tensor  # [ep, max_tokens] token sent in each slot to each rank; N marks an empty slot
    slot: int  # which receive buffer holds this dispatch's rows


class LowLatencyAllToAllDomain(DispatchDomain):
    """D's domain: static shapes, persistent buffers, two results outstanding at most."""

    max_outstanding = 2
    capacity_field = "d_max_tokens"  # the CommConfig field that sizes `max_tokens` (for error messages)

    def __init__(self, name: str, group: dist.ProcessGroup, device: torch.device, timeout_s: float,
                 max_tokens: int, sync_free: bool = False) -> None:
        super().__init__(name, group, device, timeout_s)
        if max_tokens < 1:
            raise ValueError(f"{name}: a capacity-padded domain needs max_tokens >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.sync_free = sync_free
        """Consume counts and check sequence numbers on the device (see the module docstring)."""
        self._shape: tuple[int, torch.dtype, int] | None = None  # hidden, dtype, topk the buffers were made for
        self._bufs: dict[str, torch.Tensor] = {}
        # sync-free bookkeeping, on the device: the next dispatch's sequence number, and per EP peer
        # how many count messages arrived with another number
        self._dev_seq = torch.zeros((), dtype=torch.int64, device=self.device)
        self._mismatches = torch.zeros(self.ep_size, dtype=torch.int64, device=self.device)

    def _check_layout(self, layout: Layout) -> None:
        if layout.num_tokens > self.max_tokens:
            raise ValueError(f"{self.name}: {layout.num_tokens} tokens exceed the capacity of {self.max_tokens} "
                             f"per rank; raise CommConfig.{self.capacity_field}")

    # ---- sync-free mode ------------------------------------------------------------------------
    def layout(self, topk_ids: torch.Tensor, num_experts: int) -> Layout:
        """As `DispatchDomain.layout`; in sync-free mode without the validation read (an id past
        `num_experts` is clamped to the last rank instead of refused)."""
        if not self.sync_free:
            return super().layout(topk_ids, num_experts)
        ep = self.ep_size
        if num_experts % ep:
            raise ValueError(f"{self.name}: {num_experts} experts do not divide over {ep} EP ranks")
        valid = topk_ids >= 0
        owner = torch.where(valid, (topk_ids // (num_experts // ep)).clamp(max=ep - 1), ep)
        in_rank = torch.zeros(topk_ids.shape[0], ep + 1, dtype=torch.bool, device=topk_ids.device)
        in_rank = in_rank.scatter_(1, owner, True)[:, :ep]
        flat = torch.where(valid, topk_ids.clamp(max=num_experts - 1), num_experts).reshape(-1)
        per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=topk_ids.device)
        per_expert = per_expert.scatter_add_(0, flat, torch.ones_like(flat))[:num_experts]
        return Layout(num_experts, in_rank.sum(0), per_expert, in_rank)

    def _header_seq(self) -> int | torch.Tensor:
        return self._dev_seq if self.sync_free else self.seq

    def _await_header(self, pending: PendingDispatch) -> torch.Tensor:
        if not self.sync_free:
            return super()._await_header(pending)
        pending.work.wait()  # no timeout: the current stream waits for the exchange, the host does not
        seqs = pending.recv_header[:, 0]
        wrong = seqs != self._dev_seq
        self._mismatches.add_(wrong.long())
        self._dev_seq.add_(1)
        return pending.recv_header

    def compute(self, received: Received, experts) -> torch.Tensor:
        if not self.sync_free:
            return super().compute(received, experts)
        meta = received.meta
        return compute_local_sync_free(received.x, meta.topk_ids, meta.topk_weights, experts)

    @property
    def fault_counters(self) -> torch.Tensor:
        """[ep] int64 on the device: count messages from each EP peer that carried another dispatch's
        sequence number since the last reset (a runner snapshots it after a forward)."""
        return self._mismatches

    def check(self, counts: Sequence[int] | None = None) -> None:
        """Raise `SequenceMismatch` (and retire the domain) if some count message since the last
        reset carried another rank's sequence number. `counts`: a host snapshot of
        `fault_counters`; without it the device is read, so call it between forwards."""
        if not self.sync_free or self._retired is not None:
            return
        counts = self._mismatches.tolist() if counts is None else list(counts)
        if any(counts):
            peers = [r for r, c in enumerate(counts) if c]
            self._retire("sequence mismatch found by check()")
            raise SequenceMismatch(
                f"{self.name} on EP rank {self.ep_rank}: count exchange out of order: EP rank(s) {peers} sent "
                f"{[counts[r] for r in peers]} count message(s) numbered for other dispatches (checked on the "
                f"device, after the forward). The ranks issued this domain's dispatches in different orders (or "
                f"some reset it alone). The domain is retired: reset() it on every rank.")

    def reset(self) -> None:
        super().reset()
        self._dev_seq.zero_()
        self._mismatches.zero_()

    def _check_inputs(self, x: torch.Tensor) -> None:
        if self._shape is not None and (x.shape[1], x.dtype) != self._shape[:2]:
            raise ValueError(f"{self.name}: static buffers hold hidden={self._shape[0]} {self._shape[1]}, got "
                             f"hidden={x.shape[1]} {x.dtype}")

    def _buffers(self, hidden: int, dtype: torch.dtype, topk: int) -> dict[str, torch.Tensor]:
        if self._shape is None:
            rows, dev = self.ep_size * self.max_tokens, self.device
            self._bufs = {"send_x": torch.zeros(rows, hidden, dtype=dtype, device=dev),
                          "send_routing": torch.zeros(rows, 2 * topk, device=dev),
                          "recv_x": torch.zeros(2, rows, hidden, dtype=dtype, device=dev),
                          "recv_routing": torch.zeros(2, rows, 2 * topk, device=dev),
                          "back": torch.zeros(rows, hidden, dtype=dtype, device=dev)}
            self._shape = (hidden, dtype, topk)
            logger.debug("%s: allocated static buffers for %d rows x %d", self.name, rows, hidden)
        if self._shape[2] != topk:
            raise ValueError(f"{self.name}: static buffers hold top-{self._shape[2]} routing, got top-{topk}")
        return self._bufs

    def _dispatch(self, pending: PendingDispatch, header: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> tuple[torch.Tensor, RecvMeta, _Slots]:
        n, hidden, topk = x.shape[0], x.shape[1], topk_ids.shape[1]
        ep, cap = self.ep_size, self.max_tokens
        bufs = self._buffers(hidden, x.dtype, topk)
        in_rank = pending.layout.is_token_in_rank  # [N, ep]
        # Slot of token t at rank r = how many earlier tokens go to r; tokens not going to r land in a
        # dropped column. No host read: the shapes stay static.
        slot_of = torch.where(in_rank, in_rank.long().cumsum(0) - 1, cap)
        tokens = torch.arange(n, device=x.device).expand(ep, n)
        grid = torch.full((ep, cap + 1), n, dtype=torch.long, device=x.device)
        grid = grid.scatter_(1, slot_of.t(), tokens)[:, :cap]  # [ep, cap]
        pad_routing = pack_routing(torch.full((1, topk), -1, device=x.device), torch.zeros(1, topk, device=x.device))
        bufs["send_x"].copy_(torch.cat([x, x.new_zeros(1, hidden)])[grid.flatten()])
        bufs["send_routing"].copy_(torch.cat([pack_routing(topk_ids, topk_weights), pad_routing])[grid.flatten()])
        slot = min({0, 1} - {h.state.slot for h in self._outstanding})
        recv_x, recv_routing = bufs["recv_x"][slot], bufs["recv_routing"][slot]
        dist.all_to_all_single(recv_x, bufs["send_x"], group=self.group)
        dist.all_to_all_single(recv_routing, bufs["send_routing"], group=self.group)
        ids, weights = unpack_routing(recv_routing, x.dtype)
        meta = RecvMeta(ids, weights, header[:, 1], header[:, HEADER:].sum(0))
        return recv_x, meta, _Slots(grid, slot)

    def _combine(self, handle: Handle, y: torch.Tensor) -> torch.Tensor:
        slots: _Slots = handle.state
        back = self._bufs["back"]
        dist.all_to_all_single(back, y.contiguous(), group=self.group)
        out = y.new_zeros(handle.num_tokens + 1, y.shape[1]).index_add_(0, slots.grid.flatten(), back)
        return out[: handle.num_tokens]


class PaddedAllToAllDomain(LowLatencyAllToAllDomain):
    """P's domain when counts stay on the device: capacity-padded like D's, one dispatch in flight."""

    max_outstanding = 1
    capacity_field = "p_max_tokens"

    def __init__(self, name: str, group: dist.ProcessGroup, device: torch.device, timeout_s: float,
                 max_tokens: int, sync_free: bool = True) -> None:
        super().__init__(name, group, device, timeout_s, max_tokens, sync_free=True)


def check_domains(comm: "Comm") -> None:
    """Run every sync-free domain's deferred sequence check (`LowLatencyAllToAllDomain.check`).
    Reads the device: a runner calls it once a forward's results are complete, never inside one."""
    from megatron_rollout.types import Phase

    domain_of = getattr(comm, "domain", None)
    for phase in Phase if domain_of is not None else ():
        check = getattr(domain_of(phase), "check", None)
        if check is not None:
            check()


class AllToAllExchange(ExpertExchange):
    """The model's expert exchange over one phase's dispatch domain (split-phase)."""

    data_boundary = True
    kind = "alltoall"

    def __init__(self, comm: "Comm", phase: Phase, domain: DispatchDomain) -> None:
        self.comm, self.phase, self.domain = comm, phase, domain

    def rows(self, num_tokens: int) -> slice:
        """The rows of a replica's tokens that this ATP rank dispatches."""
        size, rank = self.comm.size(Axis.ATP), self.comm.rank(Axis.ATP)
        return slice(num_tokens * rank // size, num_tokens * (rank + 1) // size)

    def run(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: "Experts",
            layer: int) -> "Forward":

        domain, rows = self.domain, self.rows(x.shape[0])
        xs, ids_s, weights_s = x[rows], ids[rows], weights[rows]
        pending = domain.notify(domain.layout(ids_s, experts.num_local * self.comm.size(Axis.EP)))
        try:
            yield BoundaryPoint(layer, Site.MOE_DATA)
        except BaseException:
            # The forward was closed (or aborted) at the boundary: cancel on this rank too; the
            # plan closes it on every rank, so the count exchange completes everywhere.
            if domain.state is DomainState.NOTIFIED:
                domain.cancel(pending)
            raise
        received = domain.dispatch(pending, xs, ids_s, weights_s)
        try:
            y = domain.compute(received, experts)
        except BaseException as exc:
            domain.abandon(f"expert compute failed at layer {layer}: {exc!r}")
            raise
        out = domain.combine(received.handle, y)  # [rows, H]
        if self.comm.size(Axis.ATP) == 1:
            return out
        if not getattr(domain, "sync_free", False):
            return torch.cat(self.comm.all_gather(out, Axis.ATP, self.phase))
        # The replica's ATP ranks hold the same N: every slice's size is known here, so the gather
        # needs no count exchange (each slice padded to the largest, then trimmed).
        n, size = x.shape[0], self.comm.size(Axis.ATP)
        sizes = [n * (r + 1) // size - n * r // size for r in range(size)]
        padded = torch.cat([out, out.new_zeros(max(sizes) - out.shape[0], out.shape[1])])
        gathered = self.comm.all_gather_into(padded, Axis.ATP, self.phase)  # [ATP, max(sizes), H]
        return torch.cat([gathered[r, :m] for r, m in enumerate(sizes)])
