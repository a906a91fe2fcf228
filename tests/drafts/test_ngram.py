"""Prompt lookup (`drafts.ngram`): the longest suffix match wins, its latest occurrence, a periodic
copy past the context's end, nothing where no suffix occurred; the array kept in sync by appends
proposes what a brute-force search over the whole list proposes."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rollout.drafts import Family, NgramIndex


def brute(tokens: list[int], k: int, n_min: int, n_max: int) -> tuple[int, ...]:
    """The definition, searched naively: longest n first, latest earlier end first."""
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        for end in range(size - 1, n - 1, -1):
            if tokens[end - n:end] == tokens[size - n:]:
                ext = list(tokens)
                for j in range(k):
                    ext.append(ext[end + j])
                return tuple(ext[size:])
    return ()


def proposed(tokens: list[int], k: int, n_min: int = 1, n_max: int = 4) -> tuple[int, ...]:
    index = NgramIndex(n_min, n_max)
    index.sync(tokens)
    return index.propose(k)


def test_the_longest_match_and_its_latest_occurrence_win():
    # suffix (1, 2): after "1 2" came 3 (early) and 4 (late): the latest wins
    assert proposed([1, 2, 3, 1, 2, 4, 1, 2], 2) == (4, 1)
    # suffix (0, 1, 2) matches longer at the early occurrence: the longest wins
    assert proposed([0, 1, 2, 3, 9, 1, 2, 4, 0, 1, 2], 2) == (3, 9)
    assert proposed([0, 1, 2, 3, 9, 1, 2, 4, 0, 1, 2], 2, n_max=2) == (4, 0)


def test_a_short_period_repeats_and_nothing_matches_nothing():
    assert proposed([7, 5, 5, 5], 4) == (5, 5, 5, 5)
    assert proposed([1, 2, 1, 2, 1], 5) == (2, 1, 2, 1, 2)
    assert proposed([1, 2, 3, 4], 3) == ()
    assert proposed([3, 1, 2, 9, 2], 3, n_min=2) == ()  # only a 1-token match
    assert proposed([3, 1, 2, 9, 2], 3, n_min=1) == (9, 2, 9)
    assert proposed([5], 3) == () and proposed([], 3) == () and proposed([1, 1], 0) == ()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 3), st.integers(0, 3), st.integers(0, 5),
       st.lists(st.integers(1, 5), max_size=6))
def test_appends_propose_what_a_search_of_the_whole_list_proposes(tokens, n_min, extra, k, cuts):
    n_max = n_min + extra
    index = NgramIndex(n_min, n_max)
    for cut in sorted(set(cuts)):  # the engine's contexts grow between steps
        index.sync(tokens[:cut * len(tokens) // 5])
        assert index.propose(k) == brute(tokens[:cut * len(tokens) // 5], k, n_min, n_max)
    index.sync(tokens)
    assert index.propose(k) == brute(tokens, k, n_min, n_max)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 3), st.integers(0, 2), st.integers(1, 4),
       st.integers(0, 30))
def test_token_by_token_lookups_cold_and_warm_propose_what_the_search_proposes(tokens, n_min, extra, k, prepared):
    """A decode step's lookups, one token at a time, from a prompt synced by `prepare` or by the first
    lookup: a row that proposed nothing asks the gram bitmap first (`NgramIndex.cold`), one that did
    the byte search; both answer as the definition does."""
    n_max, start = n_min + extra, min(prepared, len(tokens))
    index = NgramIndex(n_min, n_max)
    index.prepare(tokens[:start])
    for size in range(start, len(tokens) + 1):
        index.sync(tokens[:size])
        want = brute(tokens[:size], k, n_min, n_max)
        assert index.propose(k) == want
        assert index.cold is not bool(want)


def test_a_context_that_is_no_continuation_is_taken_whole():
    index = NgramIndex(2, 3)
    index.sync([7, 1, 2, 9, 3, 2])
    index.sync([1, 2, 9, 9, 1, 7, 1, 2])  # its token where the held context ended differs: not a continuation
    assert index.propose(3) == (9, 9, 1)
    index.sync([4, 4])
    assert index.propose(2) == ()


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="n_min=3, n_max=2"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="n_min=0"):
        NgramIndex(0, 2)


EDGES = [0, 1, 127, 128, 255, 16383, 16384, (1 << 21) - 1, 1 << 21, 151_935, (1 << 28) - 1]
"""Token ids at the byte copy's 7-bit boundaries: their bytes overlap in every way a search could confuse."""


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(EDGES), max_size=60), st.integers(1, 3), st.integers(0, 2), st.integers(1, 6))
def test_ids_across_every_byte_boundary_propose_what_the_search_proposes(tokens, n_min, extra, k):
    index = NgramIndex(n_min, n_min + extra)
    index.sync(tokens[:len(tokens) // 2])  # a step's few new tokens, then a long run: both encodings
    index.sync(tokens)
    assert index.propose(k) == brute(tokens, k, n_min, n_min + extra)


def test_the_few_and_the_many_new_tokens_are_encoded_alike():
    from megatron_rollout.drafts.ngram import encode

    ids = EDGES * 3  # more than a step's few: the array path
    assert encode(ids) == b"".join(encode([t]) for t in ids) and len(encode(ids)) == 4 * len(ids)


def test_ids_the_byte_copy_cannot_hold_are_refused():
    index = NgramIndex(1, 2)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 268435456\)"):
        index.sync([3, 1 << 28])
    with pytest.raises(ValueError, match="-1"):
        index.sync([-1, 2])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 1 << 20), min_size=1, max_size=300), st.integers(1, 4),
       st.lists(st.integers(1, 40), max_size=8))
