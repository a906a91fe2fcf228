"""Speculative decoding inside every schedule: MTP or n-gram drafts, verified in the same decode iteration.

`SpeculativeExecutor` is the step executor of an engine with `EngineConfig.speculative`; the
schedules call the same `inputs`, `forward`, `run` and `complete`, so `off`, `chunked` and `mux`
(its turnstile, its boundaries) are unchanged. One decode iteration, for a row whose pending token
t_n sits at position n with drafts d_1..d_k:
1. one target forward over [t_n, d_1..d_k] gives the logits and hidden states at n..n+k;
2. `speculative.verify` keeps a drafts and adds one token of the target's: 1 to k + 1 tokens whose
   law is the target's (at temperature 0, plain greedy decoding's tokens), with its logprobs;
3. the first MTP layer runs over the confirmed positions n..n+a (hidden h_i, next token t_{i+1}),
   writing its KV, and drafts d'_1 from its last position; d'_2.. come from the same layer chained
   on its own output (the KV it writes there is rewritten by the next iteration's step 3).
Under `mux` the three are one D slot of a turnstile round. Rejected drafts are rolled back in the
bookkeeping: `computed` stops after the accepted positions and the next forward overwrites the K/V
past it. Prefill forwards run the MTP layer inside the forward (inside `mux`'s P segments, whose
boundaries count its layer) over every position whose next token is known; the last prompt
position waits for the sampled token: step 3 of the same step under `off` and `chunked`, the row's
first decode iteration after a `mux` epoch (`Deferred`). A missing or stale MTP KV entry lowers
the acceptance rate only: every token is the target's. The planner sees drafts as lookahead
(`SeqView.lookahead`); acceptance is counted in `EngineStats`.

With `SpeculativeConfig(method="ngram")` the drafts are prompt lookup in the row's own context
(`drafts.ngram`), made on the host when the step is planned: step 1 is a target forward alone (no
MTP layer anywhere, any model), step 3 does not exist, and a row whose context proposes nothing
decodes plainly in the same forward. The drafts are token ids with no law: q is one-hot, which
`verify` treats exactly at any temperature. A request for n > 1 samples (an RL group sharing its
prompt) has its prompt's last position drawn once per sample, each from the sample's generator:
that forks the samples (`RequestTable.accept`), and each drafts from its own context from then on;
with `SpeculativeConfig.group` also from its siblings' text, the sessions continued from them
included (`Seq.family`, `drafts.Family`).
MTP drafting refuses n > 1 (one hidden state per prompt), and top and prompt logprobs. n-gram
drafting serves both: a request for top logprobs decodes undrafted, through the plain draw, and a
prefill's prompt positions are scored as the plain executor scores them. Under `tail_rows` the
plan gives drafts room only while few rows decode, and `tail_k` drafts longer guesses while very
few do: the planner's input decides both, so every rank of a replica agrees. Under `streak_k` a row
whose last draft was kept whole drafts that many: its verdicts, which every rank computes alike, decide.

The forwards are the runner's (`Runner.forward_hidden`, `Runner.forward_mtp`): the portable one,
or the CUDA runner on one rank, whose decode graphs run them as one-query rows
(`runner.speculative`). Greedy rows are verified and drafted from one host read of every row's
argmax and logprob (`_best`); sampled rows with lookup drafts or none all at once, on the device
(`engine.speculative.verify_lookup`), sampled MTP drafts row by row (`engine.speculative.verify`).

A pure decode step of n-gram drafting in which no row carries drafts (nothing repeats, or
`tail_rows` holds them back) runs as the plain executor's step where the engine decodes ahead
(`engine.ahead`: one rank, `RunnerConfig.decode_ahead` "auto" on the CUDA runner, or "on"): on the
plain decode graphs, and, when the plan's lookup found drafts for no row, issuing
the next forward before reading its tokens. The lookups the next plan needs are then made right
after that forward is issued (`after_issue`), while the GPU runs, not between its forwards; rows
they find drafts for wait one step for them, so the forward is taken, not thrown away. A prompt's
context is copied and hashed while the prefill forward that ends it runs (`_prepare`). Tokens are
the same either way: a row without drafts draws as the plain sampler does. Left out: the CUDA
runner on many ranks, decode ahead for MTP drafting and for drafted steps, the naive ordering
baseline, MTP layers beyond the first.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from megatron_rollout.drafts import Family, NgramIndex
from megatron_rollout.engine.api import FinishReason, RequestOutput, SamplingParams
from megatron_rollout.engine.bookkeeping import RequestTable, SampleOwner
from megatron_rollout.engine.config import SpeculativeConfig
from megatron_rollout.engine.execution import StepExecutor, StepInputs
from megatron_rollout.engine.request import Request, Sampled, Seq
from megatron_rollout.engine.sampler import PendingDraw, filtered_logprobs, non_finite
from megatron_rollout.engine.scheduler import PrefillChunk, SchedulerState, Stage, StepPlan
from megatron_rollout.engine.speculative import LookupRow, Verdict, draw_index, verify, verify_lookup
from megatron_rollout.engine.stats import EngineStats
from megatron_rollout.forward import Forward, run_to_end
from megatron_rollout.runner.base import Runner
from megatron_rollout.runner.speculative import SpecOutput, VerifyRow, verify_forward
from megatron_rollout.types import Phase, SeqSpan
from megatron_rollout.weights.store import WeightStore


@dataclass(frozen=True)
class Draft:
    """A decoding row's drafted tokens for its next iteration."""

    lifetime: int
    tokens: tuple[int, ...]
    logq: torch.Tensor | None
    """[len(tokens), V]: the law q_i each draft was drawn from (log); None: greedy drafts (one-hot q)."""


