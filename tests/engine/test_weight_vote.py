"""A weight update is one decision of every rank: all ranks apply it at the same step, or none does.

The verdict rule alone, then real gloo worlds of 2 (ATP 2: the ranks hold different halves of
every attention weight) and 4 (ATP 2 x ADP 2) processes: one rank refusing its update, ranks given
different versions, one rank sending a non-final chunk where the others send the final one, a
rank that never takes part, and trainer threads updating every rank while the main threads
generate (each token checked by replaying its steps under the versions its tags name).
"""
from __future__ import annotations

import threading

import pytest
import torch

from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams, SchedulerConfig
from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.weights.vote import Decision, Verdict, WeightOffer, decide, waiting_for
from tests.world import run_world

CFG = preset("tiny-moe")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [9] * 7, [200, 100]]
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=5)


def _offer(version, chunk=0, final=True, refusal=None) -> WeightOffer:
    return WeightOffer(version, chunk, final, refusal)


def test_the_verdict_is_unanimous_or_a_refusal() -> None:
    assert decide([_offer(2), None], epoch_in_flight=False) is None  # rank 1 has not offered yet
    assert waiting_for([_offer(2), None, None]) == [1, 2]
    assert decide([_offer(2), _offer(2)], False) == Decision(Verdict.APPLY, "")
    assert decide([_offer(2), _offer(2)], True) is None  # a mux epoch finishes first
    assert decide([_offer(2, final=False)] * 2, True) == Decision(Verdict.STAGE, "")  # staging changes nothing served
    refused = decide([_offer(2), _offer(2, refusal="ValueError: NaN")], False)
    assert refused == Decision(Verdict.REFUSE, "rank 1 refused version 2 (final chunk 0): ValueError: NaN")
    skew = decide([_offer(2), _offer(3)], False)
    assert skew.verdict is Verdict.REFUSE and "rank 0: version 2 (final chunk 0), rank 1: version 3" in skew.reason
    chunk = decide([_offer(2), _offer(2, final=False)], False)
    assert chunk.verdict is Verdict.REFUSE and "rank 1: version 2 (non-final chunk 0)" in chunk.reason
    assert decide([_offer(2, chunk=1), _offer(2)], False).verdict is Verdict.REFUSE


def _states(*seeds: int) -> list[dict[str, torch.Tensor]]:
    return [MoETransformer(CFG).init_weights(seed=s).state_dict() for s in seeds]


def _reference(seed: int) -> list[list[int]]:
    engine = RolloutEngine(MoETransformer(CFG).init_weights(seed=seed),
                           EngineConfig(scheduler=SchedulerConfig(block_size=4)))
    return [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]


def _nan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = "decoder.layers.0.self_attention.linear_qkv.weight"  # split over ATP ranks
    bad = state[name].clone()
    bad[-1, 0] = float("nan")  # in the last ATP rank's rows
    return {**state, name: bad}


def _votes(rank: int, atp: int, adp: int, silent_rank: bool) -> dict:
    """Every case on one world; returns what each rank saw."""
    from megatron_rollout.distributed import Runtime

    n = atp * adp
    runtime = Runtime.start(atp, adp, "cpu", timeout_s=15)
    model = MoETransformer(CFG, comm=runtime.comm).init_weights(seed=3)
    engine = runtime.engine(model, EngineConfig(scheduler=SchedulerConfig(schedule="chunked", block_size=4)))
    v1, v2 = _states(4, 5)
    names = list(v2)
    out: dict = {}

    def attempt(case: str, *calls: tuple) -> None:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            for named, version, final in calls:
                engine.update_weights(named, version, final=final)
            out[case] = "applied"
        except Exception as exc:  # noqa: BLE001 - the error text is the assertion
            out[case] = f"{type(exc).__name__}: {exc}"
        now = model.state_dict()
        out[case + "/state"] = (engine.weight_version, engine.weights.pending,
                                all(torch.equal(now[k], before[k]) for k in now))

    attempt("v1", (v1, 1, True))
    attempt("nan on the last rank", (_nan(v2) if rank == n - 1 else v2, 2, True))
    attempt("version skew", (v2, 2 if rank == 0 else 3, True))
    attempt("non-final on one rank", ({k: v2[k] for k in names[:4]}, 2, False) if rank == n - 1 else (v2, 2, True))
    attempt("staged, then skew", ({k: v2[k] for k in names[:4]}, 2, False),
            ({k: v2[k] for k in names[4:]}, 2 if rank else 3, True))
    results = runtime.generate(engine, PROMPTS, PARAMS)
    out["v1 tokens"] = None if results is None else [r.token_ids for r in results]
    out["v1 tags"] = None if results is None else {v for r in results for v in r.weight_versions}
    attempt("v2 in two chunks", ({k: v2[k] for k in names[:4]}, 2, False), ({k: v2[k] for k in names[4:]}, 2, True))
    results = runtime.generate(engine, PROMPTS, PARAMS)
    out["v2 tokens"] = None if results is None else [r.token_ids for r in results]
    engine.sleep(tags=["kv"])  # as an RL loop does while its trainer steps: the vote needs no KV
    attempt("v3 with KV released", (v1, 3, True))
    engine.wake_up(tags=["kv"])
    if silent_rank:  # the last case: a failed gather poisons the communicator
        engine.done = False  # this rank's driver is not done: its peers keep stepping with it
        if rank == 0:
            attempt("a rank that never offers", (v2, 4, True))
        runtime.drain(engine)
    return out


