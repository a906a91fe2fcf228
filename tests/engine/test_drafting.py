"""MTP speculative decoding inside the engine (`engine.drafting`) on a tiny DeepSeek-V3 with an MTP
layer: greedy tokens equal plain decoding under off, chunked and mux; the returned logprobs are
the target's; a copying MTP layer is always right (acceptance 1, fewer decode iterations); the
sampled law is the plain sampler's (chi-square), and the same test rejects a broken acceptance
rule."""
from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch

from benchmarks.mtp import make_copying
from megatron_rollout.engine import (
    EngineConfig,
    FinishReason,
    KVConfig,
    MuxConfig,
    RolloutEngine,
    RunnerConfig,
    SamplingParams,
    SchedulerConfig,
    SpeculativeConfig,
    drafting,
)
from megatron_rollout.engine.speculative import Verdict
from megatron_rollout.model.transformer import MoETransformer
from tests.model.test_mtp import CFG, PROMPTS

from .common import SCHEDULES, small

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_stop=True)


def model(seed: int = 0, vocab: int = 12) -> MoETransformer:
    return MoETransformer(CFG.replace(vocab_size=vocab)).init_weights(seed=seed, std=0.3)


def spec(schedule: str, k: int, **components) -> EngineConfig:
    return small(schedule, speculative=SpeculativeConfig(k=k), **components)


@pytest.fixture(scope="module")
def tiny():
    m = model()
    plain = RolloutEngine(m, small("chunked")).generate(PROMPTS, GREEDY)
    return m, plain


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule,k", [("off", 1), ("chunked", 2), ("mux", 1), ("mux", 3)])
def test_greedy_tokens_equal_plain_decoding(tiny, make_engine, schedule, k):
    m, plain = tiny
    engine = make_engine(m, spec(schedule, k))
    got = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    for r, ref in zip(got, plain):
        assert r.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert engine.stats.drafted_tokens > 0  # drafts were verified (random weights: mostly rejected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_copying_mtp_layer_is_always_accepted(make_engine, schedule):
    m = make_copying(model(1))
    whole = SchedulerConfig(schedule=schedule, block_size=4, max_batch_tokens=64)  # every prompt in one prefill
    plain = make_engine(m, small(schedule, scheduler=whole))
    want = plain.generate(PROMPTS, GREEDY)
    engine = make_engine(m, spec(schedule, 1, scheduler=whole))
    got = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    s = engine.stats
    assert s.acceptance_rate == 1.0 and s.accepted_tokens == s.drafted_tokens > 0
    # every iteration after a row's first emits two tokens: about half the plain iterations
    assert s.decode_iterations <= plain.stats.decode_iterations * 2 // 3, (s, plain.stats)
    assert s.decode_tokens == plain.stats.decode_tokens


@pytest.mark.timeout(120)
def test_chained_drafts_of_a_copying_layer_are_accepted(make_engine):
    m = make_copying(model(1))
    engine = make_engine(m, spec("chunked", 3))
    got = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=13, ignore_stop=True))
    want = make_engine(m, small("chunked")).generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=13,
                                                                               ignore_stop=True))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert engine.stats.acceptance_rate == 1.0 and engine.stats.drafted_tokens >= 3 * len(PROMPTS) * 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["chunked", "mux"])
def test_sampled_logprobs_are_the_targets(tiny, make_engine, schedule):
    m, _ = tiny
    engine = make_engine(m, spec(schedule, 2))
    params = [SamplingParams(temperature=1.0, max_new_tokens=10, ignore_stop=True, seed=i) for i in range(3)]
    got = engine.generate(PROMPTS, params)
    assert engine.stats.drafted_tokens > 0
    for prompt, r in zip(PROMPTS, got):
        with torch.no_grad():
            teacher = m.token_logprobs(torch.tensor([prompt + r.token_ids]))[0, len(prompt) - 1:]
        assert torch.allclose(torch.tensor(r.logprobs), teacher, atol=1e-4)


def _accept_every_draft(target, drafts, q, params, generator):
    """A broken rule: keeps every draft (the drafter's law, not the target's)."""
    from megatron_rollout.engine.sampler import sample_row

    last = sample_row(target[-1], params, generator)
    return Verdict(len(drafts), (*drafts, last.token), (0.0,) * len(drafts) + (last.logprob,))


def _accept_every_lookup(logits, rows):
    """The same broken rule for the rows decided at once (n-gram drafts)."""
    from megatron_rollout.engine.sampler import sample_row

    last = [sample_row(logits[r.start + len(r.drafts)], r.params, r.generator) for r in rows]
    return [Verdict(len(r.drafts), (*r.drafts, s.token), (0.0,) * len(r.drafts) + (s.logprob,))
            for r, s in zip(rows, last)]


