"""Weight updates are all-or-nothing: whatever is wrong with an update (a missing name in its final
chunk, NaN, an integer dtype, a value that is not a tensor, a bad version), the version that was
serving keeps serving, bit for bit, and the engine generates exactly what it generated before."""
from __future__ import annotations

import copy
import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from megatron_rollout.engine import (
    EngineConfig,
    KVConfig,
    MuxConfig,
    RolloutEngine,
    RunnerConfig,
    SamplingParams,
    SchedulerConfig,
)
from megatron_rollout.weights.store import WeightVersionError

from .common import replay_under_tags

SMALL = EngineConfig(scheduler=SchedulerConfig(block_size=4, max_batch_tokens=8), kv=KVConfig(num_blocks=64))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
PROMPTS = [[5, 17, 33, 2, 9], [40, 41, 3]]


def _perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _assert_serving(engine, weights: dict[str, torch.Tensor], version: int, tokens: list[list[int]]) -> None:
    """The engine holds exactly `weights` at `version` and still generates `tokens`."""
    now = engine.model.state_dict()
    changed = [k for k, v in weights.items() if not torch.equal(now[k], v)]
    assert changed == [], f"{len(changed)} tensors changed, e.g. {changed[:1]}"
    assert engine.weight_version == version
    out = engine.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in out] == tokens
    assert all(r.weight_versions == [version] * 6 for r in out)


@pytest.fixture
def served(make_engine, qwen):
    """(engine at version 1, its weights, its tokens, a valid version-2 state)."""
    _, base = qwen
    engine = make_engine(copy.deepcopy(base), SMALL)
    engine.update_weights(_perturbed(base, 1), version=1)
    return engine, _snapshot(engine), [r.token_ids for r in engine.generate(PROMPTS, GREEDY)], _perturbed(base, 2)


def test_final_chunk_missing_a_name_leaves_the_old_version_serving(served):
    engine, weights, tokens, v2 = served
    names = sorted(v2)
    engine.update_weights({k: v2[k] for k in names[:10]}, version=2, final=False)
    with pytest.raises(WeightVersionError, match=f"final chunk of version 2 leaves 1 tensors unset, e.g. {names[-1]}; "
                                                 "version 2 was dropped whole and version 1 keeps serving"):
        engine.update_weights({k: v2[k] for k in names[10:-1]}, version=2, final=True)
    _assert_serving(engine, weights, 1, tokens)
    engine.update_weights(v2, version=2)  # resent whole, it lands
    assert engine.weight_version == 2 and all(torch.equal(engine.model.state_dict()[k], v2[k]) for k in v2)


def _last(v2: dict, value) -> dict:
    """v2 with its last tensor (in iteration order) replaced: every other tensor would be copied first."""
    name = list(v2)[-1]
    return {**v2, name: value(v2[name])}


def _with_nan(t):
    t = t.clone()
    t.view(-1)[3] = float("nan")
    return t


def _with_inf(t):
    t = t.clone()
    t.view(-1)[0] = float("-inf")
    return t


@pytest.mark.parametrize("bad, error, message", [
    (lambda t: _with_nan(t), ValueError, r"weight {name} of version 2 holds NaN; refused"),
    (lambda t: _with_inf(t), ValueError, r"weight {name} of version 2 holds an infinity"),
    (lambda t: t.double() * 1e300, ValueError, r"weight {name} of version 2 holds .*beyond torch.float32's range"),
    (lambda t: t.long(), TypeError, r"weight {name}: dtype torch.int64 is refused \(not cast\)"),
    (lambda t: t > 0, TypeError, r"weight {name}: dtype torch.bool is refused"),
    (lambda t: t.numpy(), TypeError, r"weight {name}: expected a torch.Tensor, got ndarray"),
    (lambda t: t.tolist(), TypeError, r"weight {name}: expected a torch.Tensor, got list"),
    (lambda t: t[:-1], ValueError, r"weight {name}: shape"),
])
def test_a_bad_tensor_refuses_the_whole_update(served, bad, error, message):
    engine, weights, tokens, v2 = served
    name = list(v2)[-1]
    with pytest.raises(error, match=message.format(name=name.replace(".", r"\."))):
        engine.update_weights(_last(v2, bad), version=2)
    _assert_serving(engine, weights, 1, tokens)


