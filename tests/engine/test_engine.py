"""The rollout engine on one process, on tiny random HF checkpoints: greedy tokens and logprobs
equal transformers' `generate`; preemption, prefix sharing, the three schedules, batching and
aborts change no other request's tokens; sessions prefill only what is new; weight updates and
KV release behave. Every engine passes `check_integrity()` at teardown (see conftest)."""
from __future__ import annotations

import copy

import pytest
import torch

from megatron_rollout.engine import FinishReason, RequestError, SamplingParams, SessionClosed
from megatron_rollout.engine.scheduler import Stage
from megatron_rollout.engine.weights import WeightVersionError

from .conftest import V

SCHEDULES = ["off", "chunked", "mux"]
# Small blocks and a small chunk budget so that prompts span several blocks and chunks; mux
# releases one segment per round so that epochs really interleave with decode.
SMALL = dict(block_size=4, num_blocks=64, max_batch_tokens=8, mux_span="fixed:1")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def prompts(lengths, seed=0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, V, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and the log-softmax of its scores at each chosen token."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    assert len(tokens) == n
    return tokens, [float(s[0].float().log_softmax(-1)[t]) for s, t in zip(out.scores, tokens)]


def drain(engine, outs: dict | None = None) -> dict:
    """Step until the engine is idle; every finished request once, by id."""
    outs = {} if outs is None else outs
    while True:
        for out in engine.step():
            assert out.request_id not in outs, f"request {out.request_id} finished twice"
            outs[out.request_id] = out
        if not engine.has_work():
            for out in engine.step():  # aborts still undelivered
                assert out.request_id not in outs
                outs[out.request_id] = out
            return outs


def assert_same(results, reference, atol=1e-4):
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    assert [r.finish_reason for r in results] == [r.finish_reason for r in reference]
    for r, ref in zip(results, reference):
        assert r.logprobs == pytest.approx(ref.logprobs, abs=atol)


def reference(make_engine, model, batch, params):
    """One request at a time on a roomy engine: what each request must produce in any batch."""
    engine = make_engine(model, block_size=16, num_blocks=64)
    plist = params if isinstance(params, list) else [params] * len(batch)
    return [engine.generate([p], [sp])[0] for p, sp in zip(batch, plist)]


# ---------------------------------------------------------------- parity with transformers

@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_greedy_equals_transformers(request, make_engine, family, schedule):
    hf, model = request.getfixturevalue(family)
    batch = prompts([1, 6, 11, 19], seed=1)
    lengths = [5, 8, 3, 6]
    engine = make_engine(model, schedule=schedule, **SMALL)
    results = engine.generate(batch, [SamplingParams(temperature=0.0, max_new_tokens=n) for n in lengths])
    for prompt, n, res in zip(batch, lengths, results):
        tokens, logprobs = hf_greedy(hf, prompt, n)
        assert res.token_ids == tokens
        assert res.logprobs == pytest.approx(logprobs, abs=1e-4)
        assert res.finish_reason is FinishReason.LENGTH and res.error is None
        assert res.weight_versions == [0] * n
    assert engine.stats.prefill_tokens == sum(len(p) for p in batch)
    assert engine.stats.decode_tokens == sum(lengths) - len(batch)
    if schedule == "mux":
        assert engine.mux.rounds > 0 and not engine.mux.busy
    assert engine.pool.num_free == engine.pool.num_blocks  # finished one-shot requests keep no KV


def test_schedules_give_the_same_tokens_in_one_engine_run(make_engine, qwen):
    """off, chunked and mux at temperature 0 on a mixed batch of short and long prompts."""
    _, model = qwen
    batch = prompts([3, 25, 2, 14, 9], seed=2)
    params = SamplingParams(temperature=0.0, max_new_tokens=7)
    results = {s: make_engine(model, schedule=s, **SMALL).generate(batch, params) for s in SCHEDULES}
    assert_same(results["chunked"], results["off"])
    assert_same(results["mux"], results["off"])
    assert_same(results["off"], reference(make_engine, model, batch, params))


# ---------------------------------------------------------------- KV pressure and sharing

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_preemption_gives_the_same_tokens(make_engine, qwen, schedule):
    _, model = qwen
    batch = prompts([6, 9, 7, 8], seed=3)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)  # each needs <= 5 blocks of 4
    tight = make_engine(model, schedule=schedule, block_size=4, num_blocks=8, max_batch_tokens=32, mux_span="fixed:1")
    results = tight.generate(batch, params)
    assert tight.stats.preemptions > 0
    assert tight.stats.prefill_tokens > sum(len(p) for p in batch)  # preempted rows were recomputed
    assert_same(results, reference(make_engine, model, batch, params))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_grpo_samples_share_their_prompt_blocks(make_engine, qwen, schedule):
    _, model = qwen
    prompt = prompts([13], seed=4)[0]  # 3 full blocks of 4, and 1 token
    params = [SamplingParams(temperature=1.5, max_new_tokens=6, seed=s) for s in range(4)]
    runs = {}
    for caching in (True, False):
        engine = make_engine(model, schedule=schedule, prefix_caching=caching, **{**SMALL, "max_batch_tokens": 64})
        rids = [engine.add_request(prompt, p) for p in params]
        shared = None
        outs: dict = {}
        while len(outs) < 4:
            for out in engine.step():
                outs[out.request_id] = out
            if engine.stats.steps == 1:
                # Twins wait for the first only when they can reuse its blocks.
                admitted = [r for r in rids if engine.requests[r].stage is not Stage.WAITING]
                assert admitted == (rids[:1] if caching else rids)
            live = [engine.requests.get(r) for r in rids]
            if shared is None and all(r is not None and r.stage is Stage.DECODE for r in live):
                tables = [engine.pool.table(engine.requests[r].seq.sid) for r in rids]
                shared = [engine.pool.refcount[b] for b in tables[0][:3]]
                assert all(t[:3] == tables[0][:3] for t in tables) == caching
        runs[caching] = (engine.stats.prefill_tokens, [outs[r].result for r in rids], shared)
    assert runs[True][0] == 13 + 3 * 1  # the twins computed only their last token
    assert runs[False][0] == 4 * 13
    assert runs[True][2] == [4, 4, 4] and runs[False][2] == [1, 1, 1]
    assert_same(runs[True][1], runs[False][1])
    assert len({tuple(r.token_ids) for r in runs[True][1]}) > 1  # the seeds did sample differently


