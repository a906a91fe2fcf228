"""One weight update, one decision of every rank of the model.

Each rank validates its own call of `update_weights` and posts the outcome as a `WeightOffer`
(the version, which chunk of it, whether it is the final one, or why this rank refuses it). The
offers ride the engine's step gather (`engine.coordinator`, over the CPU group), so every rank
sees the same offers at the same step and `decide` reaches the same verdict everywhere, from the
same data, with no leader:
- a rank has not offered yet: wait (its trainer may still be on its way; the engine keeps stepping);
- any rank refuses, or the ranks offer different versions, chunks or finality: every rank refuses
  (and drops whatever version it had staged);
- a non-final chunk: every rank stages it (the served weights do not change, so it may land
  mid-epoch);
- a final chunk: every rank applies it before the step's first forward, unless a `mux` prefill
  epoch is in flight, in which case every rank waits for the epoch to finish (a forward never sees
  two versions, and the epoch's tokens carry the version they were computed under).

`UpdateGate` is how an update and the engine's steps take turns on one rank: one re-entrant lock
that a step holds for its whole duration, and that a waiting update gets before the next step.

A rank that never offers is not waited for forever: a rank that did gives up after the
communicator's timeout, naming the ranks it waited for (`WeightVoteTimeout`), and applies nothing.

Left out: comparing the tensors across ranks (each rank checks only what it was given: two ranks
handed different values of one version agree; a checksum vote would cost a pass over the weights).
"""
from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

from megatron_rollout.comm.errors import CrossRankTimeout


class WeightOffer(NamedTuple):
    """One rank's side of one `update_weights` call (small: it crosses the CPU group)."""

    version: int | None
    """The version this call brings (None: not an integer)."""
    chunk: int
    """How many chunks of this version this rank has staged before this one."""
    final: bool
    refusal: str | None
    """Why this rank refuses the call (its validation error), or None."""

    def describe(self) -> str:
        return f"version {self.version} ({'final' if self.final else 'non-final'} chunk {self.chunk})"


class Prepared(NamedTuple):
    """One `update_weights` call, checked by `WeightStore.prepare` and not yet applied."""

    offer: WeightOffer
    incoming: list
    """The validated tensors (`weights`' records), to stage or apply once every rank agrees."""
    error: Exception | None
    """What refuses the call on this rank (None: this rank accepts it)."""


class Verdict(enum.Enum):
    STAGE = "stage"
    APPLY = "apply"
    REFUSE = "refuse"


class Decision(NamedTuple):
    verdict: Verdict
    reason: str
    """Why every rank refuses (empty otherwise)."""


def decide(offers: Sequence[WeightOffer | None], epoch_in_flight: bool) -> Decision | None:
    """The verdict every rank reaches from the same gathered offers (rank order), or None: wait."""
    if any(o is None for o in offers):
        return None
    refusals = [f"rank {r} refused {o.describe()}: {o.refusal}" for r, o in enumerate(offers) if o.refusal]
    if refusals:
        return Decision(Verdict.REFUSE, "; ".join(refusals))
    if len({(o.version, o.chunk, o.final) for o in offers}) > 1:
        seen = ", ".join(f"rank {r}: {o.describe()}" for r, o in enumerate(offers))
        return Decision(Verdict.REFUSE, f"the ranks were given different updates ({seen})")
    if not offers[0].final:
        return Decision(Verdict.STAGE, "")
    return None if epoch_in_flight else Decision(Verdict.APPLY, "")


def waiting_for(offers: Sequence[WeightOffer | None]) -> list[int]:
    """The ranks that have not offered."""
    return [r for r, o in enumerate(offers) if o is None]


class WeightVoteTimeout(CrossRankTimeout):
    """Not every rank offered its part of a weight update within the timeout (nothing was applied)."""


@dataclass
class Vote:
    """This rank's side of one `update_weights` call while the ranks decide it."""

    prepared: Prepared
    since: float
    """When it was offered (time.monotonic())."""
    decision: Decision | None = None

    def check_deadline(self, offers: Sequence[WeightOffer | None], timeout_s: float, rank: int) -> None:
        """Raise `WeightVoteTimeout` once the ranks missing from `offers` (the last step's) have
        been waited for `timeout_s`."""
        waited = time.monotonic() - self.since
        if waited >= timeout_s:
            missing, offer = waiting_for(offers), self.prepared.offer
            raise WeightVoteTimeout(
                f"weight update to {offer.describe()} on rank {rank}: rank(s) {missing} did not offer their part "
                f"within {timeout_s}s (the engine kept stepping for them); nothing was applied: call update_weights "
                f"on every rank of the model", missing=missing, where=f"weight vote for version {offer.version}",
                elapsed_s=waited, rank=rank)


class UpdateGate:
    """The engine's re-entrant lock, which a waiting weight update takes before the next step does:
    CPython's locks are not fair, and a loop that steps back to back would take it again at once."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._updates = 0  # updates waiting for or holding the lock
        self._changed = threading.Condition()

    @contextmanager
    def update(self) -> Iterator[None]:
        with self._changed:
            self._updates += 1
        try:
            with self.lock:
                yield
        finally:
            with self._changed:
                self._updates -= 1
                self._changed.notify_all()

    @contextmanager
    def step(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: self._updates == 0)
        with self.lock:
            yield
