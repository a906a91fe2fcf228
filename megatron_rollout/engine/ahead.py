"""Decode ahead: the next decode forward is issued before the host has read this one's tokens.

Why: a decode step's host work (reading the tokens, bookkeeping, planning the next step, its
inputs, the graph launch) ran while the GPU waited: 17-40% of a decode-only window on the H200
(docs/kernels.md). Here, right after a pure decode forward and its draw are issued
(`sampler.PendingDraw`, tokens left on the device), the forward of the step after is issued
too, over the same rows one position further, its token slots copied on the device from the
draw (`Runner.forward_fed`). The host then reads step k's tokens and plans step k+1 while the GPU
runs it. When step k+1's plan arrives, `take` hands over that forward if the plan's decode rows
are all among its rows, in the same lifetimes and positions (a row that finished by a stop
token or an abort in between is simply not taken); anything else drops it.

When a forward is issued ahead (`issue`), all of: one rank (the plan is local), every request of
the engine is decoding in this step (nothing waits to be admitted, so the next plan is most
likely the same rows), no row finishes by length now (it would leave the batch), and the rows'
next KV blocks are free. Its blocks are grown now: the same growth the next step's `decode_row`
makes. Greedy and sampled rows alike: both draws leave their tokens on the device.

Why a dropped or partly taken forward is harmless: it only writes K/V at each row's next
position, in the row's own blocks. A row that continues gets that position written again by the
forward that runs for it; a row that finished had its blocks freed after the forward was issued,
and every later forward is ordered after it on the device (the decode stream's work is joined
into the caller's stream, which every later forward's stream waits on). Weight updates and
`engine.sleep` wait for it first (`drop(wait=True)`). Tokens are the same with and without: the rows'
inputs are the same, only the time the forward is issued moves.

Left out: many ranks, mixed steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rollout.engine.bookkeeping import RequestTable, SampleOwner
from megatron_rollout.engine.sampler import PendingDraw
from megatron_rollout.engine.scheduler import StepPlan
from megatron_rollout.engine.stats import EngineStats
from megatron_rollout.kernels.layout import to_device
from megatron_rollout.runner.base import Runner
from megatron_rollout.types import SpanInput


@dataclass
class Issued:
    """A decode forward issued ahead: its rows, their sample owners, its logits (in flight)."""

    rows: list[SpanInput]
    owners: list[SampleOwner]
    logits: torch.Tensor
    index: dict[int, int]
    """Request id -> row."""
    done: torch.cuda.Event | None


class DecodeAhead:
    def __init__(self, table: RequestTable, runner: Runner, stats: EngineStats) -> None:
        self.table, self.runner, self.stats = table, runner, stats
        self.issued: Issued | None = None

    def issue(self, owners: list[SampleOwner], draw: PendingDraw) -> None:
        """After a pure decode forward over `owners` whose `draw` is in flight: issue the
        next decode forward of the same rows, fed by `draw.tokens`, where the module's rules allow."""
        table = self.table
        if len(owners) != len(table.requests) or not all(self._continues(o) for o in owners):
            return
        pool = table.pool
        if sum(pool.blocks_to_grow(o.request.seq.sid, len(o.request.seq.tokens) + 1) for o in owners) > pool.num_free:
            return
        rows, next_owners = zip(*(table.ahead_row(o.request) for o in owners))
        logits = self.runner.forward_fed(list(rows), draw.tokens)
        if logits is None:
            return
        done = None
        if logits.is_cuda:
            done = torch.cuda.Event()
            done.record()
        self.issued = Issued(list(rows), list(next_owners), logits,
                             {o.request.rid: i for i, o in enumerate(next_owners)}, done)
        self.stats.ahead_issued += 1

    def _continues(self, owner: SampleOwner) -> bool:
        """Live, and not finished by length by the token now being drawn."""
        return self.table.is_live(owner) and not self.table.at_length(owner.request, more=1)

    def take(self, plan: StepPlan) -> tuple[list[SpanInput], list[SampleOwner], torch.Tensor] | None:
        """The rows, owners and logits of the forward issued for this plan's decode rows, or None
        (and it is dropped) if the plan is not a subset of them."""
        issued, self.issued = self.issued, None
        if issued is None:
            return None
        picks = [issued.index.get(rid) for rid in plan.decode]
        if plan.prefill or not picks or None in picks or not all(self._current(issued, i) for i in picks):
            self.stats.ahead_dropped += 1
            return None
        self.stats.ahead_taken += 1
        logits = issued.logits
        if picks != list(range(len(issued.rows))):
            logits = logits[to_device(torch.tensor(picks, dtype=torch.long), logits.device)]
        return [issued.rows[i] for i in picks], [issued.owners[i] for i in picks], logits

    def _current(self, issued: Issued, i: int) -> bool:
        """Row i's request is where the forward found it: same lifetime, its last token accepted."""
        owner, seq = issued.owners[i], issued.owners[i].request.seq
        return (self.table.is_live(owner) and seq.computed == issued.rows[i].span.past
                and len(seq.tokens) == owner.context)

    def drop(self, wait: bool = False) -> None:
        """Forget the forward issued ahead; `wait`: until the device has finished it (before
        weights change in place or the KV is freed)."""
        issued, self.issued = self.issued, None
        if issued is None:
            return
        if wait and issued.done is not None:
            issued.done.synchronize()
        self.stats.ahead_dropped += 1
