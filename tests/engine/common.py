"""Helpers shared by the engine tests (prompts, the transformers reference, draining, comparisons)."""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.engine import EngineConfig, FinishReason, RolloutEngine, SamplingParams

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


ABORT_PARAMS = SamplingParams(temperature=0.0, max_new_tokens=5)


def abort_case(make_engine, model, schedule, batch, victim, advance, **config):
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


def replay_under_tags(model, states: dict[int, dict], prompt: list[int], versions: list[int]) -> list[int]:
    """The tokens one request gets when each of its steps runs under the weights its tag names:
    version `versions[0]` for the prefill (the whole prompt), `versions[j]` for the step that
    samples token j (which also computes token j-1's K/V). Updates land between steps."""
    model.load_state_dict(states[versions[0]])
    engine = RolloutEngine(model, EngineConfig(block_size=4, num_blocks=16))
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=len(versions), ignore_stop=True))
    label, current, finished = 0, versions[0], []
    for v in versions:  # one token per step: the prefill's, then one decode token each
        if v != current:
            label, current = label + 1, v
            engine.update_weights(states[v], version=label)
        finished += [out.result for out in engine.step() if out.request_id == rid]
    assert len(finished) == 1, "the replay must end with the request's last tagged step"
    return finished[0].token_ids
