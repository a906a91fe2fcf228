"""Step execution: a plan's rows -> span inputs -> the runner's forward -> samples -> bookkeeping.

`StepExecutor` is the device side of a step. It asks the `RequestTable` for each row's span (the
table grows or reserves the row's KV blocks), hands the rows to the runner, samples the logits,
and gives each sample back to the table, which advances or finishes its request. Schedules
(`engine.schedules`) decide *when* forwards run and in which phase; this module only runs them.

Left out: planning (the pure `scheduler.plan_step`) and anything that changes which requests exist.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import NamedTuple

import torch

from megatron_rollout.engine.ahead import DecodeAhead
from megatron_rollout.engine.api import FinishReason, RequestOutput
from megatron_rollout.engine.bookkeeping import RequestTable, SampleOwner
from megatron_rollout.engine.records import StepLog, step_record
from megatron_rollout.engine.sampler import PendingDraw
from megatron_rollout.engine.scheduler import PrefillChunk, SchedulerState, StepPlan
from megatron_rollout.engine.stats import EngineStats
from megatron_rollout.forward import Forward, run_to_end
from megatron_rollout.runner.base import Runner
from megatron_rollout.runner.speculative import VerifyRow
from megatron_rollout.types import Phase, SpanInput
from megatron_rollout.weights.store import WeightStore


class StepInputs(NamedTuple):
    """One forward's rows and, in logits-row order, the owner of every row it samples."""

    rows: list[SpanInput]
    owners: list[SampleOwner]
    verify: list[VerifyRow] | None = None
    """Speculative decoding (`engine.drafting`): what the forward returns for each row."""


