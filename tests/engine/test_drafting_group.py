"""Group drafts (`SpeculativeConfig(group=True)`): a sample of an n > 1 request whose own context
proposes nothing copies what a sibling sample already wrote. Greedy tokens equal plain decoding's
and a lagging sibling is accepted in fewer iterations; the sampled law is the target's and a sample
stays independent of the sibling it copies (chi-square; accepting every draft fails both); a
family's text is kept while one of its sessions is open, and forgotten after."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from megatron_rollout.engine import RolloutEngine, SamplingParams, drafting
from megatron_rollout.engine.config import EngineConfig, KVConfig, RunnerConfig, SchedulerConfig, SpeculativeConfig

from .common import SCHEDULES, small
from .test_drafting import _accept_every_draft, _accept_every_lookup
from .test_drafting_ngram import model

PROMPT = [5, 9, 17, 2, 40, 33, 11]
REPLY = [60, 61, 62, 63, 60, 58]
"""The tool's reply both samples receive: its last 4-gram occurs nowhere before it."""


def group(schedule: str, on: bool = True, ahead: str = "auto") -> EngineConfig:
    return small(schedule, kv=KVConfig(num_blocks=128), runner=RunnerConfig(decode_ahead=ahead),
                 speculative=SpeculativeConfig("ngram", 3, ngram_min=2, ngram_max=4, group=on))


def two_turns(engine: RolloutEngine, turn1: SamplingParams, prompt: list[int] = PROMPT, reply: list[int] = REPLY,
              seeds: tuple[int | None, int | None] = (None, None)):
    """A group of two: turn 0 drawn once per sample (greedy: alike), sample 0 runs turn 1 in full after
    `reply`, then sample 1 does after the same reply. Each sample's turn-1 tokens and decode
    iterations, and the two sessions."""
    s0 = engine.open_session()
    s0.append(prompt)
    s0.generate(SamplingParams(temperature=0.0, max_new_tokens=2, n=2))
    (s1,) = s0.forks()
    outs = []
    for session, seed in zip((s0, s1), seeds):
        session.append(reply)
        before = engine.stats.decode_iterations
        outs.append((session.generate(dataclasses.replace(turn1, seed=seed)).token_ids,
                     engine.stats.decode_iterations - before))
    return outs, (s0, s1)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("ahead", ["auto", "on"])
def test_a_lagging_sample_copies_its_sibling_and_keeps_greedy_tokens(make_engine, schedule, ahead):
    """Also where undrafted steps are decoded ahead ("on"): the lookups made after a forward is issued
    ahead find the sibling's text too, a step later."""
    m = model(seed=2, vocab=64)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_stop=True)
    alone, _ = two_turns(make_engine(m, group(schedule, on=False, ahead=ahead)), greedy)
    engine = make_engine(m, group(schedule, ahead=ahead))
    ((first, _), (lagging, iterations)), (s0, _) = two_turns(engine, greedy)
    turn0 = s0.token_ids[len(PROMPT):len(PROMPT) + 2]
    want = RolloutEngine(m, small(schedule)).generate([PROMPT + turn0 + REPLY], greedy)[0].token_ids
    assert first == lagging == alone[0][0] == alone[1][0] == want  # greedy decoding's, every sample
    assert iterations < alone[1][1], (iterations, alone)  # copied from sample 0: fewer iterations
    assert engine.stats.copied_drafts > 0
    assert (engine.stats.ahead_issued > 0) == (ahead == "on"), engine.stats


@pytest.mark.timeout(300)
def test_copied_drafts_keep_the_sampled_law_and_the_samples_independent(monkeypatch):
    """Sample 1's first three tokens after the reply (27 cells) against their exact law, and how often
    they equal sample 0's (which it drafts from) against independent draws; accepting every draft
    makes them equal far too often."""
    stats = pytest.importorskip("scipy.stats")
    m = model(seed=2, vocab=3)
    config = EngineConfig(scheduler=SchedulerConfig(block_size=4, max_batch_tokens=512, max_decode_rows=512),
                          kv=KVConfig(num_blocks=4096), seed=5,
                          speculative=SpeculativeConfig("ngram", 2, ngram_min=4, ngram_max=4, group=True))
    prompt = [p % 3 for p in PROMPT]
    probe = RolloutEngine(m, config).open_session()
    probe.append(prompt)
    t0 = probe.generate(SamplingParams(temperature=0.0, max_new_tokens=2)).token_ids
    r = next(t for t in (0, 2, 1) if t not in t0)
    reply = [r] * 4  # its 4-gram occurs nowhere before: sample 1's own context proposes nothing there
    context = prompt + t0 + reply
    cells = list(itertools.product(range(3), repeat=3))
    with torch.no_grad():
        law = m.token_logprobs(torch.tensor([context + list(c) for c in cells]))[:, len(context) - 1:].sum(-1).exp()
    law = (law.double() / law.double().sum()).tolist()
    runs = 300
    sampled = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_stop=True)  # two drafts after the first

    def check(engine: RolloutEngine) -> tuple[float, float, float, int]:
        pairs = []
        for run in range(runs):
            outs, sessions = two_turns(engine, sampled, prompt, reply, seeds=(2 * run, 2 * run + 1))
            pairs.append((tuple(outs[0][0]), tuple(outs[1][0])))
            for s in sessions:
                s.close()
        counts = [sum(b[:3] == c for _, b in pairs) for c in cells]
        alike = sum(a[:3] == b[:3] for a, b in pairs)  # the first is drawn from the prompt, the next two may be copied
        return (stats.chisquare(counts, [p * runs for p in law]).pvalue,
                stats.binomtest(alike, runs, sum(p * p for p in law)).pvalue, engine.stats.acceptance_rate,
                engine.stats.copied_drafts)

    law_p, alike_p, acceptance, copied = check(RolloutEngine(m, config))
    assert 0.1 < acceptance < 0.95 and copied > 50, (acceptance, copied)  # copies accepted and rejected
    assert law_p > 1e-3 and alike_p > 1e-3, (law_p, alike_p)
    monkeypatch.setattr(drafting, "verify", _accept_every_draft)
    monkeypatch.setattr(drafting, "verify_lookup", _accept_every_lookup)
    _, alike_p, acceptance, _ = check(RolloutEngine(m, config))
    assert acceptance == 1.0 and alike_p < 1e-6, alike_p