@dataclass(frozen=True)
class Deferred:
    """The decoder's hidden state [H] at a row's last prompt position, kept from a `mux` epoch until
    the row's first decode iteration runs the MTP layer there (its next token was not known before)."""

    lifetime: int
    position: int
    hidden: torch.Tensor


class _Best(NamedTuple):
    """One logits row's greedy choice, read to the host with every other row's at once."""

    token: int
    logprob: float
    """log_softmax at `token`, as the plain greedy sampler reports it."""
    finite: bool


def _best(logits: torch.Tensor) -> list[_Best]:
    """Greedy choice of every row of `logits` [rows, V] in one host read (not one per row: on the
    CUDA runner's graphs per-row reads would cost more than the forward)."""
    logp = logits.float().log_softmax(-1)
    token = logp.argmax(-1)
    host = torch.stack([token.double(), logp.gather(-1, token[:, None])[:, 0].double(),
                        logits.float().amax(-1).isfinite().double()]).tolist()
    return [_Best(int(t), lp, bool(f)) for t, lp, f in zip(*host)]


@dataclass
class _Row:
    """One sampled row of a speculative step, from its verdict to its acceptance."""

    owner: SampleOwner
    first: int
    """Position of its first logits row (n for a decode row, the last prompt position for a prefill)."""
    table: tuple[int, ...]
    hidden: torch.Tensor | None
    """[logits rows, H] (MTP drafts from it); None for n-gram drafts."""
    verdict: Verdict | None
    error: str | None = None
    samples: list[Sampled] | None = None
    """The plain draw's tokens, in place of a verdict: a prompt's last position drawn once per sample
    of an n > 1 request (`request.SampleGroup`), which forks its samples, each decoding (and
    drafting) on its own from then on; or an undrafted row's one token with its top logprobs."""