class StepExecutor:
    graph_outputs: tuple[str, ...] = ()
    """The runner's drafting graphs (`runner.cuda.DecodeOutput` values) this executor replays."""

    def __init__(self, table: RequestTable, runner: Runner, weights: WeightStore, stats: EngineStats, seed: int,
                 timeline=None, rank: int = 0) -> None:
        self.table, self.runner, self.weights, self.stats = table, runner, weights, stats
        self.timeline, self.rank = timeline, rank
        self.generator = torch.Generator().manual_seed(seed)
        """Draws for sampled requests without their own seed."""
        self.ahead: DecodeAhead | None = None
        """Set by the engine where decode ahead is on (`engine.ahead`)."""
        self.log = StepLog()
        """One record per forward run (`engine.records`)."""

    def graph_rows(self, max_rows: int) -> int:
        """One-token graph rows an iteration of up to `max_rows` decode rows needs (drafting: the
        rows and their drafts)."""
        return max_rows

    def inputs(self, decode: Iterable[int], prefill: Iterable[PrefillChunk]) -> StepInputs:
        """Grow/reserve KV for the rows and build the runner's inputs: decode rows first."""
        rows, owners = [], []
        for rid in decode:
            row, owner = self.table.decode_row(rid)
            rows.append(row)
            owners.append(owner)
        for chunk in prefill:
            chunk_rows, chunk_owners = self.table.prefill_rows(chunk)
            rows += chunk_rows
            owners += chunk_owners
        return StepInputs(rows, owners)

    def forward(self, step: StepInputs, phase: Phase) -> Forward:
        """The runner's resumable forward over the step's rows (a `mux` epoch drives it segment by
        segment)."""
        if phase is Phase.D and self.ahead is not None:
            self.ahead.drop()  # a decode forward outside `run` moves the rows past it
        return self.runner.forward(step.rows, phase)

    def planning_view(self, state: SchedulerState) -> SchedulerState:
        """What the planner sees of the table's state (a speculative executor adds its drafts)."""
        return state

    def run(self, plan: StepPlan, phase: Phase) -> list[RequestOutput]:
        """One forward in `phase` over the plan's rows (none: a matched no-work forward), run to its
        end, sampled and completed; a pure decode step takes the forward issued ahead for it, if
        any, and issues the next one before reading its own tokens (`engine.ahead`)."""
        taken = self.ahead.take(plan) if self.ahead is not None else None
        t0 = time.perf_counter()
        rows, owners, logits = taken or (*self.inputs(plan.decode, plan.prefill)[:2], None)
        self.table.note_decode_wait(plan.decode, t0)
        with torch.no_grad():
            if logits is None:
                logits = run_to_end(self.runner.forward(rows, phase))
            owners, logits = self.score(owners, logits)
            draw = self.draw(owners, logits)
            if self.ahead is not None and phase is Phase.D and plan.decode and not plan.prefill \
                    and self.may_issue_ahead(plan):
                self.ahead.issue(owners, draw)  # before this step's tokens reach the host
                if self.ahead.issued is not None:
                    self.after_issue(plan)
        self._record_time(plan, phase, t0)
        outs = self.complete(owners, logits, draw)
        self._record_step(plan, phase, rows, t0)
        return outs

    def may_issue_ahead(self, plan: StepPlan) -> bool:
        """Whether the pure decode step of `plan` may issue the next one ahead (n-gram drafting: only
        when the plan found no drafts, `engine.drafting`)."""
        return True

    def after_issue(self, plan: StepPlan) -> None:
        """Host work of the next plan that needs no token of this step's, done while the GPU runs
        this step's forward and the one just issued ahead (n-gram drafting: its lookups)."""

    def _record_time(self, plan: StepPlan, phase: Phase, t0: float) -> None:
        if self.timeline is not None:
            self.timeline.record(self.rank, phase.value, "prefill" if phase is Phase.P else "decode", t0,
                                 time.perf_counter(), rows=len(plan.decode), prefill=len(plan.prefill))

    def _record_step(self, plan: StepPlan, phase: Phase, rows: list[SpanInput], t0: float) -> None:
        if self.log.enabled:
            self.log.add(step_record(phase.value, rows, len(plan.decode), t0, time.perf_counter()))

    def draw(self, owners: list[SampleOwner], logits: torch.Tensor) -> PendingDraw:
        """Every row's tokens, issued now (`sampler.PendingDraw`), each from its request's own
        generator; a row that forks a request's n samples is drawn n times (`request.SampleGroup`), in order."""
        counts = [self.table.draws(o) for o in owners]
        if all(c == 1 for c in counts):
            return PendingDraw(logits, [o.request.params for o in owners],
                               [o.request.generator or self.generator for o in owners])
        index = [i for i, c in enumerate(counts) for _ in range(c)]
        gens = [g or self.generator for o, c in zip(owners, counts)
                for g in (o.request.group.generators if c > 1 else [o.request.generator])]
        index_t = torch.tensor(index, dtype=torch.long, device=logits.device)
        return PendingDraw(logits[index_t], [owners[i].request.params for i in index], gens)

    def complete(self, owners: list[SampleOwner], logits: torch.Tensor, draw: PendingDraw | None = None,
                 version: int | None = None) -> list[RequestOutput]:
        """Sample one token per owner row and advance its request; rows of stale lifetimes are
        dropped (and draw nothing). A row whose logits are not finite fails its own request only.
        `draw`: every row's draw, issued already (`logits` may be overwritten by a later forward).
        `version`: the weight version the forward ran under, the tokens' tag (default: the current
        one; a forward that spans steps passes the one it started under)."""
        owners, logits = self.score(owners, logits)
        live = [(i, o) for i, o in enumerate(owners) if self.table.is_live(o)]
        if draw is None:
            rows = logits if len(live) == len(owners) else logits[[i for i, _ in live]]
            covered = [o for _, o in live]
            draw, positions = self.draw(covered, rows), range(len(live))
        else:
            covered, positions = owners, [i for i, _ in live]
        # the draw's rows: each covered owner's `draws` tokens, after every earlier owner's
        first = list(itertools.accumulate((self.table.draws(o) for o in covered), initial=0))
        picked = iter(draw.result([r for j in positions for r in range(first[j], first[j + 1])]))
        now, outs = time.perf_counter(), []
        version = self.weights.version if version is None else version
        for j, (_, owner) in zip(positions, live):
            samples = [next(picked) for _ in range(first[j + 1] - first[j])]
            if samples[0].error is not None:
                req = owner.request
                out = self.table.finish(req, FinishReason.ERROR, f"request {req.rid}: {samples[0].error} at position "
                                        f"{owner.context} under weight version {version}")
                outs += [out] if out is not None else []
                continue
            outs += self.table.accept(owner, samples, version, now)
        self._copy_blocks()
        return outs

    def score(self, owners: list[SampleOwner], logits: torch.Tensor) -> tuple[list[SampleOwner], torch.Tensor]:
        """Record the live scoring rows' prompt logprobs (`SampleOwner.scores`; the model's log-softmax:
        the next prompt token's, then the k most likely); the sampling owners and their logits rows."""
        keep = [i for i, o in enumerate(owners) if o.scores is None]
        live = [i for i, o in enumerate(owners) if o.scores is not None and self.table.is_live(o)]
        if live:
            logp = logits[live].float().log_softmax(-1)  # [scored, V]
            target = [owners[i].request.seq.tokens[owners[i].scores + 1] for i in live]
            chosen = logp.gather(-1, torch.tensor(target, device=logp.device)[:, None])[:, 0].tolist()
            top = logp.topk(min(max(owners[i].request.params.prompt_logprobs for i in live), logp.shape[-1]), dim=-1)
            for i, t, c, ids, values in zip(live, target, chosen, top.indices.tolist(), top.values.tolist()):
                want = owners[i].request.params.prompt_logprobs
                self.table.score(owners[i], {t: c} | {k: v for k, v in zip(ids[:want], values[:want]) if k != t})
        return [owners[i] for i in keep], logits[keep] if len(keep) < len(owners) else logits

    def _copy_blocks(self) -> None:
        """Forked samples' KV blocks, copied on the caller's stream (which every later forward waits for)."""
        copies, self.table.copies = self.table.copies, []
        if copies:
            self.runner.cache.copy_blocks([c.src for c in copies], [c.dst for c in copies])
