"""BoundaryController against an independent history-based model, plus the error contract."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rollout.multiplex.controller import REASONS, BoundaryController, BoundaryError, ProtocolError


class Reference:
    """Legality from the history of accepted events only (no running counters)."""

    def __init__(self) -> None:
        self.begun: list[int] = []
        self.open: int | None = None
        self.ids: list[int] = []  # accepted ids of the open epoch
        self.spans: list[int] = []  # accepted spans of the open epoch
        self.marks = 0  # completed post-D rendezvous in the open epoch

    def permitted(self) -> int:
        return sum(self.spans)

    def legal(self, ev: tuple) -> tuple[bool, str | None]:
        kind = ev[0]
        if kind == "begin":
            return self.open is None and all(ev[1] > e for e in self.begun), None
        if kind == "publish":
            e, i = ev[1], ev[2]
            if e != self.open:
                return False, "stale"
            if self.ids and i == self.ids[-1]:
                return False, "duplicate"
            if i <= len(self.ids):
                return False, "nonmonotone"
            if i > len(self.ids) + 1:
                return False, "missing"
            if i > self.permitted():
                return False, "over-permitted"
            return True, None
        if kind == "mark":
            return self.open is not None and self.marks == len(self.spans), None
        if kind == "advance":
            return self.open is not None and ev[1] > 0 and self.marks == len(self.spans) + 1, None
        if kind == "end":
            return self.open is not None, None
        return True, None  # cancel

    def apply(self, ev: tuple) -> None:
        kind = ev[0]
        if kind == "begin":
            self.begun.append(ev[1])
            self.open, self.ids, self.spans, self.marks = ev[1], [], [], 0
        elif kind == "publish":
            self.ids.append(ev[2])
        elif kind == "mark":
            self.marks += 1
        elif kind == "advance":
            self.spans.append(ev[1])
        else:
            self.open, self.ids, self.spans, self.marks = None, [], [], 0


def call(ctl: BoundaryController, ev: tuple) -> None:
    kind = ev[0]
    if kind == "begin":
        ctl.begin_epoch(ev[1])
    elif kind == "publish":
        ctl.publish(ev[1], ev[2])
    elif kind == "mark":
        ctl.mark_post_d_complete()
    elif kind == "advance":
        ctl.advance(ev[1])
    elif kind == "end":
        ctl.end_epoch()
    else:
        ctl.cancel_epoch()


small = st.integers(-1, 7)
events = st.one_of(
    st.tuples(st.just("begin"), st.integers(0, 6)),
    st.tuples(st.just("publish"), small, small),
    st.tuples(st.just("publish_next")),  # resolved to (current epoch, last + 1): often legal
    st.tuples(st.just("mark")),
    st.tuples(st.just("advance"), st.integers(-1, 3)),
    st.tuples(st.just("end")),
    st.tuples(st.just("cancel")),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(events, max_size=60))
def test_random_sequences_match_reference(seq):
    ctl, ref = BoundaryController(), Reference()
    accepted = 0
    for ev in seq:
        if ev[0] == "publish_next":
            ev = ("publish", ref.open if ref.open is not None else 0, len(ref.ids) + 1)
        ok, reason = ref.legal(ev)
        if ok:
            call(ctl, ev)  # a legal event must never be rejected
            ref.apply(ev)
            accepted += 1
        else:
            expected = BoundaryError if ev[0] == "publish" else (ValueError, ProtocolError)
            with pytest.raises(expected) as info:
                call(ctl, ev)
            if ev[0] == "publish":
                assert info.value.reason == reason, (ev, info.value)
        state = ctl.state()
        if ref.open is None:
            assert state.epoch is None and state.permitted == 0 and state.last_published == 0
        else:
            assert (state.epoch, state.last_published, state.permitted) == (ref.open, len(ref.ids), ref.permitted())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.lists(st.integers(1, 5), min_size=1, max_size=8)),
                min_size=1, max_size=4))
def test_every_legal_epoch_completes(epochs):
    """begin → rounds of (post-D, advance, publish up to the endpoint) → end, for any boundary
    count and any positive spans (cycled): all boundaries get published, in the expected rounds."""
    ctl = BoundaryController()
    for epoch, (boundaries, spans) in enumerate(epochs, start=3):
        ctl.begin_epoch(epoch)
        published, rounds, finished = [], 0, False
        while not finished:
            ctl.mark_post_d_complete()
            ctl.advance(spans[rounds % len(spans)])
            rounds += 1
            while ctl.may_run_next_segment():
                if ctl.last_published == boundaries:  # the tail after the last boundary
                    finished = True
                    break
                ctl.publish(epoch, ctl.last_published + 1)
                published.append(ctl.last_published)
        assert published == list(range(1, boundaries + 1))
        cumulative = [sum(spans[i % len(spans)] for i in range(r + 1)) for r in range(rounds)]
        assert cumulative[-1] >= boundaries + 1 and (rounds == 1 or cumulative[-2] < boundaries + 1)
        ctl.end_epoch()
        assert ctl.epoch is None


def test_rejections_name_epoch_id_and_reason():
    ctl = BoundaryController()
    ctl.begin_epoch(4)
    ctl.mark_post_d_complete()
    ctl.advance(2)
    ctl.publish(4, 1)
    cases = [((3, 2), "stale"), ((4, 1), "duplicate"), ((4, 0), "nonmonotone"), ((4, 3), "missing")]
    for (epoch, bid), reason in cases:
        with pytest.raises(BoundaryError) as info:
            ctl.publish(epoch, bid)
        assert info.value.reason == reason and isinstance(info.value, ValueError)
        assert f"boundary {bid} of epoch {epoch}" in str(info.value) and reason in str(info.value)
    ctl.publish(4, 2)
    with pytest.raises(BoundaryError, match=r"boundary 3 of epoch 4 rejected \(over-permitted\).*endpoint is 2"):
        ctl.publish(4, 3)
    assert {r for _, r in cases} | {"over-permitted"} == REASONS


def test_advance_needs_post_d_and_positive_int_span():
    ctl = BoundaryController()
    with pytest.raises(ProtocolError, match="no epoch is open"):
        ctl.advance(1)
    ctl.begin_epoch(0)
    with pytest.raises(ProtocolError, match="no completed post-D"):
        ctl.advance(1)
    ctl.mark_post_d_complete()
    with pytest.raises(ProtocolError, match="already has a completed post-D"):
        ctl.mark_post_d_complete()
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"span={bad}"):
            ctl.advance(bad)
    for bad in (True, 1.0, torch.tensor(1)):
        with pytest.raises(TypeError, match="Python int"):
            ctl.advance(bad)
    assert ctl.advance(3) == 3
    with pytest.raises(ProtocolError):  # the post-D was consumed
        ctl.advance(1)
    with pytest.raises(TypeError):
        ctl.publish(0, torch.tensor(1))


def test_cancel_leaves_controller_ready_for_next_epoch():
    ctl = BoundaryController()
    ctl.begin_epoch(1)
    ctl.mark_post_d_complete()
    ctl.advance(5)
    ctl.publish(1, 1)
    ctl.mark_post_d_complete()  # cancelled between post-D and advance
    ctl.cancel_epoch()
    assert ctl.state().epoch is None and ctl.permitted == 0 and ctl.last_published == 0
    with pytest.raises(BoundaryError) as info:
        ctl.publish(1, 2)
    assert info.value.reason == "stale"
    with pytest.raises(ProtocolError, match="strictly increase"):
        ctl.begin_epoch(1)
    ctl.begin_epoch(2)
    with pytest.raises(ProtocolError):  # the old epoch's post-D does not carry over
        ctl.advance(1)
    ctl.mark_post_d_complete()
    ctl.advance(1)
    ctl.publish(2, 1)
    ctl.cancel_epoch()
    ctl.cancel_epoch()  # idempotent
    with pytest.raises(ProtocolError, match="no epoch is open"):
        ctl.end_epoch()
