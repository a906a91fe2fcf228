"""Speculative verification keeps the target distribution exact (chi-square against the plain
sampler and against the exact law, on a Markov-chain target with a different drafter) and is plain
greedy decoding at temperature 0; `verify_lookup`, which decides many sampled rows with one-hot
drafts at once, keeps the same law, decides each row as it would alone, and draws a row without
drafts as the plain sampler does."""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.engine import speculative
from megatron_rollout.engine.api import SamplingParams
from megatron_rollout.engine.sampler import filtered_logprobs, sample_row
from megatron_rollout.engine.speculative import LookupRow, Verdict, verify, verify_lookup

scipy_stats = pytest.importorskip("scipy.stats")

V, LENGTH = 4, 3
_gen = torch.Generator().manual_seed(0)
TARGET = (torch.randn(V, V, generator=_gen) * 1.5)  # logits of the next token given the previous one
DRAFT = (torch.randn(V, V, generator=_gen) * 1.5).log_softmax(-1)  # a different drafter, log q


def plain_sequence(params: SamplingParams, gen: torch.Generator) -> tuple[int, ...]:
    seq = [0]
    while len(seq) <= LENGTH:
        seq.append(sample_row(TARGET[seq[-1]], params, gen).token)
    return tuple(seq[1:])


def speculative_sequence(params: SamplingParams, gen: torch.Generator, k: int = 2, greedy_drafts: bool = False,
                         verifier=verify) -> tuple[int, ...]:
    seq = [0]
    while len(seq) <= LENGTH:
        drafts, prev = [], seq[-1]
        for _ in range(k):
            prev = int(DRAFT[prev].argmax()) if greedy_drafts else int(torch.multinomial(DRAFT[prev].exp(), 1,
                                                                                          generator=gen))
            drafts.append(prev)
        context = [seq[-1]] + drafts
        q = None if greedy_drafts else DRAFT[context[:-1]]
        seq.extend(verifier(TARGET[context], drafts, q, params, gen).tokens)
    return tuple(seq[1:LENGTH + 1])


def lookup_verifier(target, drafts, q, params, gen) -> Verdict:
    """`verify_lookup` on one row (its drafts one-hot)."""
    assert q is None
    return verify_lookup(target, [LookupRow(0, tuple(drafts), params, gen)])[0]


def exact_law(params: SamplingParams) -> dict[tuple[int, ...], float]:
    logp = filtered_logprobs(TARGET, params).exp()
    law = {(): 1.0}
    for _ in range(LENGTH):
        law = {s + (t,): p * float(logp[s[-1] if s else 0, t]) for s, p in law.items() for t in range(V)}
    return {s: p for s, p in law.items() if p > 0}


def _counts(draw, n: int, seed: int) -> dict[tuple[int, ...], int]:
    gen, counts = torch.Generator().manual_seed(seed), {}
    for _ in range(n):
        s = draw(gen)
        counts[s] = counts.get(s, 0) + 1
    return counts


def _fit_p(counts: dict, law: dict) -> float:
    n = sum(counts.values())
    assert set(counts) <= set(law), "a sequence of probability 0 under the target was drawn"
    cells, total = sorted(law), sum(law.values())  # total: 1 up to fp32 rounding
    return scipy_stats.chisquare([counts.get(c, 0) for c in cells], [law[c] / total * n for c in cells]).pvalue


@pytest.mark.parametrize("params,greedy_drafts", [
    (SamplingParams(temperature=1.0), False),
    (SamplingParams(temperature=0.7, top_k=3), False),
    (SamplingParams(temperature=1.0), True),
])
def test_sampled_distribution_is_the_targets(params, greedy_drafts):
    n = 4000
    law = exact_law(params)
    spec = _counts(lambda g: speculative_sequence(params, g, greedy_drafts=greedy_drafts), n, seed=1)
    plain = _counts(lambda g: plain_sequence(params, g), n, seed=2)
    assert _fit_p(spec, law) > 1e-3 and _fit_p(plain, law) > 1e-3
    cells = sorted(set(spec) | set(plain))
    table = [[spec.get(c, 0) for c in cells], [plain.get(c, 0) for c in cells]]
    assert scipy_stats.chi2_contingency(table).pvalue > 1e-3


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
def test_lookup_verdicts_keep_the_targets_law(params):
    n = 4000
    law = exact_law(params)
    spec = _counts(lambda g: speculative_sequence(params, g, greedy_drafts=True, verifier=lookup_verifier), n, seed=5)
    assert _fit_p(spec, law) > 1e-3


