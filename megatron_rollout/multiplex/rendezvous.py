"""CPU rendezvous for the turnstile: every rank of the full group meets, or everyone learns who
did not come (docs/design.md §6).

Why not `dist.barrier` on a gloo group: a gloo barrier that times out says nothing about *which*
rank is missing, and `monitored_barrier(wait_all_ranks=True)` names the missing ranks on rank 0
only (the other ranks just time out waiting for rank 0). The turnstile needs every arrived rank to
fail with the same diagnosis, so this module meets through the process group's key-value store,
with comm's `StoreRendezvous` (the same exchange DistComm's state gather uses): each rank sets one
key per meeting and waits, with a deadline, for the others'; on timeout it names the absent ranks.
This layer adds the turnstile's vocabulary: each meeting carries the rank's (epoch, boundary, tag)
and a small tuple of ints, so a meeting returns what every rank brought: the turnstile uses that to
agree on boundary counts, decode rows and cancellation without a separate collective. Its errors
subclass comm.dist's (`RendezvousTimeout`, `RendezvousMismatch`), which DistComm's state gather
raises the same way; the timeout is a `comm.errors.CrossRankTimeout` (time waited, dead ranks).

Deliberately left out: no device synchronisation (P work already submitted keeps running), no
retry (a timed-out rendezvous is poisoned: the engine cancels the epoch and builds a new one),
and no payloads beyond a few ints.
"""
from __future__ import annotations

import abc
import logging
from typing import Sequence

import torch.distributed as dist

from megatron_rollout.comm import dist as comm_dist
from megatron_rollout.comm import errors as comm_errors

logger = logging.getLogger(__name__)

TAGS = ("pre-D", "post-D", "naive-poll")  # naive-poll: the unsafe baseline agreeing on epoch ends

Payload = tuple[int, ...]


class RendezvousTimeout(comm_dist.RendezvousTimeout):
    """Some ranks did not reach a turnstile rendezvous in time. `.missing` are their global ranks.

    A subclass of comm's `RendezvousTimeout` (and so of `comm.errors.CrossRankTimeout`), so one
    `except` catches a timeout in the engine's state gather, the turnstile or a collective; adds
    the turnstile's `.epoch`, `.boundary`, `.tag`. `elapsed_s` is the time actually waited (a
    peer whose store connection closes fails the wait early); `states` names dead/stopped ranks."""

    def __init__(self, missing: Sequence[int], epoch: int, boundary: int, tag: str, timeout_s: float,
                 rank: int, elapsed_s: float | None = None, states: dict[int, str] | None = None) -> None:
        missing = tuple(missing)
        waited = f"within {timeout_s}s" if elapsed_s is None or elapsed_s >= 0.95 * timeout_s else \
            f"(the wait failed after {elapsed_s:.1f} s of {timeout_s}s)"
        where = f"turnstile {tag}, epoch {epoch}, boundary {boundary}"
        super().__init__(f"rank(s) {list(missing)} did not arrive at the {tag} rendezvous of epoch "
                         f"{epoch}, boundary {boundary} {waited} (seen from rank {rank})", missing, where,
                         elapsed_s=elapsed_s, rank=rank, states=states)
        found = comm_errors.describe(self.states)
        self.args = (f"{self.args[0]}: {found}" if found else f"{self.args[0]}; check those ranks for a hang "
                     f"or crash",)
        self.message = self.args[0]
        self.epoch, self.boundary, self.tag = epoch, boundary, tag


class RendezvousMismatch(comm_dist.RendezvousMismatch):
    """All ranks arrived, but not at the same (epoch, tag): their plans diverged."""


