"""One error type for every wait on other ranks, and the diagnosis that names who is missing.

Every cross-rank wait (the turnstile's rendezvous, the engine's state gather, a dispatch domain's
count and data exchanges, an all-gather or all-reduce) fails with `CrossRankTimeout` or a subclass
(`comm.dist.RendezvousTimeout`, `comm.domain.DomainTimeout`, the turnstile's and the native
rendezvous's), so one `except CrossRankTimeout` catches them all. Each names the rank(s) that did
not arrive (or are dead), where the wait was (epoch, boundary, step, collective), and the time
actually waited: a peer whose connection resets fails a wait in a second, long before its timeout,
and the message says so instead of quoting the timeout.

Naming a rank needs more than the failed call: gloo says "Connection closed by peer [127.0.0.1]:9120"
or "Timed out waiting 2000ms for recv", not which rank. So every `DistComm` records each rank's
(host, pid) once at construction (`register_peers`); on a failure, ranks on this host are looked up
in /proc: gone or a zombie is *dead*, state T is *stopped* (SIGSTOP, a debugger), anything else is
alive. Ranks on other hosts cannot be inspected and are reported as such.

Left out: recovery (a failed communicator or rendezvous is poisoned; build new ones or restart)
and heartbeats (a rank that is alive but hung elsewhere is reported as alive).
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

_COMM_FAILURES = ("timed out", "timeout", "connection", "broken pipe", "peer", "socket", "unreachable", "nccl")


class Peer(NamedTuple):
    """Where one rank's process runs."""

    host: str
    pid: int


_peers: dict[int, Peer] = {}  # global rank -> its process, registered by DistComm


def this_process() -> Peer:
    return Peer(socket.gethostname(), os.getpid())


def register_peers(peers: Mapping[int, Peer]) -> None:
    """Remember every rank's process (global rank -> Peer), for naming dead or stopped ranks."""
    _peers.update(peers)


def peer_state(rank: int) -> str:
    """"dead", "stopped", "alive", or "unknown" (never registered, or on another host)."""
    peer = _peers.get(rank)
    if peer is None or peer.host != socket.gethostname():
        return "unknown"
    return process_state(peer.pid)


def process_state(pid: int) -> str:
    """"dead" (gone, or a zombie), "stopped" (SIGSTOP, a debugger) or "alive", for a pid on this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "dead"
    return {"Z": "dead", "X": "dead", "T": "stopped", "t": "stopped"}.get(state, "alive")


def absent_processes(ranks: Iterable[int] | None = None) -> dict[int, str]:
    """{rank: "dead" | "stopped"} among `ranks` (default: every registered rank)."""
    states = {r: peer_state(r) for r in (sorted(_peers) if ranks is None else ranks)}
    return {r: s for r, s in states.items() if s in ("dead", "stopped")}


def describe(states: Mapping[int, str]) -> str:
    """"rank 2 (pid 4242) is dead; rank 3 (pid 4243) is stopped"."""
    return "; ".join(f"rank {r}" + (f" (pid {_peers[r].pid})" if r in _peers else "") + f" is {s}"
                     for r, s in sorted(states.items()))


def comm_failure(exc: BaseException) -> str | None:
    """"connection closed", "timed out" or "failed" for an exception a communication library
    raised on a failed wait; None when it is not one (a bad argument, say: raise it as it is)."""
    text = str(exc).lower()
    if not isinstance(exc, (RuntimeError, OSError)) or not any(k in text for k in _COMM_FAILURES):
        return None
    if "timed out" in text or "timeout" in text:
        return "timed out"
    return "connection closed" if "connection" in text or "peer" in text or "pipe" in text else "failed"


class CrossRankTimeout(TimeoutError):
    """A wait on other ranks failed: they did not arrive in time, or the connection to one closed.

    `.missing`: global ranks that did not arrive, or, for a collective (which cannot say who is
    late), the dead or stopped ranks found on this host; `.states`: {rank: "dead" | "stopped"} of
    every registered rank found so at the failure; `.where`: the wait (epoch, boundary, step or
    collective); `.elapsed_s`: the time actually waited; `.rank`: the rank that saw it;
    `.position`: the engine step (and `mux` epoch) it happened in, when the engine knew."""

    def __init__(self, message: str, *, missing: Sequence[int] = (), where: str = "", elapsed_s: float | None = None,
                 rank: int | None = None, states: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.missing, self.where = message, tuple(missing), where
        self.elapsed_s, self.rank = elapsed_s, rank
        self.states = dict(absent_processes() if states is None else states)
        self.position: str | None = None

    @property
    def dead_ranks(self) -> list[int]:
        return sorted(r for r, s in self.states.items() if s == "dead")

    @property
    def stopped_ranks(self) -> list[int]:
        return sorted(r for r, s in self.states.items() if s == "stopped")

    def locate(self, position: str) -> "CrossRankTimeout":
        """Add where the engine was (the first caller that knows wins); returns self."""
        if self.position is None:
            self.position = position
            self.args = (f"{self.args[0]} [{position}]",) + self.args[1:]
        return self

    @classmethod
    def from_collective(cls, what: str, group: Sequence[int], rank: int, started: float,
                        exc: BaseException, timeout_s: float | None = None) -> "CrossRankTimeout | None":
        """The error for a wait on global ranks `group` (`what`: the wait, named as the message's
        start) that raised `exc` after starting at `started` (time.monotonic()); None if `exc` is
        not a communication failure. The message reads "<what> did not complete within <timeout>"
        for a timeout, "<what> failed after <s>: connection closed" for an early failure, then
        names the dead or stopped ranks."""
        kind = comm_failure(exc)
        if kind is None:
            return None
        elapsed = time.monotonic() - started
        states = absent_processes()
        culprits = sorted(r for r in states if r in group and r != rank) or sorted(states)
        if culprits:
            who = describe(states)
        else:
            unknown = [r for r in group if r != rank and peer_state(r) == "unknown"]
            who = ("no rank of the group is dead or stopped on this host"
                   + (f" (ranks {unknown} could not be inspected: another host)" if unknown else "")
                   + "; a peer may be hung, or issued a different collective")
        if kind == "timed out" and timeout_s is not None:
            how = f"did not complete within {timeout_s}s"
        else:
            how = f"failed after {elapsed:.1f} s ({kind})"
        message = f"{what} {how}: {who} ({type(exc).__name__}: {_first_line(exc)})"
        return cls(message, missing=culprits, where=what, elapsed_s=elapsed, rank=rank, states=states)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if len(text) <= 300 else text[:300] + "..."
