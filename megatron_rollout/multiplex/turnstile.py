"""The turnstile: one host driver per rank that interleaves D iterations with P segments in the
same order on every rank (docs/design.md §6).

How the engine calls it, once per admitted prefill batch (an epoch, numbered the same on all ranks):

    turnstile = Turnstile(Rendezvous(gloo_full_group, timeout_s), BoundaryController(),
                          LoadSelected(), Router(ConflictRegistry.for_topology(atp, adp), streams))
    logits = turnstile.run_epoch(
        epoch,
        p_forward=model.step(tokens, positions, attn, Phase.P),  # generator yielding BoundaryPoint
        decode_iteration=runner.decode_step,   # enqueues one D iteration; a matched no-work call
                                               # (same collectives, empty rows) on ranks without rows
        decode_rows=lambda: runner.num_decode_rows,
        total_boundaries=None,                 # or the forward's boundary count (LoadSelected uses it)
        prefill_tokens=int(tokens.numel()))

Call it under `torch.no_grad()` if the forward needs it: grad mode is read each time the generator
resumes, not when it was created. A step-based engine loop can instead call `begin(...)` once and
then `round(decode_iteration, decode_rows)` once per step (see `Turnstile`).

The comm facade P runs through must execute collectives via `router.run(router.route(phase, site),
fn)`, so the registered conflicting P collective lands on D's route inside the round's window.
Because the model yields *before* each collective, the collective that follows a segment's last
boundary is issued when P resumes, right after the post-D rendezvous: on D's route it still comes
after this round's D iteration and before the next one, since nothing else is enqueued in between.

Each round on every rank: pre-D rendezvous (carrying boundaries published, finished, cancel) →
`decode_iteration()` → the router window opens (a routed P collective issued from here on follows
this D on D's route) → post-D rendezvous (carrying decode rows) → controller.advance(span chosen by
the policy from the rank-agreed load) → P is resumed up to the permitted endpoint, each yield
published as the next boundary id. The epoch ends at the first pre-D rendezvous where every rank
reports its P forward finished; ranks that disagree on boundary counts raise
`TurnstileDivergence` on all ranks. `cancel()` (any rank, any thread) ends the epoch on all ranks
at the next pre-D rendezvous with `EpochCancelled`.

Deliberately left out: no device synchronisation (P work already submitted keeps running; the
turnstile never waits on a stream or a collective), no admission (the engine's plan decides what
an epoch is), no tensors (the turnstile handles only the generator, callbacks and ints).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from megatron_rollout.forward import BoundaryPoint
from megatron_rollout.multiplex.controller import REASONS, BoundaryController, BoundaryError
from megatron_rollout.multiplex.policy import SegmentLoad, SegmentPolicy
from megatron_rollout.multiplex.rendezvous import RendezvousBase
from megatron_rollout.multiplex.routing import Router

logger = logging.getLogger(__name__)

R = TypeVar("R")

_REASON_CODES = tuple(sorted(REASONS))  # a rejection crosses the rendezvous as 1 + its index here


class TurnstileDivergence(RuntimeError):
    """Ranks disagree on how far P got: their P forwards yield different boundary sequences."""


class EpochCancelled(RuntimeError):
    """The epoch was cancelled (by `Turnstile.cancel` on some rank); raised on every rank."""

    def __init__(self, epoch: int, round_: int, boundary: int, by_ranks: list[int]) -> None:
        self.epoch, self.round, self.boundary, self.by_ranks = epoch, round_, boundary, by_ranks
        super().__init__(f"epoch {epoch} cancelled by rank(s) {by_ranks} before round {round_ + 1}, "
                         f"after boundary {boundary}")


@dataclass(frozen=True)
class RoundRecord:
    """One turnstile round on one rank, for timelines (times are `time.time()` seconds)."""

    epoch: int
    round: int
    rank: int
    first_boundary: int  # first boundary id P could publish this round
    last_boundary: int  # last boundary id published when the round ended
    permitted: int  # permitted endpoint after this round's advance
    span: int
    decode_rows: int  # this rank's
    max_decode_rows: int  # over all ranks (what the policy saw)
    p_finished: bool  # P's forward returned during this round
    t_start: float
    t_pre_d: float  # pre-D rendezvous complete
    t_decode: float  # D iteration enqueued
    t_post_d: float  # post-D rendezvous complete
    t_end: float  # P segment(s) enqueued


@dataclass
class _Epoch:
    number: int
    forward: Generator
    total_boundaries: int | None
    prefill_tokens: int
    ids: dict[BoundaryPoint, int] | None = None  # the forward's boundary plan: point -> id
    rounds: int = 0
    finished: bool = False  # this rank's P forward returned
    result: object = None
    fault: tuple[int, int, int, int] = (0, 0, 0, 0)  # a rejected publish: (id, reason code, last, permitted)


class Turnstile:
    """Runs epochs; holds no tensors. One per rank, driven by one host thread.

    `run_epoch` is the whole protocol. `begin` + `round` expose it one round at a time for a
    step-based engine loop: `round()` returns False after running one D iteration and one P
    span, and True (without running D) when every rank's P has finished; `result` then holds
    P's return value. Any exception inside a round cancels the epoch on this rank (the other
    ranks learn it through their next rendezvous timing out, naming this rank)."""

    def __init__(self, rendezvous: RendezvousBase, controller: BoundaryController, policy: SegmentPolicy,
                 router: Router | None = None, max_records: int = 100_000) -> None:
        self.rendezvous, self.controller, self.policy = rendezvous, controller, policy
        self.router = router or Router()
        self.records: collections.deque[RoundRecord] = collections.deque(maxlen=max_records)
        self.result: object = None  # P's return value of the last finished epoch
        self._lock = threading.Lock()
        self._epoch: _Epoch | None = None
        self._cancel = False

    @property
    def running(self) -> int | None:
        """The epoch in progress, if any."""
        return self._epoch.number if self._epoch is not None else None

    @property
    def p_finished(self) -> bool:
        """This rank's P forward of the running epoch has returned (every rank's has too, since
        all run the same boundary sequence; the next pre-D rendezvous confirms it)."""
        return self._epoch is not None and self._epoch.finished

    def cancel(self, reason: str = "") -> bool:
        """Ask to end the running epoch; every rank stops at its next pre-D rendezvous with
        `EpochCancelled`. Thread-safe. Returns False (and does nothing) when no epoch is running:
        a cancellation never leaks into a later epoch."""
        with self._lock:
            if self._epoch is None:
                logger.info("turnstile cancel on rank %d ignored, no epoch running: %s", self.rendezvous.rank, reason)
                return False
            logger.info("turnstile cancel of epoch %d on rank %d: %s", self._epoch.number, self.rendezvous.rank, reason)
            self._cancel = True
            return True

    def run_epoch(self, epoch: int, p_forward: Generator[BoundaryPoint, None, R],
                  decode_iteration: Callable[[], None], decode_rows: Callable[[], int], *,
                  total_boundaries: int | None = None, prefill_tokens: int = 0,
                  boundaries: Sequence[BoundaryPoint] | None = None) -> R:
        """Run P's forward to its end with D iterations interleaved; return the forward's result.

        `total_boundaries` (optional) is how many boundaries `p_forward` yields; it lets
        `LoadSelected` release the whole rest in one span and is checked against what P yields.
        `boundaries` (optional) is the forward's boundary plan, the points it yields in order: each
        yielded point is then published as its position in the plan (1-based), so the controller
        sees the forward's real sequence and rejects a skipped or repeated boundary; without it,
        the k-th yield is published as id k. It implies `total_boundaries`."""
        self.begin(epoch, p_forward, total_boundaries=total_boundaries, prefill_tokens=prefill_tokens,
                   boundaries=boundaries)
        while not self.round(decode_iteration, decode_rows):
            pass
        return self.result  # type: ignore[return-value]

    def begin(self, epoch: int, p_forward: Generator[BoundaryPoint, None, object], *,
              total_boundaries: int | None = None, prefill_tokens: int = 0,
              boundaries: Sequence[BoundaryPoint] | None = None) -> None:
        ids = None
        if boundaries is not None:
            ids = {point: i + 1 for i, point in enumerate(boundaries)}
            if len(ids) != len(boundaries):
                raise ValueError(f"the boundary plan of epoch {epoch} names a point twice: {list(boundaries)}")
            if total_boundaries is None:
                total_boundaries = len(ids)
            elif total_boundaries != len(ids):
                raise ValueError(f"total_boundaries={total_boundaries} but the boundary plan has {len(ids)} points")
        if total_boundaries is not None and (type(total_boundaries) is not int or total_boundaries < 0):
            raise ValueError(f"total_boundaries must be a non-negative int or None, got {total_boundaries!r}")
        if type(prefill_tokens) is not int or prefill_tokens < 0:
            raise ValueError(f"prefill_tokens must be a non-negative int, got {prefill_tokens!r}")
        if self._epoch is not None:
            raise RuntimeError(f"begin({epoch}): epoch {self._epoch.number} is still running")
        self.controller.begin_epoch(epoch)
        with self._lock:
            self._epoch = _Epoch(epoch, p_forward, total_boundaries, prefill_tokens, ids)
            self._cancel, self.result = False, None

    def round(self, decode_iteration: Callable[[], None], decode_rows: Callable[[], int]) -> bool:
        """One turnstile round; True when the epoch ended (all ranks' P finished) instead."""
        ep = self._epoch
        if ep is None:
            raise RuntimeError("round() with no epoch running; call begin() first")
        try:
            return self._round(ep, decode_iteration, decode_rows)
        except BaseException:
            self.controller.cancel_epoch()
            self.router.close_window()
            ep.forward.close()  # P's partial state is dropped, never resumed
            with self._lock:
                self._epoch, self._cancel = None, False
            raise

    def _round(self, ep: _Epoch, decode_iteration: Callable[[], None], decode_rows: Callable[[], int]) -> bool:
        ctl, epoch = self.controller, ep.number
        t_start = time.time()
        published = ctl.last_published
        pre = self.rendezvous.meet(epoch, published, "pre-D", (published, int(ep.finished), int(self._cancel),
                                                               *ep.fault))
        # A rank whose controller rejected a boundary tells every rank here; all raise the same error.
        for r, p in zip(self.rendezvous.ranks, pre):
            if p[4]:
                raise BoundaryError.rejected(epoch, p[3], _REASON_CODES[p[4] - 1], p[5], p[6], rank=r)
        if len({p[0] for p in pre}) > 1:  # `finished` may differ (a rank still polling); boundaries may not
            self._agree(epoch, ep.rounds + 1, "pre-D", [(p[0], p[1]) for p in pre], ("boundaries", "finished"))
        cancellers = [r for r, p in zip(self.rendezvous.ranks, pre) if p[2]]
        if cancellers:
            raise EpochCancelled(epoch, ep.rounds, published, cancellers)
        if all(p[1] for p in pre):  # a rank whose device still finishes P's tail polls on (see _run_segments)
            if ep.total_boundaries is not None and published != ep.total_boundaries:
                raise TurnstileDivergence(f"epoch {epoch}: P yielded {published} boundaries, "
                                          f"total_boundaries said {ep.total_boundaries}")
            logger.debug("epoch %d done in %d rounds, %d boundaries", epoch, ep.rounds, published)
            ctl.end_epoch()
            with self._lock:
                self._epoch, self._cancel, self.result = None, False, ep.result
            return True
        ep.rounds += 1
        t_pre_d = time.time()
        rows = decode_rows()
        if type(rows) is not int or rows < 0:
            raise ValueError(f"decode_rows() returned {rows!r}; expected a non-negative int")
        decode_iteration()
        self.router.open_window(epoch, ep.rounds)
        t_decode = time.time()
        post = self.rendezvous.meet(epoch, published, "post-D", (published, rows))
        self._agree(epoch, ep.rounds, "post-D", [(p[0],) for p in post], ("boundaries",))
        ctl.mark_post_d_complete()
        t_post_d = time.time()
        max_rows = max(p[1] for p in post)
        remaining = None if ep.total_boundaries is None else ep.total_boundaries + 1 - ctl.permitted
        if remaining is not None and remaining < 1:
            # Every boundary is permitted and published; an asynchronous runner's P is only waiting
            # for the device (completion polls): one more resume per round until it returns.
            remaining = 1
        span = self.policy.span(SegmentLoad(max_rows, remaining, ep.prefill_tokens))
        permitted = ctl.advance(span)  # validates the policy's span
        self._run_segments(ep)
        self.router.close_window()
        self.records.append(RoundRecord(
            epoch, ep.rounds, self.rendezvous.rank, published + 1, ctl.last_published, permitted, span,
            rows, max_rows, ep.finished, t_start, t_pre_d, t_decode, t_post_d, time.time()))
        return False

    def _run_segments(self, ep: _Epoch) -> None:
        """Resume P once per permitted boundary (as every rank does), publishing each yield.

        A publish the controller rejects does not stop P here: this rank keeps resuming as often
        as its peers do in this round (so the collectives after each boundary still pair up) and
        reports the rejection at the next pre-D rendezvous, where every rank raises it. A yield
        with a negative layer (an asynchronous runner's completion poll, `runner.cuda.COMPLETION`)
        is not a boundary: it ends this round's P so D can run while the device finishes P."""
        ctl, total = self.controller, ep.total_boundaries
        if ep.finished:
            return
        for _ in range(ctl.permitted - ctl.last_published):
            try:
                point = next(ep.forward)
            except StopIteration as stop:
                ep.finished, ep.result = True, stop.value
                return
            if not isinstance(point, BoundaryPoint):
                raise TypeError(f"P forward yielded {point!r} at boundary {ctl.last_published + 1} of epoch "
                                f"{ep.number}; it must yield BoundaryPoint")
            if point.layer < 0:
                return
            if ep.fault[1]:
                continue  # already rejected: keep pace with the peers, publish nothing
            if ep.ids is None:
                boundary = ctl.last_published + 1
            elif point in ep.ids:
                boundary = ep.ids[point]
            else:
                raise TurnstileDivergence(f"epoch {ep.number}: P yielded {point}, which is not in its boundary "
                                          f"plan {list(ep.ids)}; the plan and the forward disagree")
            try:
                ctl.publish(ep.number, boundary)
            except BoundaryError as err:
                logger.error("rank %d: %s (P yielded %s)", self.rendezvous.rank, err, point)
                ep.fault = (boundary, _REASON_CODES.index(err.reason) + 1, ctl.last_published, ctl.permitted)
                continue
            if total is not None and ctl.last_published > total:
                raise TurnstileDivergence(f"epoch {ep.number}: P yielded boundary {ctl.last_published} ({point}) "
                                          f"but total_boundaries is {total}")

    def _agree(self, epoch: int, round_: int, tag: str, views: list[tuple[int, ...]], names: tuple[str, ...]) -> None:
        if len(set(views)) > 1:
            per_rank = {r: dict(zip(names, v)) for r, v in zip(self.rendezvous.ranks, views)}
            raise TurnstileDivergence(
                f"epoch {epoch}, {tag} rendezvous of round {round_}: ranks disagree on P's progress: "
                f"{per_rank}. All ranks must run P forwards with identical boundary sequences")