def test_twins_share_a_prompt_longer_than_the_chunk_budget(make_engine, qwen):
    """`chunked` with a prompt cut into several chunks: the twins wait for all of it, then share."""
    _, model = qwen
    prompt = prompts([21], seed=5)[0]
    engine = make_engine(model, schedule="chunked", **SMALL)
    results = engine.generate([prompt] * 3, SamplingParams(temperature=0.0, max_new_tokens=3))
    assert engine.stats.prefill_tokens == 21 + 2 * 1
    assert_same(results, reference(make_engine, model, [prompt] * 3, SamplingParams(temperature=0.0, max_new_tokens=3)))


def test_prefix_cache_revives_freed_blocks(make_engine, qwen):
    """A prompt seen before, whose request finished, still finds its blocks (until reused)."""
    _, model = qwen
    prompt = prompts([17], seed=6)[0]
    engine = make_engine(model, **SMALL)
    first = engine.generate([prompt], GREEDY)
    assert engine.pool.num_free == engine.pool.num_blocks
    again = engine.generate([prompt + [5]], GREEDY)  # 16 of its 18 positions are cached
    assert engine.stats.prefill_tokens == 17 + 2
    assert_same(again, reference(make_engine, model, [prompt + [5]], GREEDY))
    assert_same(first, reference(make_engine, model, [prompt], GREEDY))


# ---------------------------------------------------------------- sampling, stops, lengths