@pytest.mark.timeout(120)
def test_a_familys_text_is_kept_while_one_of_its_sessions_is_open(make_engine):
    m = model(seed=2, vocab=64)
    engine = make_engine(m, group("chunked"))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_stop=True)
    _, (s0, s1) = two_turns(engine, greedy)
    executor = engine.executor
    (family,) = executor.families.values()
    assert set(family.members) == {s0.sid, s1.sid}
    s0.close()
    s1.append([1, 2])
    s1.generate(greedy)  # a step runs: the closed sample's index is dropped from `contexts`, not its family
    assert s0.sid not in executor.contexts and set(executor.families[s0.sid].members) == {s0.sid, s1.sid}
    s1.close()
    engine.generate([[3, 4, 5]], greedy)
    assert executor.families == {} and executor.contexts == {}


def test_the_config_and_command_line_name_what_group_drafts_need():
    import argparse

    from megatron_rollout.options import add_engine_args, engine_config

    with pytest.raises(ValueError, match="needs method 'ngram'"):
        SpeculativeConfig("mtp", 1, group=True)
    with pytest.raises(ValueError, match="is True or False"):
        SpeculativeConfig("ngram", 2, group=1)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(["--ngram", "3", "--draft-group"])).speculative == \
        SpeculativeConfig("ngram", 3, group=True)
    with pytest.raises(ValueError, match="--draft-group needs --ngram"):
        engine_config(parser.parse_args(["--draft-group"]))
    with pytest.raises(ValueError, match="--draft-group needs --ngram"):
        engine_config(parser.parse_args(["--mtp", "1", "--draft-group"]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_session_that_drafted_alone_joins_the_family_its_next_turn_forks(make_engine, schedule):
    """Turn 1 alone (its lookups made its index), turn 2 with n = 2: it is sample 0 of a family now,
    and both samples are greedy decoding's."""
    m = model(seed=2, vocab=64)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_stop=True)
    engine = make_engine(m, group(schedule))
    s0 = engine.open_session()
    s0.append(PROMPT)
    first = s0.generate(greedy).token_ids
    s0.append(REPLY)
    assert len(s0.generate(dataclasses.replace(greedy, n=2)).token_ids) == 8
    (s1,) = s0.forks()
    want = RolloutEngine(m, small(schedule)).generate([PROMPT + first + REPLY], greedy)[0].token_ids
    assert s0.token_ids[-8:] == s1.token_ids[-8:] == want
    assert set(engine.executor.families[s0.sid].members) == {s0.sid, s1.sid}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [1, 2])
def test_a_stop_inside_a_drafted_run_ends_every_sample_there(make_engine, monkeypatch, n):
    """A stop token among a row's kept drafts ends the sample at it, while its sibling still runs too
    (an n = 2 sample once went on landing the run's later tokens after its end: IndexError). Greedy
    tokens equal plain decoding's cut at the stop; every case whose run held tokens past the stop
    counts, and there must be some."""
    from megatron_rollout.engine.bookkeeping import RequestTable

    m = model(seed=0, vocab=12)  # a small vocabulary: greedy text loops, drafts hold
    said = [3, 5, 7, 3, 5, 7, 1]
    said += RolloutEngine(m, small("chunked")).generate([said], SamplingParams(temperature=0.0,
                                                                               max_new_tokens=16))[0].token_ids
    prompt, plain = said[:-10], said[-10:]  # the stops come again: drafts can hold tokens past them
    accept_run, cut_short = RequestTable.accept_run, []

    def spy(self, owner, drawn, version, now):
        before = len(owner.request.output)
        outs = accept_run(self, owner, drawn, version, now)
        cut_short.append(len(owner.request.output) - before < len(drawn))
        return outs

    monkeypatch.setattr(RequestTable, "accept_run", spy)
    for stop in sorted(set(plain)):
        want = plain[:plain.index(stop) + 1]
        engine = make_engine(m, small("chunked", speculative=SpeculativeConfig("ngram", 4, ngram_min=1)))
        rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=10, n=n,
                                                        stop_token_ids=[stop]))
        out = engine.run_until([rid])[rid]
        assert [r.token_ids for r in out.results] == [want] * n, stop
        assert all(r.finish_reason.value == "stop" for r in out.results)
    assert any(cut_short)