def test_the_gram_filter_holds_every_gram_before_the_suffix_however_the_context_grew(tokens, n, steps):
    from megatron_rollout.drafts.ngram import GramFilter

    grown, at = GramFilter(n), 0
    for step in steps + [len(tokens)]:  # a few tokens a step (one at a time) or many (array operations)
        at = min(len(tokens), at + step)
        grown.extend(np.asarray(tokens, dtype=np.int64), at)
    whole = GramFilter(n)
    whole.extend(np.asarray(tokens, dtype=np.int64), len(tokens))
    assert np.array_equal(grown.bitmap, whole.bitmap)  # the same map, bit for bit
    assert all(grown.may_hold(tokens[end - n:end]) for end in range(n, len(tokens)))  # no false negatives


def test_a_context_that_never_repeats_is_not_searched_and_one_that_does_far_back_is():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 151_936, 5_000).tolist()  # a turn's fresh input: no 2-gram recurs
    index, searched = NgramIndex(2, 4), []
    search = index._search
    index._search = lambda size: searched.append(size) or search(size)
    for t in rng.integers(0, 151_936, 200).tolist():
        tokens.append(t)
        index.sync(tokens)
        assert index.propose(4) == ()
    assert len(searched) <= 20  # the filter's false positives only (about 3% of lookups)
    tokens += tokens[100:103]  # a 3-gram of 5,000 tokens back: past the recent bytes, found by the search
    index.sync(tokens)
    assert index.propose(4) == brute(tokens, 4, 2, 4) == tuple(tokens[103:107])


def brute_follow(tokens: list[int], suffix: list[int], shortest: int, longest: int) -> tuple[int, int]:
    """`follow`'s definition, searched naively: longest n first, the latest end with a token after it."""
    for n in range(min(longest, len(suffix)), shortest - 1, -1):
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n:end] == suffix[len(suffix) - n:]:
                return n, end
    return 0, -1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(EDGES[:4]), max_size=50), st.lists(st.sampled_from(EDGES[:4]), max_size=12),
       st.integers(1, 3), st.integers(0, 2), st.integers(0, 8), st.integers(0, 50))
def test_a_suffix_from_elsewhere_follows_what_a_search_of_the_whole_list_finds(tokens, suffix, n_min, extra, more, cut):
    """Another sequence's suffix (an RL group's sibling drafting from this one): matched anywhere with
    a token after it, the longest in the range asked (bisected); the filter never hides a match."""
    index = NgramIndex(n_min, n_min + extra)
    index.sync(tokens[:cut])  # grown in two steps: the filter is brought up to date by `follow` itself
    index.sync(tokens)
    shortest = n_min + extra // 2
    assert index.follow(suffix, shortest, shortest + more) == brute_follow(tokens, suffix, shortest, shortest + more)


def family(*texts: list[int]) -> Family:
    group = Family()
    for key, text in enumerate(texts):
        index = NgramIndex(2, 4)
        index.sync(text)
        group.join(key, text, index)
    return group


def test_a_sibling_is_copied_where_it_matches_longer_and_followed_while_the_sample_agrees():
    answer = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    ahead, behind = [1, 2, 3] + answer, [1, 2, 3] + answer[:2]
    group = family(ahead, behind)
    assert group.propose(1, 3) == ((22, 23, 24), True)  # nothing of its own: the sibling's text
    behind += [22, 23, 24, 25]  # the drafts and one more accepted: the cursor moves on, no search
    group.members[0][1].follow = None  # a search would fail here
    assert group.propose(1, 3) == ((26, 27, 28), True)
    behind += [99]  # it no longer agrees: its own context, then a search (none matches)
    del group.members[0][1].follow
    group.members[1][1].sync(behind)
    assert group.propose(1, 3) == ((), False)
    assert group.propose(1, 0) == ((), False)


def test_a_sample_keeps_its_own_drafts_unless_a_sibling_matches_longer_than_they_can():
    own = [5, 6, 7, 8, 1, 5, 6, 7, 8]  # its own context proposes (1, 5, 6) from a 4-token match
    short = [9, 7, 8, 2, 2, 2]          # a sibling matching 2 tokens: not longer
    long_ = [4, 1, 5, 6, 7, 8, 3, 3, 3]  # a sibling matching 5 tokens (1 5 6 7 8): longer than 4
    assert family(short, own).propose(1, 3) == ((1, 5, 6), False)
    assert family(short, own, long_).propose(1, 3) == ((3, 3, 3), True)