def test_same_seed_same_tokens_in_any_batch_and_schedule(make_engine, qwen):
    _, model = qwen
    batch = prompts([5, 12, 8], seed=7)
    seeded = [SamplingParams(temperature=2.0, max_new_tokens=8, seed=s) for s in (11, 12, 13)]
    base = make_engine(model, schedule="chunked", **SMALL).generate(batch, seeded)
    # Reversed order, with an unseeded neighbour, under mux.
    mixed = make_engine(model, schedule="mux", **SMALL).generate(
        batch[::-1] + [batch[0]], seeded[::-1] + [SamplingParams(temperature=2.0, max_new_tokens=8)])
    assert_same(mixed[:3][::-1], base)
    alone = make_engine(model, schedule="off", **SMALL).generate([batch[1]], [seeded[1]])
    assert_same(alone, base[1:2])
    other = make_engine(model, **SMALL).generate(batch, [SamplingParams(temperature=2.0, max_new_tokens=8, seed=s)
                                                        for s in (21, 22, 23)])
    assert all(o.token_ids != b.token_ids for o, b in zip(other, base))
    greedy = make_engine(model, **SMALL).generate(batch, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert any(g.token_ids != b.token_ids for g, b in zip(greedy, base))


def test_stop_tokens_end_a_request_and_are_kept(make_engine, qwen):
    _, model = qwen
    batch = prompts([7, 4], seed=8)
    full = reference(make_engine, model, batch, SamplingParams(temperature=0.0, max_new_tokens=8))
    stop = full[0].token_ids[3]
    cut = full[0].token_ids.index(stop) + 1
    engine = make_engine(model, **SMALL)
    res = engine.generate(batch, [SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop, V - 1)),
                                  SamplingParams(temperature=0.0, max_new_tokens=8)])
    assert res[0].token_ids == full[0].token_ids[:cut] and res[0].finish_reason is FinishReason.STOP
    assert res[0].logprobs == pytest.approx(full[0].logprobs[:cut], abs=1e-4)
    assert_same(res[1:], full[1:])  # its neighbour runs on
    forced = engine.generate(batch[:1], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,),
                                                       ignore_stop=True))
    assert_same(forced, full[:1])


def test_max_new_tokens_and_the_context_limit(make_engine, qwen):
    _, model = qwen
    batch = prompts([3, 10], seed=9)
    full = reference(make_engine, model, batch, SamplingParams(temperature=0.0, max_new_tokens=8))
    engine = make_engine(model, max_model_len=12, **SMALL)
    res = engine.generate(batch, [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (1, 8)])
    assert res[0].token_ids == full[0].token_ids[:1] and res[0].finish_reason is FinishReason.LENGTH
    # 10 prompt tokens in a 12-token context: 2 tokens, then the context is full.
    assert res[1].token_ids == full[1].token_ids[:2] and res[1].finish_reason is FinishReason.LENGTH


# ---------------------------------------------------------------- abort

ABORT_PARAMS = SamplingParams(temperature=0.0, max_new_tokens=5)


def _abort_case(make_engine, model, schedule, batch, victim, advance, **config):
    """Submit `batch`, step until `advance(engine, rids)` says so, abort `victim`; the others must
    finish exactly as they would alone."""
    engine = make_engine(model, schedule=schedule, **{**SMALL, **config})
    rids = [engine.add_request(p, ABORT_PARAMS) for p in batch]
    outs: dict = {}
    while not advance(engine, rids):
        for out in engine.step():
            outs[out.request_id] = out
    progress = list(engine.requests[rids[victim]].output)
    free_before = engine.pool.num_free
    engine.abort(rids[victim])
    engine.abort(rids[victim])  # twice: no-op
    engine.abort(10_000)  # unknown: no-op
    engine.check_integrity()
    drain(engine, outs)
    assert set(outs) == set(rids)
    aborted = outs[rids[victim]].result
    assert aborted.finish_reason is FinishReason.ABORT and aborted.token_ids == progress
    others = [outs[r].result for i, r in enumerate(rids) if i != victim]
    assert_same(others, reference(make_engine, model, [p for i, p in enumerate(batch) if i != victim], ABORT_PARAMS))
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.has_work()
    return engine, free_before, progress


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_abort_while_waiting(make_engine, qwen, schedule):
    _, model = qwen
    _abort_case(make_engine, model, schedule, prompts([6, 5, 7], seed=10), victim=1,
                advance=lambda e, rids: True)