def _alike(a: Verdict, b: Verdict) -> bool:
    """The same verdict: tokens and error exactly, logprobs to fp32 rounding."""
    return ((a.accepted, a.tokens, a.error) == (b.accepted, b.tokens, b.error)
            and a.logprobs == pytest.approx(b.logprobs, abs=1e-5))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_lookup_rows_are_decided_at_once_as_each_alone(monkeypatch, device):
    """Rows of several lengths and sampling params in one call: each verdict is the one its row gets
    alone from the same generator state (no row's draws or filtering leak into another's), its
    logprobs the target's under the row's params; a row without drafts draws as the plain sampler;
    the CPU's passes of a few rows each (`CPU_PASS_BYTES`) give the same verdicts as one pass; a
    non-finite logits row fails its own row only."""
    logits = (torch.randn(16, 50, generator=torch.Generator().manual_seed(7)) * 3).to(device)
    kinds = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.6, top_k=5),
             SamplingParams(temperature=1.0, top_p=0.7)]
    drafts = [(3, 4, 5), (), (int(logits[5].argmax()), 9), (1,), (), (2, 2, 2, 2)]
    rows, at = [], 0
    for i, d in enumerate(drafts):
        rows.append(LookupRow(at, d, kinds[i % 3], torch.Generator().manual_seed(100 + i)))
        at += len(d) + 1
    assert at == 16

    def reseeded(rs: list[LookupRow]) -> list[LookupRow]:
        return [LookupRow(r.start, r.drafts, r.params, torch.Generator().manual_seed(r.generator.initial_seed()))
                for r in rs]

    together = verify_lookup(logits, rows)
    for r, got in zip(rows, together):
        assert _alike(got, verify_lookup(logits, reseeded([r]))[0])
        assert got.tokens[:got.accepted] == r.drafts[:got.accepted] and len(got.tokens) == got.accepted + 1
        logp = filtered_logprobs(logits[r.start:r.start + got.accepted + 1], r.params)
        assert got.logprobs == pytest.approx([float(logp[j, t]) for j, t in enumerate(got.tokens)], abs=1e-5)
        if not r.drafts:
            plain = sample_row(logits[r.start], r.params, reseeded([r])[0].generator)
            assert (got.tokens, got.logprobs) == ((plain.token,), pytest.approx((plain.logprob,)))
    monkeypatch.setattr(speculative, "CPU_PASS_BYTES", 3 * 4 * 50)  # three positions a pass (on the CPU)
    assert all(_alike(a, b) for a, b in zip(verify_lookup(logits, reseeded(rows)), together, strict=True))
    poisoned = logits.clone()
    poisoned[rows[2].start + 1, 3] = float("nan")
    poisoned[rows[4].start, :] = float("-inf")
    poisoned[rows[5].start + 3, 7] = float("inf")
    got = verify_lookup(poisoned, reseeded(rows))
    assert got[2] == Verdict(0, (), (), "non-finite logits (nan)")
    assert got[4] == Verdict(0, (), (), "non-finite logits (-inf everywhere)")
    assert got[5] == Verdict(0, (), (), "non-finite logits (inf)")
    assert all(_alike(got[i], together[i]) for i in range(len(rows)) if i not in (2, 4, 5))
    with pytest.raises(ValueError, match="sampled rows"):
        verify_lookup(logits, [LookupRow(0, (), SamplingParams(temperature=0.0), None)])
    assert verify_lookup(logits, []) == []


def test_the_statistical_test_rejects_a_biased_verifier():
    """Accepting every draft samples the drafter's chain, not the target's: the test must see it."""
    def accept_all(target, drafts, q, params, gen):
        return Verdict(len(drafts), tuple(drafts) + (sample_row(target[-1], params, gen).token,), ())

    params = SamplingParams(temperature=1.0)
    biased = _counts(lambda g: speculative_sequence(params, g, verifier=accept_all), 4000, seed=3)
    assert _fit_p(biased, exact_law(params)) < 1e-6


def test_greedy_is_plain_greedy_whatever_the_drafts():
    params = SamplingParams(temperature=0.0)
    want = plain_sequence(params, torch.Generator())
    for greedy_drafts in (True, False):
        assert speculative_sequence(params, torch.Generator().manual_seed(4), k=3, greedy_drafts=greedy_drafts) == want
    # the target's own argmax chain as drafts: all accepted, then its next argmax as the bonus
    logp = TARGET.log_softmax(-1)
    chain = [0]
    for _ in range(4):
        chain.append(int(logp[chain[-1]].argmax()))
    v = verify(TARGET[chain[:4]], chain[1:4], None, params)
    assert (v.accepted, v.tokens) == (3, tuple(chain[1:]))
    assert v.logprobs == pytest.approx([float(logp[a, b]) for a, b in zip(chain, chain[1:])])
    # a wrong first draft: nothing accepted, the target's argmax instead
    wrong = (chain[1] + 1) % V
    v = verify(TARGET[[0, wrong]], [wrong], None, params)
    assert (v.accepted, v.tokens) == (0, (chain[1],))


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="3 rows for 1 drafts"):
        verify(TARGET[:3], [1], None, SamplingParams(temperature=0.0))
