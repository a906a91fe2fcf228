"""Prompt-lookup drafts: what followed the latest earlier occurrence of a context's last n tokens.

Speculative decoding (`engine.drafting`) needs a guess of a row's next k tokens that costs far
less than the forward that checks it. Where a context repeats itself (code edited in place, a
tool's reply quoted back, a template filled in again) the tokens after an earlier occurrence of
the context's last few tokens are such a guess, and finding them is host work over token ids: no
model, no device, the same answer on every rank that holds the same tokens.

`NgramIndex` keeps one sequence's tokens in a growing array (synchronised from the engine's
token list by appending what is new, so a step costs the new tokens, not the context) and
`propose` matches the suffix: the longest n in [n_min, n_max] whose last n tokens occurred
before, its latest such occurrence, and the k tokens after it. Where those run into the suffix
itself (a period shorter than k) the copy goes on periodically, as the text would if it kept
repeating. A suffix that never occurred before proposes nothing.

A context that repeats itself recently (the case where drafts are accepted most) is answered from
a byte copy of the tokens, 4 bytes each (7 bits a byte, the first byte's high bit set, so a match
can only start where a token does): one C search (`bytearray.rfind`) for the longest suffix over
the last `RECENT` tokens. A match there is the latest occurrence of the longest suffix, so it is
the answer. Otherwise the whole context is searched in array operations, a dozen calls of fixed
overhead each. On a looping context of 1,000 to 60,000 tokens a lookup and a one-token sync took
16-56 us that way and 3.4-3.7 us with the byte search first; on text-like ids the byte search
adds 2-3 us (`python -m benchmarks.host --lookup`, docs/benchmarks.md). Token ids must be below
2**28.

The whole-context search is skipped where it cannot succeed: every match ends with the context's
last `n_min` tokens, so a bitmap of the hashed `n_min`-grams seen so far (`GramFilter`, 32 bits a
token, a false positive rate near 3%) answers "never occurred" for most contexts that do not repeat,
such as a turn's fresh input or a row whose output has not started looping. There a lookup
searched all of a rollout's 17,000 to 60,000 tokens on every decode step, and that search ran
between the GPU's verify forwards. A row whose last lookup proposed nothing asks the bitmap first
(one new gram hashed, one bit read), before the byte search: at temperature 1 on text that does
not repeat that is every row of every step, and the answer is the same (the bitmap holds every
earlier end the byte search could find).

A turn's input reaches the index whole when its first decode step looks it up (thousands of tokens
copied, encoded and hashed: milliseconds, after a prefill, while the GPU waits for the next plan);
`prepare` does that work earlier, where the caller has the GPU busy (`engine.drafting` calls it
while a prefill forward runs). Lookups give the same drafts either way.

Another sequence's text can guess too: the samples of one RL group answer the same prompt, and
where they agree, a sample that lags can copy what a sibling already wrote (Seer's grouped drafts).
`NgramIndex.follow` finds the longest match of a suffix given by the caller (the lagging sample's)
anywhere in its own context with a token after it, in a few byte searches of the whole context once
the n-gram filter has said the shortest suffix may occur at all. `Family` decides between a
sample's own drafts and a sibling's, and keeps a cursor into the sibling it copies, so that a sample
that goes on agreeing pays a list compare a step, not a search.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TOKEN_LIMIT = 1 << 28
"""Token ids the byte copy holds (4 bytes of 7 bits)."""
RECENT = 1024
"""Tokens the byte search covers (module docstring): 4 KB, about a microsecond."""
_MUL = 0x9E3779B97F4A7C15
"""The n-gram hash's multiplier (odd; 2**64 over the golden ratio): h <- (h ^ token) * _MUL mod 2**64."""
_MASK = (1 << 64) - 1


