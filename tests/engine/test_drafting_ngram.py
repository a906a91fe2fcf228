"""n-gram (prompt-lookup) speculative decoding (`SpeculativeConfig("ngram")`, `drafts.ngram`) on a
tiny DeepSeek-V3 without an MTP layer: greedy tokens and logprobs equal plain decoding under off,
chunked and mux; a repeating context is drafted and accepted (fewer decode iterations); `tail_rows`
drafts only while few rows decode, `tail_k` longer while very few do, `streak_k` longer for a row
whose last draft was kept whole; every request finishes, or
fails with its reason, under KV pressure; the sampled law is the plain sampler's with one-hot
drafts (chi-square), and the same test rejects a broken acceptance rule; undrafted steps decode ahead,
rows arriving after the tail began included."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rollout.engine import (
    EngineConfig,
    FinishReason,
    KVConfig,
    RolloutEngine,
    RunnerConfig,
    SamplingParams,
    SpeculativeConfig,
)
from megatron_rollout.engine.api import sample_seed
from megatron_rollout.model.transformer import MoETransformer
from tests.model.test_mtp import CFG

from .common import SCHEDULES, small
from .test_drafting import check_the_sampled_law

PROMPTS = [[1, 2, 3, 4, 1, 2, 3], [7], [3, 3, 9, 0, 11, 2, 6, 3, 3, 9], [5, 6, 5, 6, 5]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_stop=True)


def model(seed: int = 0, vocab: int = 12) -> MoETransformer:
    return MoETransformer(CFG.replace(vocab_size=vocab, mtp_num_layers=0)).init_weights(seed=seed, std=0.3)


def ngram(schedule: str, k: int = 3, **fields) -> EngineConfig:
    return small(schedule, speculative=SpeculativeConfig("ngram", k, ngram_min=1, **fields))


@pytest.fixture(scope="module")
def tiny():
    m = model()
    plain = RolloutEngine(m, small("chunked"))
    return m, plain.generate(PROMPTS, GREEDY), plain.stats


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_greedy_tokens_and_logprobs_equal_plain_decoding(tiny, make_engine, schedule):
    m, plain, _ = tiny
    engine = make_engine(m, ngram(schedule))
    got = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    for r, ref in zip(got, plain):
        assert r.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert r.finish_reason is FinishReason.LENGTH
    assert engine.stats.drafted_tokens > 0


def bigram(m: MoETransformer) -> MoETransformer:
    """`m` with no attention output: each position's logits depend on its own token alone, so greedy
    decoding walks a fixed map of tokens into a cycle, and the context repeats from there."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("self_attention.linear_proj.weight"):
                p.zero_()
    return m


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_repeating_context_is_accepted_in_fewer_iterations(make_engine, schedule):
    m = bigram(model())
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_stop=True)
    plain = make_engine(m, small(schedule))
    want = plain.generate(PROMPTS, params)
    engine = make_engine(m, ngram(schedule, k=4))
    got = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    s = engine.stats
    assert s.acceptance_rate > 0.8 and s.decode_tokens == plain.stats.decode_tokens, s
    assert s.decode_iterations <= plain.stats.decode_iterations // 2, (s, plain.stats)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tail_rows_drafts_only_while_few_rows_decode(tiny, make_engine, schedule, monkeypatch):
    m, plain, _ = tiny
    engine = make_engine(m, ngram(schedule, tail_rows=2))
    seen: list[tuple[int, int]] = []  # (decode rows, drafted positions) of every forward
    inputs = engine.executor.inputs

    def spy(decode, prefill, lookahead=()):
        decode = tuple(decode)
        seen.append((len(decode), sum(lookahead)))
        return inputs(decode, prefill, lookahead)

    monkeypatch.setattr(engine.executor, "inputs", spy)
    params = [SamplingParams(temperature=0.0, max_new_tokens=6 + 4 * i, ignore_stop=True) for i in range(4)]
    got = engine.generate(PROMPTS, params)
    want = RolloutEngine(m, small(schedule)).generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert any(rows > 2 for rows, _ in seen)  # the batch was wider than the tail
    assert all(rows <= 2 for rows, drafted in seen if drafted), seen
    assert engine.stats.drafted_tokens > 0 and any(drafted for _, drafted in seen)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tail_k_drafts_longer_only_while_very_few_rows_decode(make_engine, schedule, monkeypatch):
    """`tail_k`: up to 6 drafts a row while at most one row decodes, k = 2 otherwise; on a repeating
    context the last row, alone, takes the longer drafts and fewer iterations; tokens unchanged."""
    m = bigram(model())
    params = [SamplingParams(temperature=0.0, max_new_tokens=8 + 12 * i, ignore_stop=True) for i in range(4)]
    want = make_engine(m, small(schedule)).generate(PROMPTS, params)
    runs = {}
    for name, fields in (("k", {}), ("tail", {"tail_k": 6, "tail_k_rows": 1})):
        engine = make_engine(m, ngram(schedule, k=2, **fields))
        seen: list[tuple[int, int]] = []  # (decode rows, most drafts of a row) of every forward
        inputs = engine.executor.inputs

        def spy(decode, prefill, lookahead=(), inputs=inputs, seen=seen):
            decode = tuple(decode)
            seen.append((len(decode), max(lookahead, default=0)))
            return inputs(decode, prefill, lookahead)

        monkeypatch.setattr(engine.executor, "inputs", spy)
        got = engine.generate(PROMPTS, params)
        assert [r.token_ids for r in got] == [r.token_ids for r in want], name
        runs[name] = (seen, engine.stats)
    seen, stats = runs["tail"]
    assert all(drafted <= 2 for rows, drafted in seen if rows > 1), seen
    assert any(drafted > 2 for rows, drafted in seen if rows == 1), seen
    assert all(drafted <= 2 for _, drafted in runs["k"][0])
    assert stats.decode_iterations < runs["k"][1].decode_iterations, (stats, runs["k"][1])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_streak_k_drafts_longer_only_after_a_draft_kept_whole(make_engine, schedule, monkeypatch):
    """`streak_k`: a row drafts 6 where its last draft was kept whole, 2 otherwise; on a repeating
    context that takes fewer iterations than k = 2 throughout; tokens unchanged."""
    m = bigram(model())
    params = [SamplingParams(temperature=0.0, max_new_tokens=8 + 12 * i, ignore_stop=True) for i in range(4)]
    want = make_engine(m, small(schedule)).generate(PROMPTS, params)
    runs = {}
    for name, fields in (("k", {}), ("streak", {"streak_k": 6})):
        engine = make_engine(m, ngram(schedule, k=2, **fields))
        seen: list[tuple[int, bool]] = []  # (a row's drafts, its last draft kept whole) of every decode row
        executor, inputs = engine.executor, engine.executor.inputs

        def spy(decode, prefill, lookahead=(), inputs=inputs, seen=seen, executor=executor):
            decode = tuple(decode)
            seen += [(drafted, rid in executor.whole) for rid, drafted in zip(decode, lookahead)]
            return inputs(decode, prefill, lookahead)

        monkeypatch.setattr(executor, "inputs", spy)
        got = engine.generate(PROMPTS, params)
        assert [r.token_ids for r in got] == [r.token_ids for r in want], name
        runs[name] = (seen, engine.stats)
    seen, stats = runs["streak"]
    assert all(whole for drafted, whole in seen if drafted > 2), seen
    assert any(drafted > 2 for drafted, _ in seen), seen
    assert all(drafted <= 2 for drafted, _ in runs["k"][0])
    assert stats.decode_iterations < runs["k"][1].decode_iterations, (stats, runs["k"][1])
    assert not executor.whole - set(engine.table.requests)  # finished requests are forgotten


