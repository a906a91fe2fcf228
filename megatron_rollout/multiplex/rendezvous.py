"""CPU rendezvous for the turnstile: every rank of the full group meets, or everyone learns who
did not come (DESIGN.md §6).

Why not `dist.barrier` on a gloo group: a gloo barrier that times out says nothing about *which*
rank is missing, and `monitored_barrier(wait_all_ranks=True)` names the missing ranks on rank 0
only (the other ranks just time out waiting for rank 0). The turnstile needs every arrived rank to
fail with the same diagnosis, so this module meets through the process group's key-value store:
each rank sets one key per meeting and waits (server side, with a deadline) for the keys of the
others; on timeout it checks which keys are absent and raises `RendezvousTimeout` naming them.
Each key also carries the rank's (epoch, boundary, tag) and a small tuple of ints, so a meeting
returns what every rank brought: the turnstile uses that to agree on boundary counts, decode rows
and cancellation without a separate collective. Its errors subclass comm.dist's
(`RendezvousTimeout`, `RendezvousMismatch`), which DistComm's state gather raises the same way.

Deliberately left out: no device synchronisation (P work already submitted keeps running), no
retry (a timed-out rendezvous is poisoned: the engine cancels the epoch and builds a new one),
and no payloads beyond a few ints.
"""
from __future__ import annotations

import abc
import logging
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

from megatron_rollout.comm import dist as comm_dist

logger = logging.getLogger(__name__)

TAGS = ("pre-D", "post-D", "naive-poll")  # naive-poll: the unsafe baseline agreeing on epoch ends

Payload = tuple[int, ...]


class RendezvousTimeout(comm_dist.RendezvousTimeout):
    """Some ranks did not reach a turnstile rendezvous in time. `.missing` are their global ranks.

    A subclass of comm's `RendezvousTimeout`, so one `except` catches a timeout in either the
    engine's state gather or the turnstile; adds the turnstile's `.epoch`, `.boundary`, `.tag`."""

    def __init__(self, missing: Sequence[int], epoch: int, boundary: int, tag: str, timeout_s: float,
                 rank: int) -> None:
        missing = tuple(missing)
        super().__init__(f"rank(s) {list(missing)} did not arrive at the {tag} rendezvous of epoch "
                         f"{epoch}, boundary {boundary} within {timeout_s}s (seen from rank {rank}); "
                         f"check those ranks for a hang or crash",
                         missing, f"turnstile {tag}, epoch {epoch}, boundary {boundary}")
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

    _generations: dict[tuple[str, str], int] = {}  # per process; see the class docstring

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float = 60.0, rank: int | None = None,
                 name: str = "turnstile", store: dist.Store | None = None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"rendezvous timeout must be positive, got {timeout_s}")
        self.ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        self.rank = dist.get_rank() if rank is None else rank
        if self.rank not in self.ranks:
            raise ValueError(f"rank {self.rank} is not in the rendezvous group {list(self.ranks)}")
        self.timeout_s = timeout_s
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        members = "-".join(map(str, self.ranks))
        generation = Rendezvous._generations.get((name, members), 0)
        Rendezvous._generations[(name, members)] = generation + 1
        self.prefix = f"megatron_rollout/rendezvous/{name}.{generation}/{members}/"
        self._store = dist.PrefixStore(self.prefix, base)
        self._seq = 0
        self._poisoned: str | None = None

    def _key(self, seq: int, rank: int) -> str:
        return f"{seq}/{rank}"

    def meet(self, epoch: int, boundary: int, tag: str, payload: Payload = ()) -> list[Payload]:
        _check_args(epoch, boundary, tag, payload)
        if self._poisoned:
            raise RuntimeError(f"rendezvous used after a failure ({self._poisoned}); build a new one")
        seq, self._seq = self._seq, self._seq + 1
        mine = f"{epoch}|{boundary}|{tag}|" + ",".join(map(str, payload))
        self._store.set(self._key(seq, self.rank), mine.encode())
        keys = [self._key(seq, r) for r in self.ranks]
        try:
            self._store.wait(keys, timedelta(seconds=self.timeout_s))
            values = [v.decode() for v in self._store.multi_get(keys)]
        except dist.DistError as exc:
            try:
                missing = [r for r, k in zip(self.ranks, keys) if not self._store.check([k])]
            except dist.DistError:  # the store itself is gone: its host (global rank 0) died
                missing = [0]
            err = RendezvousTimeout(missing, epoch, boundary, tag, self.timeout_s, self.rank)
            self._poisoned = str(err)
            logger.error("%s (%s: %s)", err, type(exc).__name__, exc)
            raise err from None
        if seq > 0:
            # Every rank has set its key for `seq`, so all of them finished reading `seq - 1`.
            self._store.delete_key(self._key(seq - 1, self.rank))
        payloads: list[Payload] = []
        for r, v in zip(self.ranks, values):
            e, b, t, p = v.split("|")
            if (int(e), t) != (epoch, tag):
                seen = {rr: vv.rsplit("|", 1)[0] for rr, vv in zip(self.ranks, values)}
                self._poisoned = f"mismatch at meeting {seq}"
                raise RendezvousMismatch(
                    f"rendezvous {seq}: rank {self.rank} is at epoch {epoch}, boundary {boundary}, {tag} "
                    f"but rank {r} is at epoch {e}, boundary {b}, {t}; all ranks (epoch|boundary|tag): {seen}. "
                    f"The ranks' plans or P boundary sequences diverged")
            payloads.append(tuple(int(x) for x in p.split(",")) if p else ())
        return payloads