def _counts(m: MoETransformer, config: EngineConfig, prompt: list[int], n: int) -> tuple[list[int], float]:
    params = SamplingParams(temperature=1.0, max_new_tokens=3, ignore_stop=True)
    engine = RolloutEngine(m, config)
    cells = list(itertools.product(range(m.cfg.vocab_size), repeat=3))
    counts = [0] * len(cells)
    for r in engine.generate([prompt] * n, params):
        counts[cells.index(tuple(r.token_ids))] += 1
    return counts, engine.stats.acceptance_rate


def check_the_sampled_law(monkeypatch, prompt: list[int], speculative: SpeculativeConfig, n: int = 300) -> None:
    """Three tokens after `prompt` on a 3-token vocabulary (27 cells), `n` runs each: sampling under
    `speculative` against the exact law and against the plain sampler; accepting every draft (the
    broken rule) fails the same test."""
    stats = pytest.importorskip("scipy.stats")
    m = model(seed=2, vocab=3)
    cells = list(itertools.product(range(3), repeat=3))
    with torch.no_grad():
        law = m.token_logprobs(torch.tensor([prompt + list(c) for c in cells]))[:, len(prompt) - 1:].sum(-1).exp()
    expected = (law.double() / law.double().sum() * n).tolist()
    roomy = dict(scheduler=SchedulerConfig(block_size=4, max_batch_tokens=512, max_decode_rows=512),
                 kv=KVConfig(num_blocks=4096))
    config = EngineConfig(**roomy, speculative=speculative, seed=5)
    drafted, acceptance = _counts(m, config, prompt, n)
    assert 0.1 < acceptance < 0.95, acceptance  # accepted and rejected drafts both exercised
    plain, _ = _counts(m, EngineConfig(**roomy, seed=6), prompt, n)
    assert stats.chisquare(drafted, expected).pvalue > 1e-3
    assert stats.chisquare(plain, expected).pvalue > 1e-3
    seen = [i for i in range(len(cells)) if drafted[i] + plain[i]]
    assert stats.chi2_contingency([[drafted[i] for i in seen], [plain[i] for i in seen]]).pvalue > 1e-3
    monkeypatch.setattr(drafting, "verify", _accept_every_draft)
    monkeypatch.setattr(drafting, "verify_lookup", _accept_every_lookup)
    broken, acceptance = _counts(m, config, prompt, n)
    assert acceptance == 1.0
    assert stats.chisquare(broken, expected).pvalue < 1e-6


@pytest.mark.timeout(300)
def test_sampled_law_is_the_plain_samplers_and_a_broken_rule_is_caught(monkeypatch):
    """MTP drafts (k = 1) after one prompt."""
    check_the_sampled_law(monkeypatch, [1, 2, 0], SpeculativeConfig(k=1))


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match="mtp_num_layers=0"):
        RolloutEngine(MoETransformer(CFG.replace(mtp_num_layers=0)), spec("chunked", 1))
    with pytest.raises(ValueError, match="on many ranks pass RunnerConfig"):  # a multi-rank CudaRunner
        drafting.SpeculativeExecutor(None, SimpleNamespace(model=model(), multi_rank=True), None, None, 0,
                                     SpeculativeConfig(k=1))
    with pytest.raises(ValueError, match="decode_ahead='on'"):
        RolloutEngine(model(), spec("chunked", 1, runner=RunnerConfig(decode_ahead="on")))
    with pytest.raises(ValueError, match="naive ordering"):
        RolloutEngine(model(), spec("mux", 1, mux=MuxConfig("fixed:1", ordering="naive")))
    with pytest.raises(ValueError, match=r"SpeculativeConfig.k must be an int in \[1, 8\]"):
        SpeculativeConfig(k=0)
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    assert EngineConfig.from_dict({"speculative": {"k": 2}}).speculative == SpeculativeConfig(k=2)
    assert EngineConfig.from_dict({"speculative": None}).speculative is None


def _mtp_kv(m: MoETransformer, schedule: str) -> torch.Tensor:
    """The MTP layer's cached K/V rows of one request's computed positions, three tokens in."""
    engine = RolloutEngine(m, spec(schedule, 1))
    rid = engine.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_stop=True))
    req = engine.requests[rid]
    while len(req.output) < 3:
        engine.step()
    bs = engine.config.scheduler.block_size
    slots = [b * bs + i for b in engine.pool.table(req.seq.sid) for i in range(bs)][:req.seq.computed]
    return engine.runner.cache.k[m.cfg.num_layers][slots].flatten(1)  # [computed, width]


@pytest.mark.timeout(120)
def test_the_mtp_layer_has_kv_at_every_computed_position(tiny):
    """Prompt positions inside the prefill forward, the last one after its token is sampled (same
    step under off and chunked, the first decode iteration after a mux epoch), then every accepted
    position: the same rows under every schedule, none left unwritten (the cache starts at zero)."""
    m, _ = tiny
    ref = _mtp_kv(m, "off")
    assert ref.shape[0] >= len(PROMPTS[2]) + 1 and bool((ref.abs().amax(-1) > 0).all())
    for schedule in ("chunked", "mux"):
        got = _mtp_kv(m, schedule)
        n = min(len(got), len(ref))
        assert torch.allclose(got[:n], ref[:n], atol=1e-5), schedule