class SpeculativeExecutor(StepExecutor):
    def __init__(self, table: RequestTable, runner: Runner, weights: WeightStore, stats: EngineStats, seed: int,
                 config: SpeculativeConfig, timeline=None, rank: int = 0) -> None:
        model = runner.model
        self.mtp = config.method == "mtp"
        if self.mtp and not model.cfg.mtp_num_layers:
            raise ValueError("EngineConfig.speculative (method 'mtp') needs a model with an MTP layer, this one has "
                             "mtp_num_layers=0: load a checkpoint that has one (DeepSeek-V3's) or build one with "
                             "mtp_num_layers >= 1, or leave EngineConfig.speculative None")
        if getattr(runner, "multi_rank", False):  # a CudaRunner whose comm crosses ranks
            raise ValueError(f"speculative decoding (EngineConfig.speculative) on {type(runner).__name__} runs on "
                             f"one rank: its verify and draft graphs are not captured collectively; on many ranks "
                             f"pass RunnerConfig(kind='eager') (or 'auto', which picks it)")
        super().__init__(table, runner, weights, stats, seed, timeline, rank)
        self.model, self.k, self.config = model, config.k, config
        self.graph_outputs = ("hidden", "mtp") if self.mtp else ("hidden",)  # verify; MTP also drafts
        self.mtp_norm = model.mtp.layers[0].final_layernorm if self.mtp else None
        self.drafts: dict[int, Draft] = {}
        self.whole: set[int] = set()
        """The requests whose last draft was kept whole (`SpeculativeConfig.streak_k`), by id."""
        self.deferred: dict[int, Deferred] = {}
        self.contexts: dict[int, NgramIndex] = {}
        """"ngram": each sequence's tokens as the lookup holds them, by sequence id."""
        self.families: dict[int, Family] = {}
        """`SpeculativeConfig.group`: each RL group's sequences and their indices, by `Seq.family`; a
        closed one's kept while its family has an open one: its text is what the family's laggards copy."""
        self.unserved: dict[str, str] = {}
        """What a request may not ask for under this executor (`RequestTable.unserved`). n-gram drafting
        serves everything: a request for top logprobs decodes undrafted, prompt logprobs are scored."""
        if self.mtp:  # n samples would each need their own MTP state for the prompt's last position
            why = ("speculative decoding by MTP verifies tokens and returns each one's own logprob "
                   "(EngineConfig.speculative method 'mtp'; 'ngram' serves it)")
            self.unserved = {"logprobs": why, "prompt_logprobs": why, "n": (
                "speculative decoding by MTP keeps one hidden state of the prompt's last position, not one per "
                "sample (EngineConfig.speculative method 'mtp'; 'ngram' serves n > 1)")}

    def graph_rows(self, max_rows: int) -> int:
        return self.config.graph_rows(max_rows)

    # -- planning and inputs ----------------------------------------------------------------------
    def planning_view(self, state: SchedulerState) -> SchedulerState:
        """Each decoding row with drafts looks `len(drafts)` positions ahead ("ngram": drafted now);
        none does while more than `tail_rows` rows decode."""
        decoding = [v.rid for v in state.seqs if v.stage is Stage.DECODE]
        if self.config.tail_rows is not None and len(decoding) > self.config.tail_rows:
            if not self.mtp:
                self.drafts.clear()  # looked up afresh at each plan: none while the tail has not begun
            return state
        if not self.mtp:
            if self.ahead is not None and self.ahead.issued is not None:
                return state  # that forward carries no drafts; its rows were looked up when it was issued
            self._look_up(decoding, len(decoding))
        seqs = tuple(v.ahead(len(d.tokens)) if v.stage is Stage.DECODE and (d := self._draft(v.rid)) is not None
                     else v for v in state.seqs)
        return dataclasses.replace(state, seqs=seqs)

    def _look_up(self, rids: Sequence[int], rows: int) -> None:
        """"ngram": each row's drafts for the step being planned, `rows` rows decoding (as many as
        `SpeculativeConfig.k_at` gives the row), from its context as it stands now."""
        for rid in rids:
            req = self.table.requests[rid]
            if req.params.logprobs is not None:  # its top logprobs come from the plain draw: never drafted
                continue
            seq, budget = req.seq, self._budget(req, 0, self.config.k_at(rows, rid in self.whole))
            context = self._context(seq)
            context.sync(seq.tokens)
            family = self._family(seq, context) if self.config.group and seq.family is not None else None
            if family is not None:
                drafted, copied = family.propose(seq.sid, budget)
                self.stats.copied_drafts += len(drafted) if copied else 0
            else:
                drafted = context.propose(budget)
            if drafted:
                self.drafts[rid] = Draft(req.lifetime, drafted, None)
            else:
                self.drafts.pop(rid, None)

    def after_issue(self, plan: StepPlan) -> None:
        """"ngram": the lookups of the next plan (`planning_view` skips them while a forward issued
        ahead is in flight), made now while the GPU runs, from the tokens the host holds (a step
        older than the plan's), so a row that starts to repeat drafts a step later. The step after
        is issued ahead only if they found no drafts (`may_issue_ahead`)."""
        rows = len(plan.decode)
        if self.config.tail_rows is None or rows <= self.config.tail_rows:
            self._look_up(plan.decode, rows)

    def _context(self, seq: Seq) -> NgramIndex:
        context = self.contexts.get(seq.sid)
        if context is None:
            context = self.contexts[seq.sid] = NgramIndex(self.config.ngram_min, self.config.ngram_max)
        return context

    def _prepare(self, requests: Iterable[Request]) -> None:
        """"ngram": the contexts of requests whose prefill ends in the forward now running, synced and
        hashed while it runs (`NgramIndex.prepare`), so that their first lookup, the next plan's, pays
        for the sampled token only and not for the turn's input (milliseconds while the GPU waits)."""
        if self.mtp:
            return
        for req in requests:
            if req.params.logprobs is None:  # never drafted (`_look_up`)
                self._context(req.seq).prepare(req.seq.tokens)

    def _family(self, seq: Seq, context: NgramIndex) -> Family:
        """`seq`'s family, `seq` a member: a session may have drafted alone before a turn with n > 1
        made it sample 0 of one."""
        family = self.families.setdefault(seq.family, Family())
        if seq.sid not in family.members:
            family.join(seq.sid, seq.tokens, context)
        return family

    def _draft(self, rid: int) -> Draft | None:
        draft, req = self.drafts.get(rid), self.table.requests.get(rid)
        return draft if draft is not None and req is not None and draft.lifetime == req.lifetime else None

    def inputs(self, decode: Iterable[int], prefill: Iterable[PrefillChunk], lookahead: tuple[int, ...] = ()
               ) -> StepInputs:
        """Decode rows hold the drafts the plan gave them room for; prefill rows name the token
        after each position that the MTP layer can run over inside the forward."""
        rows, owners, verify_rows = [], [], []
        decode = tuple(decode)
        room = dict(zip(decode, lookahead))
        for rid in decode:
            draft = self._draft(rid)
            drafts = draft.tokens[:room.get(rid, 0)] if draft is not None else ()
            row, owner = self.table.decode_row(rid, drafts)
            rows.append(row)
            owners.append(owner)
            verify_rows.append(VerifyRow(1 + len(drafts)))
        for chunk in prefill:
            tokens = self.table.requests[chunk.rid].seq.tokens
            chunk_rows, chunk_owners = self.table.prefill_rows(chunk)
            for row in chunk_rows:
                past, new = row.span.past, row.span.new
                follow = tuple(tokens[past + 1:past + new + 1]) if self.mtp else ()
                verify_rows.append(VerifyRow(int(row.sample), follow))
            rows += chunk_rows
            owners += chunk_owners
        return StepInputs(rows, owners, verify_rows)

    # -- the forwards ---------------------------------------------------------------------------------
    def forward(self, step: StepInputs, phase: Phase) -> Forward:
        """The target forward (in P, with the MTP layer over the prefill positions it can run; "ngram":
        the target alone); returns a `SpecOutput`. A `mux` epoch resumes it boundary by boundary."""
        verify = step.verify or [VerifyRow(int(r.sample)) for r in step.rows]
        return verify_forward(self.runner, step.rows, verify, phase, mtp=self.mtp)

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.model.device)

    def _mtp(self, spans: list[SeqSpan], hidden: list[torch.Tensor], tokens: list[int], phase: Phase,
             rows: list[_Row]) -> torch.Tensor:
        """The MTP layer over `spans` (one per row of `rows`, on its request's table); its output [positions, H]."""
        h = torch.cat(hidden) if hidden else torch.zeros(0, self.model.cfg.hidden_size,
                                                           dtype=self.model.cfg.torch_dtype, device=self.model.device)
        keys = [r.owner.request.seq.table_key for r in rows]
        return run_to_end(self.runner.forward_mtp(spans, h, self._index(tokens), phase, keys))

    # -- one step ---------------------------------------------------------------------------------------
    def run(self, plan: StepPlan, phase: Phase) -> list[RequestOutput]:
        """One step: the target forward, the verdicts, the MTP layer's pass and the next drafts (all in
        `phase`: every rank runs the same forwards), then the tokens into the request table. A pure
        decode step that drafts nothing, where the engine decodes ahead, is the plain executor's step
        (module docstring)."""
        if self.ahead is not None:
            if phase is Phase.D and not plan.prefill and not any(plan.lookahead):  # (never MTP: no ahead there)
                outs = super().run(plan, phase)
                if self.whole:
                    self.whole.difference_update(plan.decode)  # as `_count` does for a row that drafted nothing
                self._forget()
                return outs
            self.ahead.drop()  # this step drafts: the rows move past the forward issued without drafts
        t0 = time.perf_counter()
        step = self.inputs(plan.decode, plan.prefill, plan.lookahead)
        self.table.note_decode_wait(plan.decode, t0)
        version = self.weights.version
        with torch.no_grad():
            out = run_to_end(self.forward(step, phase))
            self._prepare(self.table.requests[c.rid] for c in plan.prefill if c.completes)
            rows = self._verdicts(step, out)
            if self.mtp:
                self._draft_next(rows, phase)
        self._record_time(plan, phase, t0)
        outs = self._accept(rows, version)
        self._record_step(plan, phase, step.rows, t0)
        return outs

    def complete(self, owners: list[SampleOwner], logits, draw: PendingDraw | None = None,
                 version: int | None = None) -> list[RequestOutput]:
        """A `mux` epoch's end: sample its rows; each row that goes on to decode keeps its last
        prompt position's hidden state for its first decode iteration."""
        if not isinstance(logits, SpecOutput):
            return super().complete(owners, logits, draw, version)
        self._prepare(o.request for o in owners if self.table.is_live(o))
        outs = super().complete(owners, logits.logits, version=version)
        for i, owner in enumerate(owners):
            if self.mtp and self.table.is_live(owner):
                self.deferred[owner.request.rid] = Deferred(owner.lifetime, owner.context - 1, logits.hidden[i])
        return outs

    def _verdicts(self, step: StepInputs, out: SpecOutput) -> list[_Row]:
        """Every sampling row's verdict; the prompt positions that score the next prompt token
        (`prompt_logprobs`, one logits row each) are scored as the plain executor scores them."""
        read: list[list[_Best]] = []

        def best(sl: slice) -> list[_Best]:
            """Rows `sl` of every row's argmax, logprob and finiteness, read to the host in one go the
            first time a row needs them (a step whose rows all go to `verify_lookup` never does)."""
            if not read:
                read.append(_best(out.logits))
            return read[0][sl]

        rows, at, owners, scored, lookups = [], 0, iter(step.owners), [], []
        for row, v in zip(step.rows, step.verify, strict=True):
            if not v.logits:
                continue
            owner, sl = next(owners), slice(at, at + v.logits)
            at += v.logits
            if owner.scores is not None:
                scored.append((owner, sl.start))
            elif self.table.is_live(owner):
                first = row.span.past + row.span.new - v.logits
                rows.append(self._verdict(owner, first, row.span.table, tuple(row.token_ids[1:v.logits]),
                                          out.logits, sl, out.hidden[sl] if self.mtp else None, best, lookups))
        if scored:
            self.score([o for o, _ in scored], out.logits[self._index([i for _, i in scored])])
        for (row, ask), verdict in zip(lookups, verify_lookup(out.logits, [ask for _, ask in lookups]), strict=True):
            if verdict.error is not None:
                row.error = verdict.error
                continue
            row.verdict = verdict
            self._count(row.owner.request.rid, len(ask.drafts), verdict.accepted)
        return rows

    def _verdict(self, owner: SampleOwner, first: int, table: tuple[int, ...], drafts: tuple[int, ...],
                 all_logits: torch.Tensor, sl: slice, hidden: torch.Tensor | None,
                 best: Callable[[slice], list[_Best]], lookups: list[tuple[_Row, LookupRow]]) -> _Row:
        """The row's verdict from its logits `all_logits[sl]`. A sampled row of one draw whose drafts
        have no law (n-gram lookup), or that has none, joins `lookups`: `verify_lookup` decides (and
        checks) them all at once, and its verdict or its error comes then. The others read their
        choices from `best(sl)` (a greedy row never reads its logits)."""
        req = owner.request
        params, gen, n = req.params, req.generator or self.generator, self.table.draws(owner)
        law = None  # the drafts' law (MTP's sampled drafts): `verify` decides the row alone
        if params.temperature != 0.0 and n == 1 and params.logprobs is None:
            draft = self._draft(req.rid) if drafts else None
            if draft is None or draft.logq is None:
                row = _Row(owner, first, table, hidden, None)
                lookups.append((row, LookupRow(sl.start, drafts, params, gen)))
                return row
            law = draft.logq[:len(drafts)]
        mine = best(sl)
        bad = [i for i, b in enumerate(mine) if not b.finite]
        if bad:
            why = non_finite(float(all_logits[sl][bad[0]].float().amax())).error  # the plain sampler's reason
            return _Row(owner, first, table, hidden, None, why)
        if n > 1 or params.logprobs is not None:
            # the plain executor's draws: n forking a request's samples, each from its own generator, or
            # one with its top logprobs (such a row is never drafted)
            return _Row(owner, first, table, hidden, None,
                        samples=self.draw([owner], all_logits[sl][:1]).result(range(n)))
        if params.temperature == 0.0:  # `verify`'s greedy rule on the host copies
            a = next((i for i, d in enumerate(drafts) if d != mine[i].token), len(drafts))
            self._count(req.rid, len(drafts), a)
            kept = mine[:a + 1]
            return _Row(owner, first, table, hidden, Verdict(a, tuple(b.token for b in kept),
                                                             tuple(b.logprob for b in kept)))
        verdict = verify(all_logits[sl], list(drafts), law, params, gen)
        self._count(req.rid, len(drafts), verdict.accepted)
        return _Row(owner, first, table, hidden, verdict)

    def _count(self, rid: int, drafted: int, accepted: int) -> None:
        """A row's verdict on its drafts, in the stats and (under `streak_k`) in `whole`."""
        self.stats.drafted_tokens += drafted
        self.stats.accepted_tokens += accepted
        if self.config.streak_k is None:
            return
        if drafted and accepted == drafted:
            self.whole.add(rid)
        else:
            self.whole.discard(rid)

    def _draft_next(self, rows: list[_Row], phase: Phase) -> None:
        """Step 3 (module docstring): the MTP layer over every row's confirmed positions, then up to
        k drafts per row, the layer chained on its own output. Always 1 + (k - 1) MTP forwards, each
        maybe over no row, so that every rank runs the same ones."""
        rows = [r for r in rows if r.verdict is not None]
        spans, hidden, tokens = [], [], []
        for row in rows:
            req, n = row.owner.request, len(row.verdict.tokens)
            past, h, nxt = row.first, [row.hidden[:n]], list(row.verdict.tokens)
            late = self.deferred.pop(req.rid, None)
            if late is not None and late.lifetime == req.lifetime and late.position == past - 1:
                past, h, nxt = past - 1, [late.hidden[None]] + h, [req.seq.tokens[past]] + nxt
            spans.append(SeqSpan(row.table, past, len(nxt)))
            hidden.extend(h)
            tokens.extend(nxt)
        x = self._mtp(spans, hidden, tokens, phase, rows)
        last = [r - 1 for r in torch.tensor([s.new for s in spans], dtype=torch.long).cumsum(0).tolist()]
        x = x[self._index(last)]  # [rows, H]: the layer's output at each row's last confirmed position
        want = [self._room(row) for row in rows]
        drafted: list[list[int]] = [[] for _ in rows]
        logq: list[list[torch.Tensor]] = [[] for _ in rows]
        for j in range(self.k):
            if j:  # the chain: position n' + j - 1, hidden = the layer's previous output, token = draft j
                chain = [i for i in range(len(rows)) if len(drafted[i]) == j and want[i] > j]
                table = self.table
                spans = [SeqSpan(tuple(table.pool.table(rows[i].owner.request.seq.sid)),
                                 rows[i].first + len(rows[i].verdict.tokens) + j - 1, 1) for i in chain]
                y = self._mtp(spans, [x[self._index(chain)]], [drafted[i][-1] for i in chain], phase,
                              [rows[i] for i in chain])
                x = x.index_copy(0, self._index(chain), y)
            else:
                chain = [i for i in range(len(rows)) if want[i] > 0]
            q = self.model.logits(x[self._index(chain)], self.mtp_norm)  # [chain, V]
            best = _best(q)
            for c, i in enumerate(chain):
                picked = self._pick(q[c], rows[i].owner.request, best[c])
                if picked is not None:
                    drafted[i].append(picked[0])
                    logq[i].append(picked[1])
        for i, row in enumerate(rows):
            req = row.owner.request
            if drafted[i]:
                laws = None if req.params.temperature == 0.0 else torch.stack(logq[i])
                self.drafts[req.rid] = Draft(req.lifetime, tuple(drafted[i]), laws)
            else:
                self.drafts.pop(req.rid, None)

    def _budget(self, req: Request, emitted: int, k: int | None = None) -> int:
        """Drafts worth making for the request's next iteration, `emitted` tokens from now: up to k
        (None: `SpeculativeConfig.k`), no more than it may still emit, minus the token it emits anyway."""
        left = min(req.params.max_new_tokens - len(req.output), self.table.max_model_len - len(req.seq.tokens))
        return max(0, min(self.k if k is None else k, left - emitted - 1))

    def _room(self, row: _Row) -> int:
        """`_budget`, and (k > 1) only as far as free KV holds the MTP chain's positions."""
        req, emitted = row.owner.request, len(row.verdict.tokens)
        want = self._budget(req, emitted)
        pool, sid = self.table.pool, req.seq.sid
        pending = row.first + emitted  # the position of the token this iteration leaves pending
        while want > 1 and pool.blocks_to_grow(sid, pending + want - 1) > pool.num_free:
            want -= 1
        if want > 1:
            pool.grow(sid, pending + want - 1)
        return want

    def _pick(self, logits: torch.Tensor, req, best: _Best) -> tuple[int, torch.Tensor | None] | None:
        """One draft from the MTP layer's logits [V] under the request's sampling params, and its law
        (None: greedy); None where the logits are not finite (the row does not draft)."""
        params: SamplingParams = req.params
        if not best.finite:
            return None
        if params.temperature == 0.0:
            return best.token, None
        logq = filtered_logprobs(logits[None], params)[0]
        return draw_index(logq.exp(), req.generator or self.generator), logq

    def _accept(self, rows: list[_Row], version: int) -> list[RequestOutput]:
        now, outs = time.perf_counter(), []
        for row in rows:
            owner, req = row.owner, row.owner.request
            if row.samples is not None:
                outs += self.table.accept(owner, row.samples, version, now)
                continue
            if row.verdict is None:
                why = f"request {req.rid}: {row.error} at position {owner.context} under weight version {version}"
                outs.append(self.table.finish(req, FinishReason.ERROR, why))
                continue
            drawn = [Sampled(t, lp) for t, lp in zip(row.verdict.tokens, row.verdict.logprobs)]
            outs += self.table.accept_run(owner, drawn, version, now)
        self._forget()
        self._copy_blocks()  # the forks' partial blocks, before the next forward reads them
        return outs

    def may_issue_ahead(self, plan: StepPlan) -> bool:
        """Only when the plan's lookup found drafts for none of its rows (module docstring)."""
        return not any(self._draft(rid) for rid in plan.decode)

    def _forget(self) -> None:
        """Drop the drafts, deferred states, contexts and families of requests that are gone."""
        for entries in (self.drafts, self.deferred):  # forget finished, preempted and cancelled requests
            for rid in [rid for rid, e in entries.items()
                        if (req := self.table.requests.get(rid)) is None or req.lifetime != e.lifetime]:
                del entries[rid]
        if self.whole:
            self.whole.intersection_update(self.table.requests)
        gone = [sid for sid in self.contexts if sid not in self.table.seqs]
        for sid in gone:
            del self.contexts[sid]
        for key in {f for f, family in self.families.items() if any(sid in family.members for sid in gone)}:
            if not any(sid in self.table.seqs for sid in self.families[key].members):
                del self.families[key]