def test_streak_k_reaches_the_row_count_and_the_graphs():
    cfg = SpeculativeConfig("ngram", 3, tail_k=5, tail_k_rows=2, streak_k=7)
    assert [cfg.k_at(r) for r in (1, 4)] == [5, 3] and [cfg.k_at(r, streak=True) for r in (1, 4)] == [7, 7]
    assert SpeculativeConfig("ngram", 4, streak_k=2).k_at(9, streak=True) == 4  # never below k
    assert cfg.graph_rows(64) == 64 * 8 and SpeculativeConfig("ngram", 3).k_at(1, streak=True) == 3


def test_tail_k_graph_rows_cover_the_tails_longer_rows():
    cfg = SpeculativeConfig("ngram", 3, tail_k=7, tail_k_rows=4)
    assert [cfg.k_at(r) for r in (1, 4, 5)] == [7, 7, 3]
    assert cfg.graph_rows(64) == 64 * 4 and cfg.graph_rows(2) == 2 * 8 and cfg.graph_rows(5) == 4 * 8
    assert SpeculativeConfig("ngram", 3).graph_rows(5) == 20


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("tail", [{}, {"tail_k": 7, "tail_k_rows": 2}, {"streak_k": 7},
                                  {"ngram_min": 4, "ahead": True}])