class GramFilter:
    """Which n-grams a context holds, as a bitmap of their hashes: no false negatives, few false
    positives. Holds the n-grams that end at positions n..`covered` - 1 (an end is exclusive, and
    `covered` is the context's length): every one but the suffix itself, which ends at the length.
    `bits_per_gram` bits for each (the map doubles as the context grows): with one hash, a
    false positive rate of about 1 - exp(-1 / bits_per_gram)."""

    def __init__(self, n: int, bits_per_gram: int = 32) -> None:
        self.n, self.bits_per_gram = n, bits_per_gram
        self.log2 = 12
        self.bitmap = np.zeros(1 << (self.log2 - 3), dtype=np.uint8)
        self.covered = 0
        """Ends below this (and at least n) are in the map."""

    def _slots(self, ctx: np.ndarray, ends: np.ndarray) -> np.ndarray:
        h = np.zeros(len(ends), dtype=np.uint64)
        for j in range(self.n, 0, -1):
            h = (h ^ ctx[ends - j].astype(np.uint64)) * np.uint64(_MUL)
        return h >> np.uint64(64 - self.log2)

    def _slot(self, grams: Sequence[int]) -> int:
        h = 0
        for t in grams:
            h = ((h ^ t) * _MUL) & _MASK
        return h >> (64 - self.log2)

    def extend(self, ctx: np.ndarray, length: int) -> None:
        """Cover every end up to `length` - 1 of the context `ctx[:length]`."""
        need = max(12, (self.bits_per_gram * length - 1).bit_length())
        start = max(self.n, self.covered)
        if need > self.log2:  # grown: rehash every end at the new width
            self.log2, self.bitmap, start = need, np.zeros(1 << (need - 3), dtype=np.uint8), self.n
        if length - start > 16:
            slots = self._slots(ctx, np.arange(start, length))
            bits = np.left_shift(np.uint8(1), (slots & np.uint64(7)).astype(np.uint8))
            np.bitwise_or.at(self.bitmap, slots >> np.uint64(3), bits)
        else:  # a step's few new ends: array calls would cost more than they save
            for end in range(start, length):
                slot = self._slot(ctx[end - self.n:end].tolist())
                self.bitmap[slot >> 3] |= 1 << (slot & 7)
        self.covered = max(self.covered, length)

    def may_hold(self, grams: Sequence[int]) -> bool:
        """False only if no covered end holds `grams` (n tokens)."""
        slot = self._slot(grams)
        return bool(self.bitmap[slot >> 3] >> (slot & 7) & 1)


def encode(tokens: Sequence[int]) -> bytes:
    """4 bytes a token, 7 bits each, least significant first (the bytes that vary most lead, so a
    search skips more), the first byte marked (high bit set)."""
    if len(tokens) == 1:  # a plain decode step's one new token
        t = tokens[0]
        return bytes((0x80 | t & 0x7F, t >> 7 & 0x7F, t >> 14 & 0x7F, t >> 21))
    if len(tokens) <= 16:  # a step's few new tokens: array calls would cost more than they save
        return bytes([b for t in tokens for b in (0x80 | t & 0x7F, t >> 7 & 0x7F, t >> 14 & 0x7F, t >> 21)])
    t = np.asarray(tokens, dtype=np.uint32)
    out = np.empty((len(t), 4), dtype=np.uint8)
    out[:, 0] = 0x80 | (t & 0x7F)
    out[:, 1] = (t >> 7) & 0x7F
    out[:, 2] = (t >> 14) & 0x7F
    out[:, 3] = t >> 21
    return out.tobytes()


def _check_ids(lo: int, hi: int) -> None:
    if not 0 <= lo <= hi < TOKEN_LIMIT:
        raise ValueError(f"token ids must lie in [0, {TOKEN_LIMIT}), got {lo}..{hi}")