def test_a_bad_chunk_drops_its_pending_version(served):
    engine, weights, tokens, v2 = served
    names = list(v2)
    engine.update_weights({k: v2[k] for k in names[:4]}, version=2, final=False)
    with pytest.raises(ValueError, match="holds NaN"):
        engine.update_weights({names[4]: _with_nan(v2[names[4]])}, version=2, final=False)
    _assert_serving(engine, weights, 1, tokens)  # not stuck half-applied: stepping works
    with pytest.raises(ValueError, match=f"weight {names[0]} of version 3 arrived twice in one chunk"):
        engine.update_weights([(names[0], v2[names[0]]), (names[0], v2[names[0]])], version=3)
    engine.update_weights({k: v2[k] for k in names[:4]}, version=3, final=False)
    with pytest.raises(ValueError, match="arrived again: an earlier chunk of this version had it"):
        engine.update_weights({names[0]: v2[names[0]]}, version=3, final=False)
    _assert_serving(engine, weights, 1, tokens)


@pytest.mark.parametrize("version, message", [
    (True, r"weight version must be an integer, got True \(bool\)"),
    (2.0, r"weight version must be an integer, got 2.0 \(float\)"),
    (2.5, r"weight version must be an integer, got 2.5 \(float\)"),
    ("2", r"weight version must be an integer, got '2' \(str\)"),
    (None, r"weight version must be an integer, got None"),
    (1, "weight version 1 is stale: the engine is at 1"),
    (-4, "weight version -4 is stale"),
])
def test_versions_are_strictly_increasing_integers(served, version, message):
    engine, weights, tokens, v2 = served
    with pytest.raises(WeightVersionError, match=message):
        engine.update_weights(v2, version=version)
    with pytest.raises(WeightVersionError, match=message):
        engine.weights.bind(dict(engine.model.named_parameters()), version)
    _assert_serving(engine, weights, 1, tokens)


def test_numpy_integer_version_and_float_dtypes_are_accepted(served):
    engine, _, _, v2 = served
    half = {k: v.bfloat16() for k, v in v2.items()}
    engine.update_weights(half, version=np.int64(2))
    assert engine.weight_version == 2 and type(engine.weight_version) is int
    assert all(torch.equal(engine.model.state_dict()[k], v.float()) for k, v in half.items())
    engine.update_weights({k: v.double() for k, v in v2.items()}, version=3)
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in v2.items())


def test_a_whole_update_copies_in_place_and_chunks_are_staged_as_copies(served):
    engine, _, _, v2 = served
    pointers = {k: p.data_ptr() for k, p in engine.model.named_parameters()}
    engine.update_weights(v2, version=2)
    assert not engine.weights._staged  # sent whole: nothing staged
    assert {k: p.data_ptr() for k, p in engine.model.named_parameters()} == pointers  # graphs stay valid
    # A trainer that reuses one buffer per chunk: what was sent is what lands.
    v3, names = _perturbed(engine.model, 3), sorted(v2)
    buffer = {k: v3[k].clone() for k in names[:6]}
    engine.update_weights(buffer, version=3, final=False)
    for t in buffer.values():
        t.zero_()
    engine.update_weights({k: v3[k] for k in names[6:]}, version=3, final=True)
    assert all(torch.equal(engine.model.state_dict()[k], v3[k]) for k in names)
    assert {k: p.data_ptr() for k, p in engine.model.named_parameters()} == pointers