def test_under_kv_pressure_every_request_finishes_or_fails_with_its_reason(tiny, make_engine, schedule, tail):
    """Few KV blocks: drafts are planned only where blocks remain (they never preempt), rows are
    preempted and recomputed; a request for n samples forks and its samples finish too. `tail`:
    longer drafts for the last rows ask for more blocks at the end, with the same outcome; or the
    steps that draft nothing decoded ahead (`ahead`), whose forwards grow blocks a step early."""
    m, plain, _ = tiny
    fields = {"ngram_min": 1, **tail}
    ahead = fields.pop("ahead", False)
    drafts = SpeculativeConfig("ngram", 4, **fields)
    tight = small(schedule, kv=KVConfig(num_blocks=14), speculative=drafts,
                  runner=RunnerConfig(decode_ahead="on" if ahead else "auto"))
    engine = make_engine(m, tight)
    params = [GREEDY] * len(PROMPTS) + [SamplingParams(temperature=0.0, max_new_tokens=4, n=2)]
    got = engine.generate(PROMPTS + [PROMPTS[0]], params)
    assert [r.token_ids for r in got[:len(PROMPTS)]] == [r.token_ids for r in plain]
    assert all(r.finish_reason is FinishReason.LENGTH for r in got[:len(PROMPTS)])
    assert [(r.finish_reason, r.token_ids) for r in got[-2:]] == [(FinishReason.LENGTH, plain[0].token_ids[:4])] * 2
    assert engine.stats.preemptions > 0 and engine.stats.accepted_tokens > 0, engine.stats
    assert engine.stats.ahead_taken > 0 if ahead else engine.stats.ahead_issued == 0, engine.stats
    assert not engine.has_work()


@pytest.mark.timeout(300)
def test_sampled_law_is_the_plain_samplers_and_a_broken_rule_is_caught(monkeypatch):
    """A repeating prompt: the lookup proposes a draft for every row (q one-hot), accepted with
    probability p(draft) and resampled from the rest of p otherwise."""
    check_the_sampled_law(monkeypatch, [1, 2, 0, 1, 2, 0, 1], SpeculativeConfig("ngram", 2, ngram_min=1))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("tail", [{}, {"tail_rows": 2}])