class NgramIndex:
    """The tokens of one sequence, appended as it grows, and the drafts its own history proposes."""

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram lengths must satisfy 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens = np.zeros(64, dtype=np.int64)
        self.length = 0
        self.encoded = bytearray()
        """`encode(tokens[:length])`: what `propose` searches."""
        self.grams = GramFilter(n_min)
        """The `n_min`-grams ending before the last token (a match's last `n_min` tokens must be one),
        brought up to date by `prepare`, by a `cold` lookup, or when the byte search finds nothing: a
        looping context that was never prepared never pays for it."""
        self.cold = False
        """The last lookup proposed nothing: the next asks `grams` before the byte search (not the
        first lookup: where the bitmap is not built yet, a context that repeats should not pay for it)."""

    def sync(self, tokens: Sequence[int]) -> None:
        """Take `tokens`, the sequence's whole context: only the tokens past those held are copied.
        Contexts only grow in the engine (and an index goes with its sequence); as a cheap guard, one
        shorter than held, or whose token at the held end differs, is taken whole. A stale copy
        would lower the acceptance rate only: drafts are verified."""
        held = self.length
        if len(tokens) == held and (not held or tokens[held - 1] == self.tokens[held - 1]):
            return  # nothing new: a finished sibling's context, synced again at every lookup of its family
        if len(tokens) < held or (held and tokens[held - 1] != self.tokens[held - 1]):
            held = 0
            self.grams = GramFilter(self.n_min)
        new = tokens[held:]
        if len(new) > 16:  # a turn's input: one conversion to an array serves the checks, the copy and the bytes
            new = np.asarray(new, dtype=np.int64)
            _check_ids(int(new.min()), int(new.max()))
        elif new:  # a step's few tokens
            _check_ids(min(new), max(new))
        if len(tokens) > len(self.tokens):
            grown = np.zeros(max(len(tokens), 2 * len(self.tokens)), dtype=np.int64)
            grown[:held] = self.tokens[:held]
            self.tokens = grown
        self.tokens[held:len(tokens)] = new
        del self.encoded[4 * held:]
        self.encoded += encode(new)
        self.length = len(tokens)

    def prepare(self, tokens: Sequence[int]) -> None:
        """`sync`, and the n-gram bitmap brought up to the context: the work of a lookup that does not
        depend on the next token, done ahead of it (module docstring)."""
        self.sync(tokens)
        self.grams.extend(self.tokens, self.length)

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to k tokens after the latest earlier occurrence of the longest matching suffix (n
        from n_max down to n_min); () where no suffix of n_min tokens occurred before. Sets `cold`."""
        ctx, size, asked = self.tokens, self.length, self.cold
        if k <= 0 or size <= self.n_min or asked and not self._may_match(size):  # not repeating: the bit first
            self.cold = True
            return ()
        longest, stop = min(self.n_max, size - 1), 4 * (size - 1)  # an occurrence ends before the suffix does
        at = self.encoded.rfind(self.encoded[4 * (size - longest):], max(0, stop - 4 * RECENT), stop)
        if at >= 0:
            best = at // 4 + longest
        else:
            best = self._search(size) if asked or self._may_match(size) else None
            if best is None:
                self.cold = True
                return ()
        self.cold = False
        period = size - best  # the draft copies ctx[best:], then itself, `period` back
        draft: list[int] = []
        for j in range(k):
            draft.append(int(ctx[best + j]) if best + j < size else draft[j - period])
        return tuple(draft)

    def _may_match(self, size: int) -> bool:
        """Whether the context's last `n_min` tokens may have occurred before (False: they did not)."""
        self.grams.extend(self.tokens, size)
        return self.grams.may_hold(self.tokens[size - self.n_min:size].tolist())

    def _search(self, size: int) -> int | None:
        """Where the latest earlier occurrence of the longest matching suffix ends, over the whole
        context: the ends of the last token's occurrences, narrowed one token back at a time."""
        ctx = self.tokens[:size]
        ends = np.flatnonzero(ctx[:size - 1] == ctx[size - 1]) + 1
        best = None
        for n in range(1, min(self.n_max, size - 1) + 1):
            if n > 1:
                ends = ends[ends >= n]
                ends = ends[ctx[ends - n] == ctx[size - n]]
            if not len(ends):
                break
            if n >= self.n_min:
                best = int(ends[-1])
        return best

    def follow(self, suffix: Sequence[int], shortest: int, longest: int) -> tuple[int, int]:
        """(n, end): the longest n in [shortest, longest] whose last n tokens of `suffix` (another
        sequence's) occur in this context with a token after them, and where their latest such
        occurrence ends; (0, -1) where none does. Matches are nested (a suffix that occurs has every
        shorter one occur): the shortest is searched first (most lookups end there), then n is
        bisected above it, a few byte searches of the whole context each."""
        size, longest = self.length, min(longest, len(suffix), self.length - 1)
        shortest = max(shortest, self.n_min)
        if size <= shortest or longest < shortest:
            return 0, -1
        self.grams.extend(self.tokens, size)  # covers every end up to size - 1: the ends a draft may follow
        if not self.grams.may_hold(list(suffix[len(suffix) - self.n_min:])):
            return 0, -1
        found, stop = (0, -1), 4 * (size - 1)
        top, pattern = longest, encode(suffix[len(suffix) - longest:])  # the last n tokens' bytes: its last 4n
        at = self.encoded.rfind(pattern[4 * (top - shortest):], 0, stop)
        if at < 0:
            return found
        found, shortest = (shortest, at // 4 + shortest), shortest + 1
        while shortest <= longest:
            n = (shortest + longest) // 2
            at = self.encoded.rfind(pattern[4 * (top - n):], 0, stop)
            if at >= 0:
                found, shortest = (n, at // 4 + n), n + 1
            else:
                longest = n - 1
        return found


SIBLING_MAX = 16
"""The longest suffix sought in a sibling's context (`Family`)."""


class Family:
    """The samples of one RL group, each with its tokens and index, and which sibling each sample is
    copying from (a cursor: the sibling, where in its text the copy stands, and the sample's length
    then). A sample drafts, in this order:
    1. on from its cursor, while the tokens it emitted since equal the sibling's text there (a few
       list compares, however long the texts);
    2. from its own context (`NgramIndex.propose`);
    3. from the sibling whose context holds the longest match of its suffix, where that match is
       longer than any own match can be (more than n_max tokens, up to `SIBLING_MAX`), or where the
       own context proposed nothing; this sets its cursor.
    A sibling closed or finished stays a source as long as the family is kept."""

    def __init__(self) -> None:
        self.members: dict[int, tuple[Sequence[int], NgramIndex]] = {}
        self.cursors: dict[int, tuple[int, int, int]] = {}
        self.longer: dict[int, GramFilter] = {}
        """Each member's (n_max + 1)-grams: where a sibling must match longer than a row's own
        lookup can, most siblings are ruled out by one bit, not searched."""

    def join(self, key: int, tokens: Sequence[int], index: NgramIndex) -> None:
        """`tokens` is the member's live token list: a sibling's index is brought up to it on use."""
        self.members[key] = (tokens, index)

    def _longer(self, key: int, index: NgramIndex) -> GramFilter:
        """Member `key`'s (n_max + 1)-grams, brought up to its index."""
        grams = self.longer.get(key)
        if grams is None:
            grams = self.longer[key] = GramFilter(index.n_max + 1)
        grams.extend(index.tokens, index.length)
        return grams

    def propose(self, key: int, k: int) -> tuple[tuple[int, ...], bool]:
        """Up to k drafts for member `key` (its index synced by the caller), and whether a sibling's
        text gave them."""
        tokens, own = self.members[key]
        if k <= 0:
            return (), False
        cursor = self.cursors.pop(key, None)
        if cursor is not None:
            sibling, end, held = cursor
            text, new = self.members[sibling][0], tokens[held:]
            if text[end:end + len(new)] == new and end + len(new) < len(text):
                end += len(new)
                self.cursors[key] = (sibling, end, len(tokens))
                return tuple(text[end:end + k]), True
        drafted = own.propose(k)
        shortest = own.n_max + 1 if drafted else own.n_min
        suffix = list(tokens[len(tokens) - shortest:]) if drafted and len(tokens) >= shortest else None
        best = (0, -1, -1)
        for sibling, (text, index) in self.members.items():
            if sibling != key:
                index.sync(text)
                if suffix is not None and not self._longer(sibling, index).may_hold(suffix):
                    continue
                n, end = index.follow(tokens, shortest, SIBLING_MAX)
                best = max(best, (n, end, sibling))
        n, end, sibling = best
        if not n:
            return drafted, False
        self.cursors[key] = (sibling, end, len(tokens))
        return tuple(self.members[sibling][0][end:end + k]), True