def test_abort_mid_chunked_prefill(make_engine, qwen):
    _, model = qwen

    def mid_prefill(engine, rids):
        req = engine.requests[rids[0]]
        return req.stage is Stage.PREFILL and req.seq.computed > 0

    engine, _, progress = _abort_case(make_engine, model, "chunked", prompts([20, 5, 6], seed=11), victim=0,
                                      advance=mid_prefill)
    assert progress == []


def test_abort_mid_mux_epoch_parks_blocks_until_the_epoch_ends(make_engine, qwen):
    _, model = qwen
    seen = {}

    def mid_epoch(engine, rids):
        mux = engine.mux
        if mux.busy and 0 < mux.turnstile.controller.last_published and \
                any(o[0].rid == rids[1] for o in mux.epoch.owners):
            seen["blocks"] = list(engine.pool.table(engine.requests[rids[1]].seq.sid))
            return True
        return False

    engine = make_engine(model, schedule="mux", **SMALL)
    batch = prompts([5, 9, 6], seed=12)
    rids = [engine.add_request(p, ABORT_PARAMS) for p in batch]
    outs: dict = {}
    while not mid_epoch(engine, rids):
        for out in engine.step():
            outs[out.request_id] = out
    free_before = engine.pool.num_free
    engine.abort(rids[1])
    # P's forward is still writing the victim's blocks: none may be handed out before it ends.
    assert engine.pool.num_free == free_before
    assert all(engine.pool.refcount[b] > 0 for b in seen["blocks"])
    engine.check_integrity()
    epoch = engine.mux.epoch
    assert engine.mux.turnstile.controller.epoch == epoch.number  # the epoch runs on for the others
    while engine.mux.epoch is epoch:
        for out in engine.step():
            outs[out.request_id] = out
    assert not [owner for owner in engine.pool.tables if owner < 0]  # the parked blocks went back
    assert engine.mux.turnstile.controller.epoch is None
    drain(engine, outs)
    assert outs[rids[1]].result.finish_reason is FinishReason.ABORT
    assert_same([outs[rids[0]].result, outs[rids[2]].result],
                reference(make_engine, model, [batch[0], batch[2]], ABORT_PARAMS))
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_abort_while_decoding(make_engine, qwen, schedule):
    _, model = qwen
    batch = prompts([6, 5, 7], seed=13)

    def decoding(engine, rids):
        return len(engine.requests[rids[2]].output) >= 2

    _, _, progress = _abort_case(make_engine, model, schedule, batch, victim=2, advance=decoding)
    full = reference(make_engine, model, batch[2:], ABORT_PARAMS)[0]
    assert len(progress) >= 2 and progress == full.token_ids[:len(progress)]


def test_run_until_an_aborted_request_returns(make_engine, qwen):
    _, model = qwen
    engine = make_engine(model, **SMALL)
    rid = engine.add_request(prompts([4])[0], ABORT_PARAMS)
    engine.abort(rid)
    done = engine.run_until([rid])
    assert done[rid].result.finish_reason is FinishReason.ABORT


# ---------------------------------------------------------------- sessions

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_session_turns_prefill_only_new_tokens(make_engine, qwen, schedule):
    _, model = qwen
    system, tool = prompts([10, 5], seed=14)
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine = make_engine(model, schedule=schedule, **SMALL)
    session = engine.open_session()
    session.append(system)
    first = session.generate(params)
    assert engine.stats.prefill_tokens == 10
    # Another request between the turns must not disturb the session's KV.
    other = engine.generate(prompts([9], seed=15), params)
    before = engine.stats.prefill_tokens
    session.append(tool)
    rid = session.submit(params)
    out = engine.run_until([rid])[rid]
    # The new tokens and the last sampled token (whose K/V was never computed) are prefilled.
    assert out.prompt_tokens == len(tool) + 1
    assert engine.stats.prefill_tokens - before == len(tool) + 1
    context = system + first.token_ids + tool
    assert session.token_ids == context + out.result.token_ids
    assert_same([out.result], reference(make_engine, model, [context], params))
    assert_same(other, reference(make_engine, model, prompts([9], seed=15), params))
    held = len(engine.pool.table(session.sid))
    assert held == engine.pool.blocks_for(len(session.token_ids) - 1) and engine.pool.num_free == 64 - held
    session.close()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_closed_session_refuses_everything(make_engine, qwen):
    _, model = qwen
    engine = make_engine(model, **SMALL)
    session = engine.open_session()
    session.append([1, 2, 3])
    rid = session.submit(ABORT_PARAMS)
    engine.step()
    session.close()  # closing a generating session aborts its request
    assert engine.step()[0].result.finish_reason is FinishReason.ABORT and rid not in engine.requests
    session.close()  # idempotent
    for call in (lambda: session.append([4]), lambda: session.submit(), lambda: session.generate()):
        with pytest.raises(SessionClosed, match=f"session {session.sid} is closed"):
            call()
    assert engine.pool.num_free == engine.pool.num_blocks and session.sid not in engine.seqs