def test_undrafted_steps_decode_ahead_and_keep_greedy_tokens(make_engine, schedule, tail):
    """Steps whose lookup finds nothing issue the next forward ahead; a forward in flight when drafts
    turn up is taken (its rows draft a step later): 2-grams on 24 ids come and go. `tail_rows`: the
    steps of more than 2 rows draft nothing and are decoded ahead, the last rows draft."""
    m = model(vocab=24)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_stop=True) for n in (24, 10, 16, 30)]
    plain = make_engine(m, small(schedule)).generate(PROMPTS, params)
    drafts = SpeculativeConfig("ngram", 3, ngram_min=2, **tail)
    engine = make_engine(m, small(schedule, speculative=drafts, runner=RunnerConfig(decode_ahead="on")))
    assert make_engine(m, small(schedule, speculative=drafts)).executor.ahead is None  # "auto": the portable runner
    ex, issue, waiting = engine.executor, engine.executor.ahead.issue, []

    def spy(owners, draw):  # a forward issued ahead while a row has drafts waiting would hold them back again
        waiting.extend(o.request.rid for o in owners if ex._draft(o.request.rid) is not None)
        issue(owners, draw)

    ex.ahead.issue = spy
    got = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    for r, ref in zip(got, plain):
        assert r.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    stats = engine.stats
    assert stats.drafted_tokens > 0 and stats.ahead_taken > 0 and stats.ahead_dropped == 0, stats
    assert not waiting


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_lookups_run_while_a_forward_issued_ahead_runs_not_before_the_next(make_engine, schedule):
    """While a forward issued ahead is in flight, the plan makes no lookup: they were made right after
    it was issued (`after_issue`), from the tokens the host held then. Tokens stay plain decoding's."""
    m = model(vocab=24)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_stop=True) for n in (24, 10, 16, 30)]
    plain = make_engine(m, small(schedule)).generate(PROMPTS, params)
    drafts = SpeculativeConfig("ngram", 3, ngram_min=2)
    engine = make_engine(m, small(schedule, speculative=drafts, runner=RunnerConfig(decode_ahead="on")))
    ex, look_up, view, planning, seen = engine.executor, engine.executor._look_up, engine.executor.planning_view, [], []

    def spy_look_up(rids, rows):
        seen.append((bool(planning), ex.ahead.issued is not None))
        look_up(rids, rows)

    def spy_view(state):
        planning.append(True)
        try:
            return view(state)
        finally:
            planning.pop()

    ex._look_up, ex.planning_view = spy_look_up, spy_view
    got = engine.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert engine.stats.drafted_tokens > 0 and engine.stats.ahead_taken > 0, engine.stats
    assert (True, True) not in seen, "a plan looked up drafts while a forward issued ahead was in flight"
    assert (False, True) in seen, "no lookup was made after a forward was issued ahead"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_rows_arriving_after_the_tail_began_close_it_and_decode_ahead(make_engine, schedule):
    """Two rows draft (the tail of `tail_rows=2`); two more arrive, and while four decode no row
    carries the drafts it was given before: those steps are issued ahead. Tokens stay plain decoding's."""
    m = model(vocab=24)
    early = [SamplingParams(temperature=0.0, max_new_tokens=40, ignore_stop=True)] * 2
    late = [SamplingParams(temperature=0.0, max_new_tokens=12, ignore_stop=True)] * 2
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[2], PROMPTS[1]]
    plain = make_engine(m, small(schedule)).generate(prompts, early + late)
    drafts = SpeculativeConfig("ngram", 3, ngram_min=1, tail_rows=2)
    engine = make_engine(m, small(schedule, speculative=drafts, runner=RunnerConfig(decode_ahead="on")))
    issue, wide = engine.executor.ahead.issue, []

    def spy(owners, draw):
        wide.append(len(owners) > 2)
        issue(owners, draw)

    engine.executor.ahead.issue = spy
    rids = [engine.add_request(p, s) for p, s in zip(prompts[:2], early)]
    done = {}
    while engine.stats.drafted_tokens == 0:
        done.update((o.request_id, o) for o in engine.step())
    rids += [engine.add_request(p, s) for p, s in zip(prompts[2:], late)]
    while engine.has_work():
        done.update((o.request_id, o) for o in engine.step())
    assert [done[r].results[0].token_ids for r in rids] == [r.token_ids for r in plain]
    assert any(wide), "no step of four rows was issued ahead: drafts from before the tail closed held it back"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sampled_rows_that_never_draft_decode_ahead_as_plain_sampling(make_engine, schedule):
    """Temperature 1 where no 6-gram repeats: every decode step is undrafted and decoded ahead, with
    the plain engine's tokens and logprobs (the same draws from the same generators)."""
    m = model(vocab=64)
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=12, ignore_stop=True) for s in range(4)]
    want = make_engine(m, small(schedule, runner=RunnerConfig(decode_ahead="off"))).generate(PROMPTS, params)
    rare = SpeculativeConfig("ngram", 3, ngram_min=6, ngram_max=6)
    engine = make_engine(m, small(schedule, speculative=rare, runner=RunnerConfig(decode_ahead="on")))
    got = engine.generate(PROMPTS, params)
    assert engine.stats.drafted_tokens == 0 and engine.stats.ahead_taken > 0, engine.stats
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for r, ref in zip(got, want):
        assert r.logprobs == pytest.approx(ref.logprobs, abs=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_prompt_is_indexed_while_its_prefill_runs_and_lookups_pay_for_new_tokens_only(tiny, make_engine, schedule,
                                                                                         monkeypatch):
    """The contexts of rows whose prefill ends in a forward are synced and hashed before that forward's
    tokens are read (`SpeculativeExecutor._prepare`): a lookup then copies only the tokens the row emitted
    since (at most k + 1 a step), never a turn's input. Tokens stay plain decoding's."""
    from megatron_rollout.drafts import NgramIndex

    m, plain, _ = tiny
    k, copied, preparing, sync, prepare = 3, [], [], NgramIndex.sync, NgramIndex.prepare

    def spy_sync(index, tokens):
        if not preparing:
            copied.append(len(tokens) - index.length)
        sync(index, tokens)

    def spy_prepare(index, tokens):
        preparing.append(len(tokens))
        prepare(index, tokens)
        assert index.grams.covered == index.length == len(tokens)
        preparing.pop()

    monkeypatch.setattr(NgramIndex, "sync", spy_sync)
    monkeypatch.setattr(NgramIndex, "prepare", spy_prepare)
    got = make_engine(m, ngram(schedule, k)).generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert copied and max(copied) <= k + 1, copied


def test_auto_decodes_the_undrafted_steps_ahead_where_the_runner_overlaps_the_host(monkeypatch):
    """`decode_ahead="auto"` under n-gram drafts is plain decoding's rule: on where the runner's forward
    overlaps the host (the CUDA runner on one rank; here the portable runner made to say so), off where
    it does not or when asked; under MTP drafting off, and "on" refused."""
    from megatron_rollout.runner.base import ModelRunner

    m, drafts = model(), SpeculativeConfig("ngram", 3, ngram_min=1)
    assert RolloutEngine(m, small("chunked", speculative=drafts)).executor.ahead is None
    monkeypatch.setattr(ModelRunner, "overlaps_host", property(lambda self: True))
    assert RolloutEngine(m, small("chunked", speculative=drafts)).executor.ahead is not None
    off = RunnerConfig(decode_ahead="off")
    assert RolloutEngine(m, small("chunked", speculative=drafts, runner=off)).executor.ahead is None
    with_mtp, mtp = MoETransformer(CFG).init_weights(seed=0, std=0.3), SpeculativeConfig("mtp", 1)
    assert RolloutEngine(with_mtp, small("chunked", speculative=mtp)).executor.ahead is None
    with pytest.raises(ValueError, match="exclude each other"):
        RolloutEngine(with_mtp, small("chunked", speculative=mtp, runner=RunnerConfig(decode_ahead="on")))


def test_the_config_names_what_is_wrong():
    with pytest.raises(ValueError, match="1 <= ngram_min <= ngram_max, got 3 and 2"):
        SpeculativeConfig("ngram", 2, ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="tail_rows must be a positive int or None, got 0"):
        SpeculativeConfig("ngram", 2, tail_rows=0)
    with pytest.raises(ValueError, match=r"tail_k must be an int in \[1, 8\] or None, got 9"):
        SpeculativeConfig("ngram", 2, tail_k=9)
    with pytest.raises(ValueError, match="tail_k is for n-gram drafts"):
        SpeculativeConfig("mtp", 1, tail_k=3)
    with pytest.raises(ValueError, match="tail_k_rows must be a positive int, got 0"):
        SpeculativeConfig("ngram", 2, tail_k=3, tail_k_rows=0)
    with pytest.raises(ValueError, match=r"streak_k must be an int in \[1, 8\] or None, got 0"):
        SpeculativeConfig("ngram", 2, streak_k=0)
    with pytest.raises(ValueError, match="streak_k is for n-gram drafts"):
        SpeculativeConfig("mtp", 1, streak_k=3)
    got = EngineConfig.from_dict({"speculative": {"method": "ngram", "k": 3, "tail_rows": 8}}).speculative
    assert got == SpeculativeConfig("ngram", 3, tail_rows=8)


def test_the_command_line_spells_it_ngram_k():
    import argparse

    from megatron_rollout.options import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    got = engine_config(parser.parse_args(["--ngram", "3", "--draft-tail-rows", "4"])).speculative
    assert got == SpeculativeConfig("ngram", 3, tail_rows=4)
    with pytest.raises(ValueError, match="two draft sources"):
        engine_config(parser.parse_args(["--ngram", "3", "--mtp", "1"]))
    with pytest.raises(ValueError, match="--draft-tail-rows needs"):
        engine_config(parser.parse_args(["--draft-tail-rows", "4"]))
    got = engine_config(parser.parse_args(["--ngram", "4", "--draft-tail-k", "7", "--draft-tail-k-rows", "2"]))
    assert got.speculative == SpeculativeConfig("ngram", 4, tail_k=7, tail_k_rows=2)
    with pytest.raises(ValueError, match="--draft-tail-k needs --ngram"):
        engine_config(parser.parse_args(["--mtp", "1", "--draft-tail-k", "3"]))
    with pytest.raises(ValueError, match="--draft-tail-k-rows needs --draft-tail-k"):
        engine_config(parser.parse_args(["--ngram", "4", "--draft-tail-k-rows", "2"]))
    assert engine_config(parser.parse_args(["--ngram", "4", "--draft-tail-k", "6"])).speculative.tail_k_rows == 4
    got = engine_config(parser.parse_args(["--ngram", "4", "--draft-streak-k", "7"])).speculative
    assert got == SpeculativeConfig("ngram", 4, streak_k=7)
    with pytest.raises(ValueError, match="--draft-streak-k needs --ngram"):
        engine_config(parser.parse_args(["--draft-streak-k", "7"]))


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_on_the_gpu_lookup_drafts_keep_greedy_tokens(make_engine):
    """float32 (the CUDA runner's graphs verify one-query rows; bf16 near-ties could round apart)."""
    m = bigram(MoETransformer(CFG.replace(vocab_size=12, mtp_num_layers=0), device=torch.device("cuda"))
               .init_weights(seed=0, std=0.3))
    want = make_engine(m, small("chunked", runner=RunnerConfig(kind="eager"))).generate(PROMPTS, GREEDY)
    for schedule in SCHEDULES:
        engine = make_engine(m, ngram(schedule, k=4))  # runner kind auto: the CUDA runner's verify graphs
        assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == [r.token_ids for r in want], schedule
        assert engine.stats.acceptance_rate > 0.5, (schedule, engine.stats)
    engine = make_engine(m, ngram("mux", k=2, tail_k=7, tail_k_rows=2))  # 8-position rows: one run each
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == [r.token_ids for r in want]
    # undrafted steps as the plain executor's steps (decode ahead on): 6-grams on 64 ids rarely repeat, so most
    # steps draft nothing. fp32 experts are not graph-safe: decode runs eagerly, capture_graphs says so, and no
    # forward is fed ahead (the CUDA runner feeds one only into its decode graphs; the benchmark's bf16 replays
    # issue them)
    m = MoETransformer(CFG.replace(vocab_size=64, mtp_num_layers=0), device=torch.device("cuda")).init_weights(
        seed=0, std=0.3)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_stop=True) for n in (24, 10, 16, 30)]
    want = make_engine(m, small("chunked", runner=RunnerConfig(kind="eager"))).generate(PROMPTS, params)
    for schedule in SCHEDULES:
        rare = SpeculativeConfig("ngram", 3, ngram_min=6, ngram_max=6)
        engine = make_engine(m, small(schedule, speculative=rare, runner=RunnerConfig(decode_ahead="on")))
        assert not engine.capture_graphs(len(PROMPTS))
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == [r.token_ids for r in want], schedule
        assert engine.stats.drafted_tokens > 0 and engine.stats.ahead_issued == 0, (schedule, engine.stats)


