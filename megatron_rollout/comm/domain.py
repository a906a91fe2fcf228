"""Dispatch domains: the mutable expert-dispatch state one phase owns (docs/design.md §2, §6; paper §5).

A domain is one phase's communicator over the EP ranks plus everything its dispatches mutate:
send/recv buffers, the count-exchange workspace, a sequence number and a generation. P and D each
own one, so a P dispatch left half-way (counts exchanged, data not yet sent) shares no buffer,
counter or communicator sequence with the D dispatches that run in the meantime.

One dispatch, split at the point where P may stop for D:

    layout(topk_ids, num_experts) -> Layout        local: tokens per rank and per expert
    notify(layout) -> PendingDispatch              the count exchange, submitted asynchronously
        ... a boundary: whole D iterations may run here on D's domain ...
    dispatch(pending, x, topk_ids, topk_weights) -> Received(x, meta, handle)
    compute(received, experts) -> y                the caller's expert forward on what arrived
    combine(handle, y) -> out [N, H]

State machine: IDLE -> NOTIFIED -> DISPATCHED -> IDLE (`state` says where a domain is). A domain
holds at most one pending dispatch, and at most `max_outstanding` dispatched-but-not-combined
handles (1 for a normal domain, 2 for a low-latency one: its double buffer). A call the state does
not allow raises `IllegalTransition` and changes nothing (nothing was issued). Communication
failures and abandoned operations move the domain to RETIRED: it refuses all work until `reset()`,
which is only legal once nothing is in flight, and which bumps the generation so that pending
objects and handles from before are refused (`StaleDispatch`).

Rank-order checks: the count message to each peer carries this domain's sequence number. If the
ranks disagree about which dispatch this is (one reset alone, one skipped a dispatch), every rank
sees a foreign sequence number in its counts and raises `SequenceMismatch`; a peer that never
issues the exchange makes the wait fail after `timeout_s` with `DomainTimeout` (a
`comm.errors.CrossRankTimeout` naming dead or stopped ranks and the time waited; a data exchange
whose peer is gone fails the same way). Neither hangs.

Left out: the data movement itself (backends: `alltoall.py`, `deepep.py`), which tokens a rank
sends (the exchange decides, see `AllToAllExchange`), and any cross-phase ordering (the turnstile).
"""
from __future__ import annotations

import abc
import collections
import contextlib
import enum
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

import torch
import torch.distributed as dist

from megatron_rollout.comm.errors import CrossRankTimeout, comm_failure
from megatron_rollout.comm.exchange import compute_local

if TYPE_CHECKING:
    from megatron_rollout.forward import Experts

logger = logging.getLogger(__name__)


class DomainState(enum.Enum):
    IDLE = "idle"
    NOTIFIED = "notified"  # a count exchange is submitted; data not yet sent
    DISPATCHED = "dispatched"  # data delivered; combine(s) outstanding
    RETIRED = "retired"  # refuses work until reset()


class DomainError(RuntimeError):
    """A dispatch-domain operation was refused or failed."""


class IllegalTransition(DomainError):
    """The operation is not allowed in the domain's current state."""


class DomainRetired(DomainError):
    """The domain was retired by an error or an abandoned operation; reset() it first."""


class StaleDispatch(DomainError):
    """A pending dispatch or handle that is no longer current (consumed, or from before a reset)."""


class SequenceMismatch(DomainError):
    """Ranks exchanged counts for different dispatches: they issued them in different orders."""


class DomainTimeout(DomainError, CrossRankTimeout):
    """A wait on the domain's communicator failed: it timed out, or a peer's connection closed."""

    def __init__(self, message: str, **diagnosis) -> None:
        CrossRankTimeout.__init__(self, message, **diagnosis)


@dataclass(frozen=True)
class Layout:
    """Where one rank's tokens go. Computed locally from the routing."""

    num_experts: int
    tokens_per_rank: torch.Tensor  # [ep] int64: tokens sent to each EP rank (a token goes once per rank)
    tokens_per_expert: torch.Tensor  # [num_experts] int64: (token, expert) pairs per expert
    is_token_in_rank: torch.Tensor  # [N, ep] bool

    @property
    def num_tokens(self) -> int:
        return self.is_token_in_rank.shape[0]