def test_session_rules(make_engine, qwen):
    _, model = qwen
    engine = make_engine(model, **SMALL)
    session = engine.open_session()
    with pytest.raises(RequestError, match="append tokens first"):
        session.submit()
    session.append([1, 2])
    session.submit(ABORT_PARAMS)
    with pytest.raises(RequestError, match="is generating"):
        session.append([3])
    with pytest.raises(RequestError, match="already has request"):
        session.submit(ABORT_PARAMS)
    drain(engine)
    session.append([3])  # after it finished: fine
    assert session.generate(ABORT_PARAMS).finish_reason is FinishReason.LENGTH


def test_idle_sessions_lose_their_kv_under_pressure_and_recompute_it(make_engine, qwen):
    _, model = qwen
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine = make_engine(model, block_size=4, num_blocks=8, max_batch_tokens=32)
    session = engine.open_session()
    context = prompts([14], seed=16)[0]
    session.append(context)
    first = session.generate(params)
    assert len(engine.pool.table(session.sid)) == 5
    big = engine.generate(prompts([20], seed=17), params)  # needs 6 of the 8 blocks
    assert big[0].finish_reason is FinishReason.LENGTH
    assert engine.pool.table(session.sid) == []  # evicted for it
    before = engine.stats.prefill_tokens
    second = session.generate(params)
    assert engine.stats.prefill_tokens - before == len(context) + len(first.token_ids)
    assert_same([second], reference(make_engine, model, [context + first.token_ids], params))
    session.close()


# ---------------------------------------------------------------- weights

def _perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def test_update_weights_then_generate_equals_a_fresh_engine(make_engine, qwen):
    _, base = qwen
    model = copy.deepcopy(base)
    new = _perturbed(base, seed=1)
    fresh_model = copy.deepcopy(base)
    fresh_model.load_state_dict(new)
    batch = prompts([13, 6], seed=18)
    engine = make_engine(model, **SMALL)
    before = engine.generate(batch, GREEDY)  # the prompts' blocks are now in the prefix cache
    assert all(r.weight_versions == [0] * 6 for r in before)
    engine.update_weights(new, version=1)
    assert engine.weight_version == 1
    after = engine.generate(batch, GREEDY)
    expected = make_engine(fresh_model, **SMALL).generate(batch, GREEDY)
    assert_same(after, expected)
    assert all(r.weight_versions == [1] * 6 and r.weight_version == 1 for r in after)
    assert any(a.token_ids != b.token_ids for a, b in zip(after, before))  # the update mattered


