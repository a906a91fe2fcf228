"""The turnstile's rendezvous through shared memory, for groups whose ranks share one host, and
`make_rendezvous`, which picks it or the store rendezvous (docs/design.md §6).

Why: the turnstile meets twice per round, so the meeting's cost bounds how short a round can be
(`LoadSelected` trades it against D's waiting). The store rendezvous costs milliseconds at 8 ranks;
the shared-memory barrier (comm/shm_rendezvous.py, csrc/shm_rendezvous.cpp) costs microseconds.

`NativeRendezvous` keeps the store rendezvous's contract: same calls, same payloads in group order,
and the same error types. A timeout raises `RendezvousTimeout` (here `NativeRendezvousTimeout`, a
subclass that also says how long it actually waited and which missing ranks' processes are gone:
those fail the meeting at once instead of at the timeout); ranks at a different (epoch, tag) raise
`RendezvousMismatch` on every rank; after either, the rendezvous is poisoned.

`make_rendezvous` chooses once, at construction, the same way on every rank: native when every
rank of the group is on this host and every rank could build and attach the segment, else the
store (`Rendezvous`), with the reason logged. Needs the process group's store, like `Rendezvous`.

Deliberately left out: no cross-host shared memory, no payloads longer than the segment's slot
(8 ints; the turnstile sends at most 3).
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Literal, Sequence

import torch.distributed as dist

from megatron_rollout.comm import shm_rendezvous as shm
from megatron_rollout.comm.dist import StoreRendezvous
from megatron_rollout.comm.errors import process_state
from megatron_rollout.multiplex.rendezvous import (
    TAGS,
    Payload,
    Rendezvous,
    RendezvousBase,
    RendezvousMismatch,
    RendezvousTimeout,
    _check_args,
)

logger = logging.getLogger(__name__)

_TAG_IDS = {tag: i for i, tag in enumerate(TAGS)}

Prefer = Literal["auto", "native", "store"]


class NativeRendezvousTimeout(RendezvousTimeout):
    """`RendezvousTimeout` from the native path: also `.elapsed_s` (the time actually waited),
    `.dead` ({global rank: pid} of missing ranks whose process is gone) and `.stopped` (those whose
    process is stopped: SIGSTOP, a debugger)."""

    def __init__(self, missing: Sequence[int], epoch: int, boundary: int, tag: str, timeout_s: float, rank: int,
                 elapsed_s: float, dead: dict[int, int], stopped: dict[int, int] | None = None) -> None:
        super().__init__(missing, epoch, boundary, tag, timeout_s, rank)
        self.elapsed_s, self.dead, self.stopped = elapsed_s, dict(dead), dict(stopped or {})
        # comm.errors.CrossRankTimeout's view of who is gone, plus what the barrier found
        self.states = {**getattr(self, "states", {}), **{r: "stopped" for r in self.stopped},
                       **{r: "dead" for r in self.dead}}
        pids = {**self.stopped, **self.dead}
        absent = {r: s for r, s in sorted(self.states.items()) if r in self.missing}
        why = [f"rank {r}" + (f" (pid {pids[r]})" if r in pids else "") + f" is {s}" for r, s in absent.items()]
        alive = [r for r in self.missing if r not in absent]
        why += [f"rank(s) {alive} are alive but did not come"] if alive and absent else []
        gave_up = "gave up early: a missing process is gone" if self.dead else f"not within {timeout_s}s"
        self.args = (f"rank(s) {list(self.missing)} did not arrive at the {tag} rendezvous of epoch {epoch}, boundary "
                     f"{boundary}: waited {elapsed_s:.3f}s ({gave_up}; seen from rank {rank})"
                     + (f"; {'; '.join(why)}" if why else "") + "; check those ranks for a hang or crash",)
        self.message = self.args[0]


class NativeRendezvous(RendezvousBase):
    """Shared-memory rendezvous over the ranks of `group`, all on this host. Collective to build
    (like `Rendezvous`, with the same `name` generations); raises `shm.NativeUnavailable` on every
    rank if any rank cannot attach. Meetings are numbered per instance: every rank must make the
    same sequence of `meet` calls."""

    def __init__(self, group: dist.ProcessGroup | None = None, timeout_s: float = 60.0, rank: int | None = None,
                 name: str = "turnstile", store: dist.Store | None = None,
                 config: shm.ShmBarrierConfig = shm.ShmBarrierConfig()) -> None:
        self.prefix = self._join(group, timeout_s, rank, name, "native_rendezvous")
        self._barrier = shm.ShmBarrier.attach(self.rank, self.ranks, timeout_s, self.prefix, store, config)
        self._meet = self._barrier.meet
        self._poisoned: str | None = None

    def meet(self, epoch: int, boundary: int, tag: str, payload: Payload = ()) -> list[Payload]:
        if self._poisoned:
            raise RuntimeError(f"rendezvous used after a failure ({self._poisoned}); build a new one")
        tag_id = _TAG_IDS.get(tag)
        if tag_id is None:
            _check_args(epoch, boundary, tag, tuple(payload))  # raises the store path's error
        status, data = self._meet(epoch, boundary, tag_id, payload, self.timeout_s)
        if status == shm.OK:
            return data
        if status == shm.BAD_ARGS:  # not exact ints, not 64-bit, not a tuple/list, or too long: say which
            items = tuple(payload)
            _check_args(epoch, boundary, tag, items)
            if len(items) > self._barrier.max_payload:
                raise ValueError(f"rendezvous payload has {len(items)} ints; the native rendezvous carries at most "
                                 f"{self._barrier.max_payload}: send fewer or use the store Rendezvous")
            wide = next((v for v in (epoch, boundary, *items) if not -2**63 <= v < 2**63), None)
            if wide is not None or type(payload) in (tuple, list):
                raise ValueError(f"rendezvous epoch, boundary and payload must fit in 64 bits (the native "
                                 f"rendezvous's slots hold int64), got {wide}: send smaller ints or use the store "
                                 f"Rendezvous")
            return self.meet(epoch, boundary, tag, items)  # a generator or similar, now a tuple
        if status == shm.TIMEOUT:
            absence = self._barrier.absence(data)
            stopped = {self.ranks[i]: absence.pids[i] for i in absence.missing
                       if i not in absence.gone and process_state(absence.pids[i]) == "stopped"}
            err = NativeRendezvousTimeout([self.ranks[i] for i in absence.missing], epoch, boundary, tag,
                                          self.timeout_s, self.rank, absence.elapsed_s,
                                          {self.ranks[i]: absence.pids[i] for i in absence.gone}, stopped)
            self._poisoned = str(err)
            logger.error("%s", err)
            raise err
        seen = {r: f"{e}|{b}|{TAGS[t]}" for r, (e, b, t) in zip(self.ranks, data)}
        self._poisoned = f"mismatch at epoch {epoch}, {tag}"
        r, (e, b, t) = next((r, v) for r, v in zip(self.ranks, data) if (v[0], v[2]) != (epoch, tag_id))
        raise RendezvousMismatch(
            f"rendezvous on rank {self.rank}: it is at epoch {epoch}, boundary {boundary}, {tag} "
            f"but rank {r} is at epoch {e}, boundary {b}, {TAGS[t]}; all ranks (epoch|boundary|tag): {seen}. "
            f"The ranks' plans or P boundary sequences diverged")


def make_rendezvous(group: dist.ProcessGroup | None = None, timeout_s: float = 60.0, rank: int | None = None,
                    name: str = "turnstile", store: dist.Store | None = None, prefer: Prefer = "auto",
                    config: shm.ShmBarrierConfig = shm.ShmBarrierConfig()) -> RendezvousBase:
    """The turnstile's rendezvous over `group`: `NativeRendezvous` when every rank is on this host
    and the extension builds and attaches everywhere, else the store `Rendezvous` (the reason is
    logged). Collective over the group. `prefer="native"` raises `shm.NativeUnavailable` instead of
    falling back; `prefer="store"` skips the native attempt. `MEGATRON_ROLLOUT_NO_NATIVE=1` on any
    rank makes "auto" choose the store on every rank."""
    if prefer not in ("auto", "native", "store"):
        raise ValueError(f"prefer must be 'auto', 'native' or 'store', got {prefer!r}")
    if prefer == "store":
        return Rendezvous(group, timeout_s, rank, name=name, store=store)
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    me = dist.get_rank() if rank is None else rank
    reason = _native_blocker(me, ranks, timeout_s, name, store)
    if reason is None:
        try:
            return NativeRendezvous(group, timeout_s, rank, name=name, store=store, config=config)
        except shm.NativeUnavailable as exc:  # raised on every rank alike
            reason = str(exc)
    if prefer == "native":
        raise shm.NativeUnavailable(reason)
    logger.info("turnstile rendezvous %r over ranks %s uses the store: %s", name, list(ranks), reason)
    return Rendezvous(group, timeout_s, rank, name=name, store=store)


_choices: dict[tuple[str, str], int] = {}  # per process, so each choice has its own store keys


def _native_blocker(rank: int, ranks: tuple[int, ...], timeout_s: float, name: str,
                    store: dist.Store | None) -> str | None:
    """Why the native path cannot serve this group (the same answer on every rank), or None."""
    try:
        shm.load_extension()
        mine = None
    except shm.NativeUnavailable as exc:
        mine = str(exc)
    members = "-".join(map(str, ranks))
    n = _choices.get((name, members), 0)
    _choices[(name, members)] = n + 1
    prefix = f"megatron_rollout/native_rendezvous/choice/{name}.{n}/{members}/"
    seen = StoreRendezvous(rank, ranks, timeout_s, prefix, store).all_gather_object(
        (socket.gethostname(), os.getpid(), mine), context="native rendezvous choice")
    hosts = {r: h for r, (h, _, _) in zip(ranks, seen)}
    if len(set(hosts.values())) > 1:
        return f"the group spans hosts {hosts}"
    problems = [f"rank {r}: {p}" for r, (_, _, p) in zip(ranks, seen) if p is not None]
    return "; ".join(problems) if problems else None


__all__ = ["NativeRendezvous", "NativeRendezvousTimeout", "make_rendezvous"]