@dataclass(eq=False)
class PendingDispatch:
    """A submitted count exchange. Holds its buffers, so they live as long as the exchange."""

    domain: str
    generation: int
    seq: int
    layout: Layout
    send_header: torch.Tensor  # [ep, 2 + local experts] int64: seq, tokens, tokens per peer expert
    recv_header: torch.Tensor  # same, as received from each peer
    work: Any  # the torch.distributed Work of the exchange


@dataclass(eq=False)
class Handle:
    """What `combine` needs to return one dispatch's results to their tokens."""

    domain: str
    generation: int
    seq: int
    num_tokens: int
    state: Any  # backend-specific


@dataclass(frozen=True)
class RecvMeta:
    """Routing of the received rows. Token-major backends fill `topk_ids`/`topk_weights` ([n, k];
    global expert ids; ids of other ranks' experts and -1 are not this rank's work); expert-major
    ones (DeepEP low-latency) leave them None and apply weights in combine."""

    topk_ids: torch.Tensor | None
    topk_weights: torch.Tensor | None
    tokens_per_source: torch.Tensor  # [ep] valid rows received from each EP rank
    tokens_per_expert: torch.Tensor  # [local experts] (token, expert) pairs received per local expert


class Received(NamedTuple):
    x: torch.Tensor
    meta: RecvMeta
    handle: Handle


HEADER = 2  # leading columns of a count message: sequence number, tokens sent to that peer