def test_stale_and_half_applied_versions_are_refused(make_engine, qwen):
    _, base = qwen
    model = copy.deepcopy(base)
    engine = make_engine(model, **SMALL)
    v1, v2 = _perturbed(base, 1), _perturbed(base, 2)
    engine.update_weights(v1, version=1)
    for stale in (1, 0):
        with pytest.raises(WeightVersionError, match=f"weight version {stale} is stale: the engine is at 1"):
            engine.update_weights(v1, version=stale)
    names = sorted(v2)
    engine.update_weights({k: v2[k] for k in names[:5]}, version=2, final=False)
    rid = engine.add_request(prompts([5])[0], GREEDY)
    for _ in range(2):
        with pytest.raises(WeightVersionError, match="version 2 is half-applied"):
            engine.step()
    with pytest.raises(WeightVersionError, match="version 2 is half-applied; got a chunk of version 3"):
        engine.update_weights({names[5]: v2[names[5]]}, version=3, final=False)
    with pytest.raises(WeightVersionError, match="leaves .* tensors unset"):
        engine.update_weights({names[5]: v2[names[5]]}, version=2, final=True)
    assert engine.weight_version == 1  # the incomplete version was dropped whole (test_weight_updates.py)
    engine.update_weights({k: v2[k] for k in names[:6]}, version=2, final=False)
    engine.update_weights({k: v2[k] for k in names[6:]}, version=2, final=True)
    out = engine.run_until([rid])[rid].result
    fresh = copy.deepcopy(base)
    fresh.load_state_dict(v2)
    assert_same([out], make_engine(fresh, **SMALL).generate(prompts([5]), GREEDY))
    assert out.weight_versions == [2] * 6
    with pytest.raises(KeyError, match="unknown weight 'nope'"):
        engine.update_weights({"nope": torch.zeros(1)}, version=3)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({names[0]: torch.zeros(1)}, version=3)
    assert engine.weight_version == 2


def test_tokens_record_the_version_they_were_sampled_under(make_engine, qwen):
    _, base = qwen
    engine = make_engine(copy.deepcopy(base), **SMALL)
    rid = engine.add_request(prompts([5])[0], SamplingParams(temperature=0.0, max_new_tokens=6))
    while len(engine.requests[rid].output) < 2:
        engine.step()
    engine.update_weights(_perturbed(base, 3), version=7)
    out = engine.run_until([rid])[rid].result
    k = out.weight_versions.count(0)
    assert k >= 2 and out.weight_versions == [0] * k + [7] * (6 - k)


# ---------------------------------------------------------------- KV release

def test_release_and_reclaim_kv(make_engine, qwen):
    _, model = qwen
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine = make_engine(model, **SMALL)
    session = engine.open_session()
    context = prompts([9], seed=19)[0]
    session.append(context)
    first = session.generate(params)
    rid = engine.add_request([1, 2, 3], params)
    with pytest.raises(RuntimeError, match="1 requests in flight"):
        engine.release_kv()
    drain(engine)
    engine.release_kv()
    assert engine.runner.cache is None and engine.pool.num_free == engine.pool.num_blocks
    assert engine.pool.table(session.sid) == [] and rid not in engine.requests
    engine.check_integrity()
    session.append([7])
    rid = session.submit(params)
    with pytest.raises(RuntimeError, match="reclaim_kv"):
        engine.step()
    engine.reclaim_kv()
    engine.reclaim_kv()  # twice: no-op
    before = engine.stats.prefill_tokens
    out = engine.run_until([rid])[rid]
    full_context = context + first.token_ids + [7]
    assert out.prompt_tokens == len(full_context)  # the whole context was recomputed
    assert engine.stats.prefill_tokens - before == len(full_context)
    assert_same([out.result], reference(make_engine, model, [full_context], params))
    session.close()


def test_update_weights_is_refused_mid_mux_epoch_and_accepted_after(make_engine, qwen):
    _, model = qwen
    engine = make_engine(model, schedule="mux", **SMALL)
    rids = [engine.add_request(p, ABORT_PARAMS) for p in prompts([9, 7], seed=3)]
    outs: dict = {}
    while not engine.mux_busy or engine.mux.turnstile.controller.last_published == 0:
        for out in engine.step():
            outs[out.request_id] = out
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightVersionError, match="mux prefill epoch is in flight"):
        engine.update_weights(state, version=1)
    assert engine.weight_version == 0
    while engine.mux_busy:
        for out in engine.step():
            outs[out.request_id] = out
    engine.update_weights(state, version=1)  # between epochs it lands
    assert engine.weight_version == 1
    drain(engine, outs)
    assert sorted(outs) == sorted(rids)