def _check(got: list[dict], n: int) -> None:
    for rank, seen in enumerate(got):
        assert seen["v1"] == "applied" and seen["v1/state"][:2] == (1, None), (rank, seen["v1"])
        for case in ("nan on the last rank", "version skew", "non-final on one rank", "staged, then skew"):
            assert seen[case + "/state"] == (1, None, True), (rank, case, seen[case + "/state"])  # nothing anywhere
        nan = seen["nan on the last rank"]
        if rank == n - 1:  # its own error, as on one rank
            assert nan.startswith("ValueError: weight decoder.layers.0.self_attention.linear_qkv.weight of version 2 "
                                  "holds NaN"), nan
        else:
            assert nan.startswith(f"WeightVersionError: weight update refused on every rank: rank {n - 1} refused "
                                  f"version 2 (final chunk 0): ValueError: weight decoder.layers.0"), nan
            assert nan.endswith("version 1 keeps serving on every rank (and nothing staged is kept): send it again")
        skew = seen["version skew"]
        assert "the ranks were given different updates (rank 0: version 2 (final chunk 0), rank 1: version 3" in skew
        chunk = seen["non-final on one rank"]
        assert f"rank {n - 1}: version 2 (non-final chunk 0)" in chunk and "rank 0: version 2 (final chunk 0)" in chunk
        staged = seen["staged, then skew"]  # rank 0 refuses a version 3 while 2 is staged: every rank drops 2
        assert ("WeightVersionError: version 2 is half-applied; got a chunk of version 3" if rank == 0 else
                "rank 0 refused version 3 (final chunk 0): WeightVersionError: version 2 is half-applied") in staged
        assert seen["v2 in two chunks"] == "applied" and seen["v2 in two chunks/state"][:2] == (2, None)
        assert seen["v3 with KV released"] == "applied" and seen["v3 with KV released/state"][:2] == (3, None)
    assert got[0]["v1 tokens"] == _reference(4) and got[0]["v1 tags"] == {1}
    assert got[0]["v2 tokens"] == _reference(5) != got[0]["v1 tokens"]


def test_two_atp_ranks_apply_together_or_not_at_all() -> None:
    got = run_world(_votes, 2, 2, 1, True, timeout=240)
    _check(got, 2)
    silent = got[0]["a rank that never offers"]
    assert silent.startswith("WeightVoteTimeout: weight update to version 4 (final chunk 0) on rank 0: rank(s) [1] "
                             "did not offer their part within 15s"), silent
    assert got[0]["a rank that never offers/state"] == (3, None, True)


def test_four_ranks_apply_together_or_not_at_all() -> None:
    _check(run_world(_votes, 4, 2, 2, False, timeout=240), 4)


def _threads(rank: int, n: int) -> dict:
    """A trainer thread per rank pushes versions 1..6 (the odd ones in two chunks) while the main
    thread generates; the main thread keeps stepping until its trainer is done."""
    from megatron_rollout.distributed import Runtime

    runtime = Runtime.start(n, 1, "cpu", timeout_s=30)
    model = MoETransformer(CFG, comm=runtime.comm).init_weights(seed=3)
    engine = runtime.engine(model, EngineConfig(scheduler=SchedulerConfig(schedule="chunked", block_size=4,
                                                                          max_batch_tokens=64)))
    states = dict(enumerate(_states(3, 4, 5, 6, 7, 8, 9)))
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            for v in range(1, 7):
                names = list(states[v])
                if v % 2:
                    engine.update_weights({k: states[v][k] for k in names[:6]}, v, final=False)
                    engine.update_weights({k: states[v][k] for k in names[6:]}, v)
                else:
                    engine.update_weights(states[v], v)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=trainer)
    thread.start()
    long = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_stop=True)
    rids = [engine.add_request(p, long) for p in PROMPTS] if runtime.leader else []
    outs = {}
    while thread.is_alive() or engine.has_work():
        outs.update((o.request_id, o.result) for o in engine.step())
    outs.update((o.request_id, o.result) for o in runtime.drain(engine))
    thread.join()
    return {"errors": [repr(e) for e in errors], "version": engine.weight_version,
            "results": [(p, outs[r].token_ids, outs[r].weight_versions) for p, r in zip(PROMPTS, rids)]}


def test_trainer_threads_on_two_ranks_never_mix_weights() -> None:
    from tests.engine.common import replay_under_tags

    got = run_world(_threads, 2, 2, timeout=300)
    assert [g["errors"] for g in got] == [[], []] and [g["version"] for g in got] == [6, 6]
    states = dict(enumerate(_states(3, 4, 5, 6, 7, 8, 9)))
    model = MoETransformer(CFG)
    for prompt, tokens, tags in got[0]["results"]:
        assert tags == sorted(tags) and len(tokens) == 12, tags
        assert tokens == replay_under_tags(model, states, prompt, tags), (prompt, tags)
    assert len({v for _, _, tags in got[0]["results"] for v in tags}) > 1  # updates landed mid-generation


@pytest.mark.parametrize("bad, error, message", [
    (lambda t: t.to_sparse(), TypeError, "layout torch.sparse_coo is refused; send a dense tensor"),
    (lambda t: torch.empty_like(t, device="meta"), ValueError, "a meta tensor holds no values"),
])
def test_sparse_and_meta_tensors_are_refused_by_name(bad, error, message) -> None:
    model = MoETransformer(CFG).init_weights(seed=3)
    engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(block_size=4)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    with pytest.raises(error, match=f"weight {name}: {message}"):
        engine.update_weights({**state, name: bad(state[name])}, version=1)
    with pytest.raises(error, match=f"cannot bind {name}: {message}"):
        engine.weights.bind({**{k: p.detach() for k, p in model.named_parameters()}, name: bad(state[name])}, 1)
    assert engine.weight_version == 0 and all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