class DispatchDomain(abc.ABC):
    """State machine, count exchange and checks; subclasses move the data."""

    max_outstanding: int = 1

    def __init__(self, name: str, group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        self.name, self.group, self.device, self.timeout_s = name, group, torch.device(device), timeout_s
        self.ep_rank = dist.get_rank(group)
        self.ep_size = dist.get_world_size(group)
        self.generation = 0
        self.seq = 0  # next dispatch's sequence number; identical on every rank unless they diverged
        self._pending: PendingDispatch | None = None
        self._outstanding: collections.deque[Handle] = collections.deque()
        self._retired: str | None = None
        self._broken = False  # a communicator failed: reset() cannot make it usable again

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, state={self.state.value}, gen={self.generation}, seq={self.seq})"

    @property
    def state(self) -> DomainState:
        if self._retired is not None:
            return DomainState.RETIRED
        if self._pending is not None:
            return DomainState.NOTIFIED
        return DomainState.DISPATCHED if self._outstanding else DomainState.IDLE

    # ---- the protocol ------------------------------------------------------------------------
    def layout(self, topk_ids: torch.Tensor, num_experts: int) -> Layout:
        """topk_ids: [N, k] global expert ids (-1: no expert)."""
        ep = self.ep_size
        if num_experts % ep:
            raise ValueError(f"{self.name}: {num_experts} experts do not divide over {ep} EP ranks")
        if topk_ids.numel() and int(topk_ids.max()) >= num_experts:
            raise ValueError(f"{self.name}: expert id {int(topk_ids.max())} >= num_experts {num_experts}")
        valid = topk_ids >= 0
        owner = torch.where(valid, topk_ids // (num_experts // ep), ep)  # invalid ids to a dropped column
        in_rank = torch.zeros(topk_ids.shape[0], ep + 1, dtype=torch.bool, device=topk_ids.device)
        in_rank = in_rank.scatter_(1, owner, True)[:, :ep]
        per_expert = torch.bincount(topk_ids[valid], minlength=num_experts)
        return Layout(num_experts, in_rank.sum(0), per_expert, in_rank)

    def notify(self, layout: Layout) -> PendingDispatch:
        """Submit the count exchange (asynchronously) and return the pending dispatch."""
        self._require_live("notify")
        if self._pending is not None:
            raise IllegalTransition(f"{self.name}: notify while dispatch #{self._pending.seq} is pending; at most "
                                    f"one pending dispatch per domain: dispatch or cancel it first")
        if len(self._outstanding) >= self.max_outstanding:
            raise IllegalTransition(f"{self.name}: notify with {len(self._outstanding)} dispatch(es) not combined "
                                    f"(at most {self.max_outstanding}); combine #{self._outstanding[0].seq} first")
        self._check_layout(layout)
        ep, local = self.ep_size, layout.num_experts // self.ep_size
        send = torch.empty(ep, HEADER + local, dtype=torch.int64, device=self.device)
        send[:, 0] = self._header_seq()
        send[:, 1] = layout.tokens_per_rank
        send[:, HEADER:] = layout.tokens_per_expert.view(ep, local)
        recv = torch.empty_like(send)
        with self._guard(f"notify #{self.seq}"):
            work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        self._pending = PendingDispatch(self.name, self.generation, self.seq, layout, send, recv, work)
        self.seq += 1
        return self._pending

    def dispatch(self, pending: PendingDispatch, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> Received:
        """Wait for the counts (checking the sequence), then move x [N, H] and its routing."""
        self._require_live("dispatch")
        self._require_pending(pending, "dispatch")
        if x.shape[0] != pending.layout.num_tokens or topk_ids.shape != topk_weights.shape:
            raise ValueError(f"{self.name}: dispatch #{pending.seq} got x {tuple(x.shape)}, ids "
                             f"{tuple(topk_ids.shape)}, weights {tuple(topk_weights.shape)} for a layout of "
                             f"{pending.layout.num_tokens} tokens")
        self._check_inputs(x)
        header = self._await_header(pending)
        self._pending = None
        with self._guard(f"dispatch #{pending.seq}"):
            recv_x, meta, state = self._dispatch(pending, header, x, topk_ids, topk_weights)
        handle = Handle(self.name, self.generation, pending.seq, x.shape[0], state)
        self._outstanding.append(handle)
        return Received(recv_x, meta, handle)

    def compute(self, received: Received, experts: "Experts") -> torch.Tensor:
        """This rank's experts on the received rows, weighted (token-major layout)."""
        meta = received.meta
        return compute_local(received.x, meta.topk_ids, meta.topk_weights, experts)

    def combine(self, handle: Handle, y: torch.Tensor) -> torch.Tensor:
        """Return `y` (rows as received) to the tokens' ranks and sum per token: [N, H]."""
        self._require_live("combine")
        self._require_handle(handle)
        with self._guard(f"combine #{handle.seq}"):
            out = self._combine(handle, y)
        self._outstanding.popleft()
        return out

    def cancel(self, pending: PendingDispatch) -> None:
        """Give up a pending dispatch on every rank: complete its count exchange, send no data."""
        self._require_live("cancel")
        self._require_pending(pending, "cancel")
        self._await_header(pending)
        self._pending = None

    def abandon(self, reason: str) -> None:
        """An operation will not be finished (e.g. dispatched data will never be combined)."""
        self._retire(f"abandoned: {reason}")

    def reset(self) -> None:
        """Back to IDLE with a new generation, once nothing is in flight. Call on every rank."""
        if self._broken:
            raise DomainError(f"{self.name}: cannot reset: its communicator failed ({self._retired}); collectives "
                              f"on it may be half-done. Rebuild the comm (a new DistComm) or restart the processes")
        if self._pending is not None:
            started = time.monotonic()
            try:
                self._pending.work.wait(timeout=timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                self._retire(f"reset: count exchange #{self._pending.seq} still in flight ({exc})", broken=True)
                raise self._timeout(f"reset: count exchange #{self._pending.seq} still in flight", started, exc,
                                    "the domain is not quiescent") from exc
        logger.info("%s: reset from %s (generation %d -> %d)", self.name, self.state.value, self.generation,
                    self.generation + 1)
        self.generation += 1
        self.seq = 0
        self._pending = None
        self._outstanding.clear()
        self._retired = None

    # ---- backend hooks -----------------------------------------------------------------------
    def _header_seq(self) -> int | torch.Tensor:
        """The sequence number a count message carries (a sync-free domain keeps it on the device)."""
        return self.seq

    def _check_layout(self, layout: Layout) -> None:
        """Refuse a layout before anything is issued (e.g. more tokens than static buffers hold)."""

    def _check_inputs(self, x: torch.Tensor) -> None:
        """Refuse inputs before anything is issued (e.g. a dtype the backend cannot move)."""

    @abc.abstractmethod
    def _dispatch(self, pending: PendingDispatch, header: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> tuple[torch.Tensor, RecvMeta, Any]:
        """Move the data. header: [ep, 2 + local] as received (row r from EP rank r), on the CPU.
        Returns (received rows, their meta, the backend state `combine` gets in the handle)."""

    @abc.abstractmethod
    def _combine(self, handle: Handle, y: torch.Tensor) -> torch.Tensor:
        """Send y back and reduce per token: [handle.num_tokens, H]."""

    # ---- checks and transitions --------------------------------------------------------------
    def _await_header(self, pending: PendingDispatch) -> torch.Tensor:
        started = time.monotonic()
        try:
            pending.work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            self._retire(f"count exchange #{pending.seq} failed: {exc}", broken=True)
            raise self._timeout(f"count exchange #{pending.seq}", started, exc,
                                "an EP rank is gone, or issued a different collective on this domain; "
                                "the domain is retired") from exc
        header = pending.recv_header.cpu()
        seqs = header[:, 0].tolist()
        wrong = {r: s for r, s in enumerate(seqs) if s != pending.seq}
        if wrong:
            self._retire(f"sequence mismatch at dispatch #{pending.seq}")
            raise SequenceMismatch(
                f"{self.name} on EP rank {self.ep_rank}: count exchange out of order: this rank is at dispatch "
                f"#{pending.seq} but EP rank(s) {sorted(wrong)} sent #{[wrong[r] for r in sorted(wrong)]}. The ranks "
                f"issued this domain's dispatches in different orders (or some reset it alone). The domain is "
                f"retired: reset() it on every rank.")
        return header

    def _require_live(self, op: str) -> None:
        if self._retired is not None:
            raise DomainRetired(f"{self.name}: {op} refused: the domain is retired ({self._retired}); call reset() "
                                f"on every rank once nothing is in flight")

    def _require_pending(self, pending: PendingDispatch, op: str) -> None:
        if pending.domain != self.name or pending.generation != self.generation:
            raise StaleDispatch(f"{self.name}: {op} of dispatch #{pending.seq} from {pending.domain!r} generation "
                                f"{pending.generation}; this domain is at generation {self.generation} (reset since)")
        if self._pending is None:
            raise StaleDispatch(f"{self.name}: {op} of dispatch #{pending.seq}, which was already dispatched or "
                                f"cancelled (state {self.state.value})")
        if pending is not self._pending:
            raise StaleDispatch(f"{self.name}: {op} of dispatch #{pending.seq}; the pending one is "
                                f"#{self._pending.seq}")

    def _require_handle(self, handle: Handle) -> None:
        if handle.domain != self.name or handle.generation != self.generation:
            raise StaleDispatch(f"{self.name}: combine of handle #{handle.seq} from {handle.domain!r} generation "
                                f"{handle.generation}; this domain is at generation {self.generation} (reset since)")
        if not any(h is handle for h in self._outstanding):
            raise StaleDispatch(f"{self.name}: combine of handle #{handle.seq}, which was already combined")
        if self._outstanding[0] is not handle:
            raise IllegalTransition(f"{self.name}: combine #{handle.seq} before #{self._outstanding[0].seq}; "
                                    f"combines follow dispatch order on every rank")

    def _retire(self, reason: str, broken: bool = False) -> None:
        if self._retired is None:
            logger.warning("%s: retired on EP rank %d: %s", self.name, self.ep_rank, reason)
            self._retired = reason
        self._broken = self._broken or broken

    def _timeout(self, what: str, started: float, exc: BaseException, consequence: str) -> DomainTimeout:
        """The named error for a failed wait on this domain's communicator (see `comm.errors`)."""
        where = f"{self.name} on EP rank {self.ep_rank}: {what}"
        found = CrossRankTimeout.from_collective(where, dist.get_process_group_ranks(self.group), dist.get_rank(),
                                                 started, exc, self.timeout_s)
        if found is None:  # not a recognised communication failure: still name the wait and the time
            elapsed = time.monotonic() - started
            found = CrossRankTimeout(f"{where} failed after {elapsed:.1f} s ({type(exc).__name__}: {exc})",
                                     where=where, elapsed_s=elapsed, rank=dist.get_rank())
        return DomainTimeout(f"{found.message}; {consequence}", missing=found.missing, where=where,
                             elapsed_s=found.elapsed_s, rank=found.rank, states=found.states)

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Any failure while a collective may be half-issued retires the domain for good; a
        communication failure (a peer gone or late) is a `DomainTimeout` naming who."""
        started = time.monotonic()
        try:
            yield
        except Exception as exc:
            self._retire(f"{what} failed: {type(exc).__name__}: {exc}", broken=True)
            if comm_failure(exc) is not None:
                raise self._timeout(what, started, exc, "the domain is retired") from exc
            raise DomainError(f"{self.name} on EP rank {self.ep_rank}: {what} failed ({type(exc).__name__}: {exc}); "
                              f"the domain is retired") from exc