def _agree_but_for_near_ties(m: MoETransformer, prompt: list[int], got: list[int], want: list[int],
                             margin: float = 0.05) -> bool:
    """`got` equals `want`, or first differs where the target's two most likely tokens (the plain
    tokens teacher-forced) are within `margin` in logit: bf16 kernels of other batch shapes may
    round such a tie the other way (a verify forward runs k + 1 rows per decode row)."""
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if at is None:
        return len(got) == len(want)
    with torch.no_grad():
        logits = m(torch.tensor([prompt + want], device=m.device))[0, len(prompt) - 1 + at].float()
    top = logits.topk(2).values
    return float(top[0] - top[1]) < margin


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_on_the_cuda_runner_drafting_replays_graphs_and_keeps_greedy_tokens(make_engine):
    """MTP on equals MTP off (bf16: but for near-ties), both on the CUDA runner with its graphs,
    under every schedule; decode steps' verify and draft forwards were graph replays, prefills
    piecewise graphs of hidden states; a copying MTP layer is always accepted there too."""
    m = MoETransformer(CFG.replace(dtype="bfloat16"), device=torch.device("cuda")).init_weights(seed=0, std=0.3)
    cuda = RunnerConfig(kind="cuda")
    exact = 0
    for schedule in SCHEDULES:
        plain = make_engine(m, small(schedule, runner=cuda))
        want = plain.generate(PROMPTS, GREEDY)
        assert plain.runner.stats["graph_replays"] > 0, schedule
        engine = make_engine(m, spec(schedule, 2, runner=cuda))
        got = engine.generate(PROMPTS, GREEDY)
        for prompt, r, ref in zip(PROMPTS, got, want):
            assert _agree_but_for_near_ties(m, prompt, r.token_ids, ref.token_ids), (schedule, r, ref)
            if r.token_ids == ref.token_ids:
                exact += 1
                assert r.logprobs == pytest.approx(ref.logprobs, abs=0.05), schedule
        stats = engine.runner.stats
        assert engine.stats.drafted_tokens > 0 and engine.runner.spec_capture_error is None, schedule
        assert stats["verify_replays"] > 0 and stats["draft_replays"] >= stats["verify_replays"], (schedule, stats)
        assert stats["graph_replays"] == 0, stats  # plain decode graphs are not what drafting runs
        assert stats["piecewise_forwards"] > 0 and engine.runner.prefill_capture_error is None, stats
        assert {name for name, _ in engine.runner.captured.speculative} == {"hidden", "mtp", "prefill-hidden"}
    assert exact >= 2 * len(SCHEDULES), f"only {exact} of {3 * len(SCHEDULES)} requests agree exactly"
    copying = make_copying(MoETransformer(CFG.replace(dtype="bfloat16"), device=torch.device("cuda"))
                           .init_weights(seed=1, std=0.3))
    engine = make_engine(copying, spec("chunked", 2, runner=cuda))
    want = make_engine(copying, small("chunked", runner=cuda)).generate(PROMPTS, GREEDY)
    for prompt, r, ref in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), want):
        assert _agree_but_for_near_ties(copying, prompt, r.token_ids, ref.token_ids)
    # right by construction, up to bf16 rounding of the MTP layer's extra norm
    assert engine.stats.acceptance_rate >= 0.9 and engine.runner.stats["verify_replays"] > 0


def test_greedy_choices_are_read_for_every_row_at_once():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 3.0, -1.0], [0.0, float("nan"), 1.0]])
    best = drafting._best(logits)
    logp = logits[:2].log_softmax(-1)
    assert [b.token for b in best[:2]] == [1, 0]  # a tie: the first index, as argmax
    assert [b.logprob for b in best[:2]] == pytest.approx([float(logp[0, 1]), float(logp[1, 0])])
    assert [b.finite for b in best] == [True, True, False]


def test_the_command_line_spells_it_mtp_k():
    import argparse

    from megatron_rollout.options import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(["--mtp", "2"])).speculative == SpeculativeConfig(k=2)
    assert engine_config(parser.parse_args([])).speculative is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ask", [{"n": 2}, {"logprobs": 3}, {"prompt_logprobs": 1}])
def test_what_mtp_drafting_cannot_serve_is_refused_per_request(tiny, make_engine, ask):
    """MTP drafting returns each verified token's own logprob and keeps one hidden state per prompt:
    a request for top/prompt logprobs, or for n samples, is refused alone (an ERROR result naming
    why), not served with samples or logprobs silently missing; the others in the batch run.
    (n-gram drafting serves all three: tests/engine/test_drafting_ngram.py.)"""
    m, plain = tiny
    engine = make_engine(m, spec("chunked", 1))
    bad, good = engine.generate(PROMPTS[:2], [dataclasses.replace(GREEDY, **ask), GREEDY])[-2:]
    assert bad.finish_reason is FinishReason.ERROR and "speculative decoding" in bad.error
    assert good.token_ids == plain[1].token_ids
