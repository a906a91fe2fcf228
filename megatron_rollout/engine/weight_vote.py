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

Left out: a rank that never offers is not waited for forever: the engine gives up after the
communicator's timeout and names it (`WeightVoteTimeout`); its peers then see no agreement and
give up the same way.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
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