def test_an_update_with_the_engines_own_tensors_copies_and_checks_nothing(served):
    """An engine sharing a trainer's storage is sent the trainer's tensors, its own parameters: they
    serve already, so only the version moves (no copy, no value check); any other tensor is checked."""
    engine, weights, tokens, v2 = served
    own = dict(engine.model.named_parameters())
    prepared = engine.weights.prepare(own, 2)
    assert prepared.error is None and [t.param for t in prepared.incoming] == [None] * len(own)
    mixed = dict(own, **{"decoder.final_layernorm.weight": v2["decoder.final_layernorm.weight"]})
    checked = [t.name for t in engine.weights.prepare(mixed, 2).incoming if t.param is not None]
    assert checked == ["decoder.final_layernorm.weight"]
    engine.update_weights(own, version=2)
    _assert_serving(engine, weights, 2, tokens)
    with torch.no_grad():
        own["decoder.final_layernorm.weight"][0] = float("nan")  # a clone holding it is checked, and refused
    with pytest.raises(ValueError, match="final_layernorm.weight of version 3 holds NaN"):
        engine.update_weights({k: v.detach().clone() for k, v in own.items()}, version=3)


def test_updates_that_are_not_tensors_name_what_is_wrong(served):
    engine, weights, tokens, v2 = served
    with pytest.raises(TypeError, match="takes a mapping or \\(name, tensor\\) pairs, got Tensor"):
        engine.update_weights(torch.zeros(3), version=2)
    with pytest.raises(TypeError, match="takes \\(name, tensor\\) pairs, got"):
        engine.update_weights(["embedding.word_embeddings.weight"], version=2)
    with pytest.raises(KeyError, match="unknown weight 7"):
        engine.update_weights({7: torch.zeros(1)}, version=2)
    with pytest.raises(TypeError, match="cannot bind .*: expected a torch.Tensor, got list"):
        engine.weights.bind({k: p.tolist() for k, p in engine.model.named_parameters()}, 2)
    nan = {k: _with_nan(p.detach()) for k, p in engine.model.named_parameters()}
    with pytest.raises(ValueError, match="holds NaN"):
        engine.weights.bind(nan, 2)
    _assert_serving(engine, weights, 1, tokens)


@pytest.mark.parametrize("block", [None, 16])
def test_fp8_weights_follow_a_weight_update_in_place(make_engine, qwen, block):
    """An FP8 engine re-rounds its FP8 weights from every update, in the same storage (graphs
    captured on them stay valid), and then generates what a model quantised from the new weights
    generates."""
    from megatron_rollout.model import fp8

    _, base = qwen
    engine = make_engine(copy.deepcopy(base), SMALL)
    fp8.quantize_model_fp8(engine.model, block=block)
    ptrs = {n: (m.fp8.data.data_ptr(), m.fp8.scale.data_ptr()) for n, m in engine.model.named_modules()
            if getattr(m, "fp8", None) is not None}
    new = _perturbed(base, 3)
    engine.update_weights(new, version=1)
    assert {n: (m.fp8.data.data_ptr(), m.fp8.scale.data_ptr()) for n, m in engine.model.named_modules()
            if getattr(m, "fp8", None) is not None} == ptrs
    fresh = copy.deepcopy(base)
    fresh.load_state_dict(new)
    fp8.quantize_model_fp8(fresh, block=block)
    for name, m in fresh.named_modules():
        if getattr(m, "fp8", None) is not None:
            assert torch.equal(engine.model.get_submodule(name).fp8.dequantize(), m.fp8.dequantize()), name
    expected = [r.token_ids for r in make_engine(fresh, SMALL).generate(PROMPTS, GREEDY)]
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == expected


def test_an_fp8_engine_quantises_its_model_once_and_generates(make_engine, qwen):
    """`RunnerConfig(fp8="block")`: every matching linear and the experts hold FP8 weights (the
    experts stacked), and the engine generates what an engine on a model quantised by hand does."""
    from megatron_rollout.model import fp8
    from megatron_rollout.model.layers import Experts

    _, base = qwen
    engine = make_engine(copy.deepcopy(base), dataclasses.replace(SMALL, runner=RunnerConfig(fp8="block")))
    experts = [m for m in engine.model.modules() if isinstance(m, Experts)]
    assert experts and all(fp8.stacked_experts_fp8(m) is not None for m in experts)
    assert all(s.block == 128 for m in experts for s in fp8.stacked_experts_fp8(m))
    by_hand = copy.deepcopy(base)
    fp8.quantize_model_fp8(by_hand, block=128)
    expected = [r.token_ids for r in make_engine(by_hand, SMALL).generate(PROMPTS, GREEDY)]
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == expected
    assert engine.model.decoder.layers[0].self_attention.linear_qkv.fp8 is not None


