"""The boundary controller: which P boundaries may run, checked event by event (docs/design.md §6).

P publishes the id of every safe boundary it reaches; the controller accepts a publish only when
it belongs to the open epoch, is exactly the next id, and lies within the *permitted endpoint*
that the turnstile advances once per completed post-D rendezvous. Everything else is rejected with
a `BoundaryError` whose `.reason` says which rule broke, so a stale or reordered event can never
silently move P past a point where D was not ordered in.

Counting convention: an epoch whose P forward has B boundaries consists of B + 1 segments;
segment i ends at boundary i and segment B + 1 ends where the forward returns. The permitted
endpoint counts segments, so P may publish ids up to `permitted` and may run past its last
boundary (finish) once `permitted > B`.

Deliberately left out: the controller holds Python ints only (no tensors, no clocks, no locks:
one host driver per rank owns it), it does not know how many boundaries an epoch has, and it does
not choose spans (that is `policy.py`) or talk to other ranks (that is `rendezvous.py`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

REASONS = frozenset({"stale", "duplicate", "missing", "nonmonotone", "over-permitted"})


class BoundaryError(ValueError):
    """A rejected boundary publish. `.reason` is one of `REASONS`."""

    def __init__(self, epoch: object, boundary_id: object, reason: str, detail: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown boundary rejection reason {reason!r}; known: {sorted(REASONS)}")
        self.epoch, self.boundary_id, self.reason = epoch, boundary_id, reason
        self.rank: int | None = None
        self.last: int | None = None
        self.permitted: int | None = None
        super().__init__(f"boundary {boundary_id} of epoch {epoch} rejected ({reason}): {detail}")

    @classmethod
    def rejected(cls, epoch: int, boundary_id: int, reason: str, last: int, permitted: int,
                 rank: int | None = None) -> "BoundaryError":
        """The controller's error for `reason`, built from ints only, so that every rank can raise
        the identical error from a rendezvous payload (`rank`: the rank whose controller rejected)."""
        detail = {
            "stale": "no epoch is open",
            "duplicate": f"boundary {last} was already published",
            "nonmonotone": f"ids start at 1 and increase; last published is {last}",
            "missing": f"expected {last + 1}; boundaries {last + 1}..{boundary_id - 1} were skipped",
            "over-permitted": f"the permitted endpoint is {permitted}",
        }.get(reason, "")
        where = "" if rank is None else f"rank {rank}'s P forward: "
        err = cls(epoch, boundary_id, reason, where + detail)
        err.rank, err.last, err.permitted = rank, last, permitted
        return err


class ProtocolError(RuntimeError):
    """A controller call made out of protocol order (e.g. advance without a post-D rendezvous)."""


def _require_int(name: str, value: object) -> int:
    # bool is an int subclass, and a 0-d tensor would compare like one: both are caller bugs here.
    if type(value) is not int:
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__} ({value!r})")
    return value


@dataclass(frozen=True)
class ControllerState:
    """A snapshot for logs and timelines. `epoch` is None between epochs."""

    epoch: int | None
    last_epoch: int | None
    last_published: int
    permitted: int
    post_d_pending: bool


class BoundaryController:
    """Per-rank bookkeeping of one P execution's boundaries. Not thread-safe by design: only the
    turnstile's host driver calls it."""

    def __init__(self) -> None:
        self._epoch: int | None = None  # open epoch
        self._last_epoch: int | None = None  # most recently begun epoch (open or closed)
        self._last = 0  # last accepted boundary id of the open epoch
        self._permitted = 0  # segments P may run in the open epoch
        self._post_d = False  # a post-D rendezvous completed and no advance consumed it yet

    # -- queries ------------------------------------------------------------------------------
    @property
    def epoch(self) -> int | None:
        return self._epoch

    @property
    def last_published(self) -> int:
        return self._last

    @property
    def permitted(self) -> int:
        return self._permitted

    def may_run_next_segment(self) -> bool:
        """Whether P may resume towards its next boundary (or its end)."""
        return self._epoch is not None and self._last < self._permitted

    def state(self) -> ControllerState:
        return ControllerState(self._epoch, self._last_epoch, self._last, self._permitted, self._post_d)

    # -- epoch lifetime -----------------------------------------------------------------------
    def begin_epoch(self, epoch: int) -> None:
        _require_int("epoch", epoch)
        if self._epoch is not None:
            raise ProtocolError(f"begin_epoch({epoch}): epoch {self._epoch} is still open; "
                                f"end_epoch() or cancel_epoch() it first")
        if self._last_epoch is not None and epoch <= self._last_epoch:
            raise ProtocolError(f"begin_epoch({epoch}): epochs must strictly increase, last was "
                                f"{self._last_epoch}")
        self._epoch = self._last_epoch = epoch
        self._last, self._permitted, self._post_d = 0, 0, False

    def end_epoch(self) -> None:
        """Close the open epoch after P finished."""
        if self._epoch is None:
            raise ProtocolError("end_epoch(): no epoch is open")
        self._close()

    def cancel_epoch(self) -> None:
        """Close the open epoch wherever it stands (a cancelled request, a failed rendezvous).
        Safe to call with no epoch open; the next epoch must still be numbered higher."""
        if self._epoch is not None:
            logger.info("epoch %d cancelled at boundary %d (permitted %d)", self._epoch, self._last,
                        self._permitted)
        self._close()

    def _close(self) -> None:
        self._epoch = None
        self._last, self._permitted, self._post_d = 0, 0, False

    # -- the protocol -------------------------------------------------------------------------
    def mark_post_d_complete(self) -> None:
        """Record that this round's post-D rendezvous completed; permits exactly one `advance`."""
        if self._epoch is None:
            raise ProtocolError("mark_post_d_complete(): no epoch is open")
        if self._post_d:
            raise ProtocolError(f"mark_post_d_complete(): epoch {self._epoch} already has a completed "
                                f"post-D rendezvous that no advance() consumed")
        self._post_d = True

    def advance(self, span: int) -> int:
        """Move the permitted endpoint `span` segments forward; returns the new endpoint."""
        _require_int("span", span)
        if span <= 0:
            raise ValueError(f"advance(span={span}): the span must be a positive number of segments")
        if self._epoch is None:
            raise ProtocolError(f"advance({span}): no epoch is open")
        if not self._post_d:
            raise ProtocolError(f"advance({span}) in epoch {self._epoch}: no completed post-D "
                                f"rendezvous since the last advance; call mark_post_d_complete() after it")
        self._post_d = False
        self._permitted += span
        return self._permitted

    def publish(self, epoch: int, boundary_id: int) -> None:
        """Accept boundary `boundary_id` of `epoch`, or raise `BoundaryError`."""
        _require_int("epoch", epoch)
        _require_int("boundary_id", boundary_id)
        if epoch != self._epoch:
            now = "no epoch is open" if self._epoch is None else f"the open epoch is {self._epoch}"
            raise BoundaryError(epoch, boundary_id, "stale", now)
        last, permitted = self._last, self._permitted
        reason = ("duplicate" if boundary_id == last and last > 0 else "nonmonotone" if boundary_id <= last
                  else "missing" if boundary_id > last + 1 else "over-permitted" if boundary_id > permitted else None)
        if reason is not None:
            raise BoundaryError.rejected(epoch, boundary_id, reason, last, permitted)
        self._last = boundary_id