class RendezvousBase(abc.ABC):
    """A meeting point for all ranks of one group."""

    ranks: tuple[int, ...]  # global ranks, in group order
    rank: int  # this process's global rank

    @property
    def size(self) -> int:
        return len(self.ranks)

    _generations: dict[tuple[str, str, str], int] = {}  # per process: (namespace, name, members) -> next

    def _join(self, group: dist.ProcessGroup | None, timeout_s: float, rank: int | None, name: str,
              namespace: str) -> str:
        """Set `ranks`, `rank` and `timeout_s` from `group`; return this instance's key prefix: the
        next generation of `name` over these ranks, so that a rendezvous rebuilt after a failure
        never reads the old one's keys (every rank builds its instances in the same order)."""
        if not timeout_s > 0:
            raise ValueError(f"rendezvous timeout must be positive, got {timeout_s}")
        self.ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        self.rank = dist.get_rank() if rank is None else rank
        if self.rank not in self.ranks:
            raise ValueError(f"rank {self.rank} is not in the rendezvous group {list(self.ranks)}")
        self.timeout_s = timeout_s
        members = "-".join(map(str, self.ranks))
        key = (namespace, name, members)
        generation = RendezvousBase._generations.get(key, 0)
        RendezvousBase._generations[key] = generation + 1
        return f"megatron_rollout/{namespace}/{name}.{generation}/{members}/"

    @abc.abstractmethod
    def meet(self, epoch: int, boundary: int, tag: str, payload: Payload = ()) -> list[Payload]:
        """Block until every rank of the group calls `meet` (same call number, same epoch and tag);
        return every rank's payload in group order."""


def _check_args(epoch: int, boundary: int, tag: str, payload: Payload) -> None:
    if tag not in TAGS:
        raise ValueError(f"rendezvous tag {tag!r} is not one of {TAGS}")
    for name, v in (("epoch", epoch), ("boundary", boundary), *((f"payload[{i}]", p) for i, p in enumerate(payload))):
        if type(v) is not int:
            raise TypeError(f"rendezvous {name} must be a Python int, got {type(v).__name__} ({v!r})")


class LocalRendezvous(RendezvousBase):
    """One process: every meeting completes at once."""

    def __init__(self, rank: int = 0) -> None:
        self.ranks, self.rank = (rank,), rank

    def meet(self, epoch: int, boundary: int, tag: str, payload: Payload = ()) -> list[Payload]:
        _check_args(epoch, boundary, tag, payload)
        return [tuple(payload)]


class Rendezvous(RendezvousBase):
    """Store-backed rendezvous over the ranks of `group` (a gloo or any process group; only its
    membership and the default store are used).

    `name` separates independent rendezvous over the same ranks; instances made with the same name
    get the name's next generation (`name.0`, `name.1`, ...), so a rendezvous rebuilt after a failure
    never reads the old one's keys, provided every rank builds its instances in the same order
    (as torch's `new_group` also requires). Meetings are numbered per instance, so every rank
    must make the same sequence of `meet` calls; a differing (epoch, tag) at the same call number
    raises `RendezvousMismatch` on every rank. `boundary` is not compared (ranks may legitimately
    report different progress that the caller wants to diagnose from the payloads); it names the
    meeting in errors."""

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float = 60.0, rank: int | None = None,
                 name: str = "turnstile", store: dist.Store | None = None) -> None:
        self.prefix = self._join(group, timeout_s, rank, name, "rendezvous")
        self._gather = comm_dist.StoreRendezvous(self.rank, self.ranks, timeout_s, self.prefix, store)
        self._poisoned: str | None = None

    def meet(self, epoch: int, boundary: int, tag: str, payload: Payload = ()) -> list[Payload]:
        _check_args(epoch, boundary, tag, payload)
        if self._poisoned:
            raise RuntimeError(f"rendezvous used after a failure ({self._poisoned}); build a new one")
        try:  # the store exchange is comm's; this layer adds the turnstile's checks and names
            values = self._gather.all_gather_object((epoch, boundary, tag, tuple(payload)), context="turnstile")
        except comm_dist.RendezvousTimeout as exc:
            err = RendezvousTimeout(exc.missing, epoch, boundary, tag, self.timeout_s, self.rank, exc.elapsed_s,
                                    exc.states)
            self._poisoned = str(err)
            raise err from None
        for r, (e, b, t, _) in zip(self.ranks, values):
            if (e, t) != (epoch, tag):
                seen = {rr: f"{ee}|{bb}|{tt}" for rr, (ee, bb, tt, _) in zip(self.ranks, values)}
                self._poisoned = f"mismatch at epoch {epoch}, {tag}"
                raise RendezvousMismatch(
                    f"rendezvous on rank {self.rank}: it is at epoch {epoch}, boundary {boundary}, {tag} "
                    f"but rank {r} is at epoch {e}, boundary {b}, {t}; all ranks (epoch|boundary|tag): {seen}. "
                    f"The ranks' plans or P boundary sequences diverged")
        return [v[3] for v in values]