# -- a trainer thread updating while another thread generates --------------------------------------
THREADED = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_stop=True)


@pytest.mark.parametrize("schedule", ["off", "chunked", "mux"])
def test_a_trainer_thread_updating_mid_generation_never_mixes_weights(qwen, schedule):
    """A trainer thread pushes new weights (some in two chunks) as fast as the engine lets it while
    the main thread generates: every token equals what its tagged version gives at its position
    (each step replayed under the version its token says), so no forward saw half-copied weights and
    no tag is wrong; versions never go back within a request, and every update landed."""
    _, base = qwen
    model = copy.deepcopy(base)
    states = {0: {k: v.clone() for k, v in base.state_dict().items()}}
    states.update({v: _perturbed(base, 100 + v) for v in range(1, 25)})
    engine = RolloutEngine(model, EngineConfig(scheduler=SchedulerConfig(schedule, block_size=4, max_batch_tokens=64),
                                               kv=KVConfig(num_blocks=96), mux=MuxConfig(span="fixed:1")))
    batch = [[1 + (7 * i + j) % 90 for j in range(3 + i % 5)] for i in range(18)]
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            for v in range(1, 25):
                names = list(states[v])
                if v % 3 == 0:  # in two chunks: the first staged while the engine keeps serving
                    engine.update_weights({k: states[v][k] for k in names[:5]}, version=v, final=False)
                    engine.update_weights({k: states[v][k] for k in names[5:]}, version=v, final=True)
                else:
                    engine.update_weights(states[v], version=v)
                time.sleep(0.003)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=trainer)
    rids: dict[int, list[int]] = {}
    outs: dict[int, object] = {}
    thread.start()
    try:
        queued = list(batch)
        while queued or len(outs) < len(rids):
            while queued and len(rids) - len(outs) < 6:  # keep six requests in flight
                prompt = queued.pop(0)
                rids[engine.add_request(prompt, THREADED)] = prompt
            for out in engine.step():
                outs[out.request_id] = out
    finally:
        thread.join(timeout=120)
    assert not errors, errors
    assert engine.weight_version == 24
    tags = {rid: outs[rid].result.weight_versions for rid in rids}
    assert all(t == sorted(t) and len(t) == 8 for t in tags.values()), tags
    assert len({v for t in tags.values() for v in t}) > 3, tags  # the updates really ran mid-generation
    reference = copy.deepcopy(base)
    for rid, prompt in rids.items():
        assert outs[rid].result.token_ids == replay_under_tags(reference, states, prompt, tags[rid]), (rid, tags[rid])


def test_kv_of_a_prefill_split_by_an_update_is_never_reused(make_engine, qwen):
    """A prompt prefilled in two chunks with an update between them has K/V of two versions: its
    blocks are not cached under the new version, so the same prompt sent again under it computes
    its own K/V and generates what the new weights alone generate."""
    _, base = qwen
    engine = make_engine(copy.deepcopy(base), SMALL)  # chunked: SchedulerConfig's default
    v1 = _perturbed(base, 1)
    prompt = [(5 * i) % 90 + 1 for i in range(14)]  # two chunks of at most 8 tokens
    rid = engine.add_request(prompt, GREEDY)
    engine.step()
    assert engine.requests[rid].seq.computed == 8 and not engine.requests[rid].output  # half-way through
    engine.update_weights(v1, version=1)
    first = engine.run_until([rid])[rid].result
    assert first.weight_versions == [1] * 6
    again = engine.generate([prompt], GREEDY)[0]
    fresh = copy.deepcopy(base)
    fresh.load_state_dict(v1)
    assert again.token_ids == make_engine(fresh, SMALL).generate([prompt], GREEDY)[0].token_ids