class _CaptureSurface:
    """What `capture_graphs` asks of a CUDA runner (buckets, capture), recording the request: the
    sizing is the engine's arithmetic; capturing itself is the GPU tests' (`tests/runner`)."""

    config = RunnerConfig(graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64))

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.config.graph_batch_sizes if b >= rows), None)

    def capture(self, sizes, speculative=(), plain=True, plain_decode=()) -> bool:
        self.asked = (list(sizes), tuple(speculative))
        self.plain, self.plain_decode = plain, list(plain_decode)
        return True


@pytest.mark.timeout(60)
def test_capture_graphs_asks_for_the_verify_rows_of_every_draft():
    plain = RolloutEngine(model(), small("mux"))
    assert not plain.capture_graphs(4)  # the portable runner has no graphs
    for engine, rows, want in ((plain, 5, ([1, 2, 4, 8], ())),                  # 5 rows: bucket 8
                               (RolloutEngine(model(), ngram("mux", k=3)), 5,  # 5 x (1 + 3) = 20: bucket 32
                                ([1, 2, 4, 8, 16, 32], ("hidden",))),
                               (RolloutEngine(model(), ngram("mux", k=3)), 40,  # past the largest: all of them
                                ([1, 2, 4, 8, 16, 32, 64], ("hidden",))),
                               (RolloutEngine(model(), ngram("mux", k=1, tail_k=7, tail_k_rows=4)), 5,
                                ([1, 2, 4, 8, 16, 32], ("hidden",)))):  # 4 tail rows x (1 + 7) = 32
        engine.runner = _CaptureSurface()
        assert engine.capture_graphs(rows) and engine.runner.asked == want
        assert engine.runner.plain == (not want[1])  # a drafting engine replays no plain graph
        assert engine.runner.plain_decode == []  # ... unless it decodes ahead (below)
    ahead = RolloutEngine(model(), dataclasses.replace(ngram("chunked"), runner=RunnerConfig(decode_ahead="on")))
    ahead.runner = _CaptureSurface()  # its undrafted steps: the plain decode buckets of up to 5 rows
    assert ahead.capture_graphs(5) and ahead.runner.asked == ([1, 2, 4, 8, 16, 32], ("hidden",))
    assert not ahead.runner.plain and ahead.runner.plain_decode == [1, 2, 4, 8]
    mtp = RolloutEngine(MoETransformer(CFG).init_weights(seed=0, std=0.3),
                        small("mux", speculative=SpeculativeConfig("mtp", 2)))
    mtp.runner = _CaptureSurface()
    assert mtp.capture_graphs(4) and mtp.runner.asked == ([1, 2, 4, 8, 16], ("hidden", "mtp"))  # 12 rows
    assert not mtp.runner.plain
    with pytest.raises(ValueError, match="max_rows must be positive"):
        plain.capture_graphs(0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_n_samples_fork_and_each_equals_a_separate_request(make_engine, schedule):
    """n > 1 (an RL group sharing its prompt) under n-gram drafts: the prompt is prefilled once and
    drawn once per sample from the sample's own generator; each sample then decodes and drafts on
    its own, and equals a request of its own with the sample's seed. Greedy samples are plain
    decoding's tokens."""
    m = model(seed=2)  # attention on: a fork that missed its partial block's K/V would decode otherwise
    prompt = PROMPTS[0]  # 7 tokens: one full block shared, the partial one copied per sample
    params = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_stop=True, seed=11, n=4)
    engine = make_engine(m, ngram(schedule))
    results = engine.generate([prompt], params)
    assert len(results) == 4 and engine.stats.prefill_tokens == len(prompt)
    assert engine.stats.drafted_tokens > 0 and engine.stats.accepted_tokens > 0, engine.stats
    separate = [make_engine(m, ngram(schedule)).generate([prompt], dataclasses.replace(
        params, n=1, seed=sample_seed(11, i)))[0] for i in range(4)]
    assert [r.token_ids for r in results] == [r.token_ids for r in separate]
    assert [x for r in results for x in r.logprobs] == pytest.approx([x for r in separate for x in r.logprobs],
                                                                     abs=1e-5)
    assert len({tuple(r.token_ids) for r in results}) > 1  # independent draws
    greedy = make_engine(m, ngram(schedule)).generate([prompt], dataclasses.replace(GREEDY, n=3))
    plain = RolloutEngine(m, small("chunked")).generate([prompt], GREEDY)[0]
    assert [r.token_ids for r in greedy] == [plain.token_ids] * 3
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_top_and_prompt_logprobs_are_served_under_drafts_as_plain_decoding_serves_them(tiny, make_engine, schedule):
    m, plain_greedy, _ = tiny
    asked = [dataclasses.replace(GREEDY, prompt_logprobs=1), dataclasses.replace(GREEDY, logprobs=2), GREEDY,
             dataclasses.replace(GREEDY, logprobs=1, prompt_logprobs=2)]
    plain = RolloutEngine(m, small(schedule)).generate(PROMPTS, asked)
    engine = make_engine(m, ngram(schedule))
    got = engine.generate(PROMPTS, asked)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain] == [r.token_ids for r in plain_greedy]
    def same(mine: dict[int, float] | None, theirs: dict[int, float] | None) -> bool:
        return (mine is None and theirs is None) or (
            mine is not None and theirs is not None and mine.keys() == theirs.keys()
            and list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-4))

    for r, ref in zip(got, plain):
        assert r.finish_reason is FinishReason.LENGTH and r.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        for entries, theirs in ((r.top_logprobs, ref.top_logprobs), (r.prompt_logprobs, ref.prompt_logprobs)):
            assert (entries is None) == (theirs is None)
            assert all(same(a, b) for a, b in zip(entries or [], theirs or [], strict=True))
    for i in (0, 3):  # every prompt position after the first scored
        assert len(got[i].prompt_logprobs) == len(PROMPTS[i]) and all(got[i].prompt_logprobs[1:])
    assert engine.stats.drafted_tokens > 0  # the rows without top logprobs still drafted
