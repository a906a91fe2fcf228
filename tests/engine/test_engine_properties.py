"""Random workloads under every schedule: nothing lost, bookkeeping sound, tokens as if unpressured.

Hypothesis draws multi-turn sessions and one-shot requests (greedy or seeded sampling: tokens do
not depend on the batch), cancellations of one-shot requests at random steps, and a KV pool from
barely enough to plenty, and checks, on every schedule (off, chunked, mux):
- every accepted request finishes (stop, length, abort) or fails with a stated reason, and none
  fails at all unless it was cancelled (KV pressure preempts, it never refuses an accepted request);
- `check_integrity()` holds after every step, and closing the sessions returns every block;
- each request that was not cancelled has the tokens of the same workload on a 256-block pool;
- meanwhile a trainer thread pushes weight updates (whole or in two chunks, some landing mid-epoch
  under mux): the same values under new version numbers, so the tokens stay comparable, while
  every request's version tags only go up and the last update lands.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rollout.engine import EngineConfig, FinishReason, RequestError, RolloutEngine, SamplingParams

BS = 4
MAX_STEPS = 3000


@dataclass(frozen=True)
class Turn:
    tokens: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Workload:
    schedule: str
    num_blocks: int
    max_batch_tokens: int
    sessions: tuple[tuple[Turn, ...], ...]
    one_shots: tuple[Turn, ...]
    cancel_at: tuple[int | None, ...]
    """Per one-shot request: the step after which it is cancelled (None: never)."""
    updates: tuple[bool, ...] = ()
    """Weight versions a trainer thread pushes while the workload runs (True: in two chunks)."""


def params() -> st.SearchStrategy[SamplingParams]:
    greedy = st.builds(SamplingParams, temperature=st.just(0.0), max_new_tokens=st.integers(1, 5),
                       ignore_stop=st.just(True))
    sampled = st.builds(SamplingParams, temperature=st.floats(0.3, 1.5), top_k=st.integers(0, 12),
                        top_p=st.floats(0.5, 1.0), max_new_tokens=st.integers(1, 5), seed=st.integers(0, 2**31),
                        ignore_stop=st.just(True))
    return st.one_of(greedy, sampled)


def turns(n: st.SearchStrategy[int]) -> st.SearchStrategy[tuple[Turn, ...]]:
    turn = st.builds(Turn, st.lists(st.integers(1, 95), min_size=1, max_size=12).map(tuple), params())
    return n.flatmap(lambda k: st.lists(turn, min_size=k, max_size=k).map(tuple))


@st.composite
def workloads(draw) -> Workload:
    one_shots = draw(turns(st.integers(0, 3)))
    sessions = tuple(draw(turns(st.integers(1, 3))) for _ in range(draw(st.integers(1, 4))))
    # Mostly tight pools (a session's three turns need up to 13 blocks), sometimes a roomy one.
    blocks = draw(st.one_of(st.integers(8, 14), st.integers(15, 40)))
    return Workload(draw(st.sampled_from(["off", "chunked", "mux"])), blocks, draw(st.integers(4, 12)), sessions,
                    one_shots,
                    tuple(draw(st.one_of(st.none(), st.integers(0, 12))) for _ in one_shots),
                    tuple(draw(st.lists(st.booleans(), max_size=4))))


Result = tuple[str, list[int], str | None, list[int]]


def push_updates(engine: RolloutEngine, chunked: tuple[bool, ...], errors: list) -> None:
    """Versions 1, 2, ... of the engine's own weights (the same values: tokens do not change)."""
    try:
        state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        names = sorted(state)
        for version, split in enumerate(chunked, start=1):
            if split:
                engine.update_weights({k: state[k] for k in names[:3]}, version, final=False)
                engine.update_weights({k: state[k] for k in names[3:]}, version)
            else:
                engine.update_weights(state, version)
    except BaseException as exc:  # noqa: BLE001 - asserted in the test's thread
        errors.append(exc)


def drive(engine: RolloutEngine, w: Workload, cancel: bool) -> dict[str, Result]:
    """Run the workload; label ("s0.1": session 0 turn 1, "o2": one-shot 2) -> (reason, tokens,
    error, weight versions). A refused submission is ("refused", [], message, []); a session stops
    at a refused turn."""
    results: dict[str, Result] = {}
    running: dict[int, str] = {}
    sessions = [engine.open_session() for _ in w.sessions]
    next_turn = [0] * len(sessions)

    def submit(label: str, fn) -> None:
        try:
            running[fn()] = label
        except RequestError as exc:
            results[label] = ("refused", [], str(exc), [])

    def next_session_turn(i: int) -> None:
        k = next_turn[i]
        if k < len(w.sessions[i]):
            next_turn[i] += 1
            turn = w.sessions[i][k]
            sessions[i].append(list(turn.tokens))
            submit(f"s{i}.{k}", lambda: sessions[i].submit(turn.params))

    for i in range(len(sessions)):
        next_session_turn(i)
    oneshot_rids = {}
    for j, turn in enumerate(w.one_shots):
        submit(f"o{j}", lambda: engine.add_request(list(turn.tokens), turn.params))
        oneshot_rids[j] = next((rid for rid, label in running.items() if label == f"o{j}"), None)
    for step in range(MAX_STEPS):
        if not running:
            break
        if cancel:
            for j, at in enumerate(w.cancel_at):
                if at == step and oneshot_rids.get(j) in running:
                    engine.abort(oneshot_rids[j])
        for out in engine.step():
            label = running.pop(out.request_id)
            r = out.result
            results[label] = (r.finish_reason.value, r.token_ids, r.error, r.weight_versions)
            if label.startswith("s"):
                next_session_turn(int(label[1:].split(".")[0]))
        engine.check_integrity()
    else:
        raise AssertionError(f"requests {sorted(running.values())} still running after {MAX_STEPS} steps")
    for s in sessions:
        s.close()
    engine.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks, "closed sessions left blocks behind"
    return results


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(w=workloads())
def test_random_workloads_lose_nothing_and_match_an_unpressured_pool(qwen, w):
    model = qwen[1]
    config = dict(schedule=w.schedule, block_size=BS, max_batch_tokens=w.max_batch_tokens, max_model_len=64)
    engine, errors = RolloutEngine(model, EngineConfig(num_blocks=w.num_blocks, **config)), []
    trainer = threading.Thread(target=push_updates, args=(engine, w.updates, errors))
    trainer.start()
    try:
        got = drive(engine, w, cancel=True)
    finally:
        trainer.join(timeout=60)
    assert not errors and engine.weight_version == len(w.updates), errors
    want = drive(RolloutEngine(model, EngineConfig(num_blocks=256, **config)), w, cancel=False)
    for label, (reason, tokens, error, versions) in got.items():
        assert versions == sorted(versions) and len(versions) == len(tokens), (label, versions)
        assert reason in ("stop", "length", "abort", "refused"), (label, reason, error)  # never "error"
        if reason == "refused":
            assert error and "KV blocks" in error, (label, error)  # too big for this pool, said so
            continue
        if reason == FinishReason.ABORT.value:
            assert label.startswith("o") and want[label][1][:len(tokens)] == tokens, label
            continue
        assert (reason, tokens) == want[label][:2], (label, got[label], want[label])
    assert {f"o{j}" for j in range(len(w.one_shots))} <= set(got)  # every one-shot answered
    for i, session in enumerate(w.sessions):  # turns run in order; only a refusal ends a session early
        done = [got[f"s{i}.{k}"][0] for k in range(len(session)) if f"s{i}.{k}" in got]
        assert len(done) == len(session) or done[-1] == "refused", (i, done)
