"""Memory handed back between rollouts (`engine/memory.py`): `sleep(tags)` and `wake_up(tags)`.

CPU: the tags and their errors, the refusals (requests in flight, work while asleep, a weight
update into offloaded weights), idempotent calls, KV freed and sessions recomputed, weights
offloaded (every storage emptied) and restored bit for bit, an engine over shared tensors left
alone, graphs following the KV and the weights, and greedy tokens unchanged across a sleep under
every schedule. GPU: the CUDA runner's graphs released and captured again, device bytes measured.
"""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

from megatron_rollout.engine import EngineAsleep, FinishReason, RunnerConfig, SamplingParams
from megatron_rollout.engine.memory import Tag, parse_tags
from megatron_rollout.weights.offload import HostBytes, StableWeights, WeightOffload, stable_holders

from .common import GREEDY, SCHEDULES, SMALL, assert_same, drain, prompts, reference, small

BATCH = prompts([5, 9, 3, 12], seed=7)


@pytest.fixture
def model(qwen):
    """A copy of the session's model: these tests move and change its weights."""
    return copy.deepcopy(qwen[1])


def _storage_bytes(model: torch.nn.Module) -> int:
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())


def test_tags_parse_by_name_and_refuse_unknown_ones():
    assert parse_tags(None) == set(Tag)
    assert parse_tags("kv") == {Tag.KV}  # one name, not its letters
    assert parse_tags(["weights", "graphs"]) == {Tag.WEIGHTS, Tag.GRAPHS}
    with pytest.raises(ValueError, match=r"unknown memory tag 'kv_cache': the tags are \['kv', 'graphs', 'weights'\]"):
        parse_tags(["kv_cache"])
    with pytest.raises(ValueError, match="no memory tags given"):
        parse_tags([])


def test_sleep_is_refused_with_requests_in_flight(make_engine, model):
    engine = make_engine(model, SMALL)
    rid = engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="cannot sleep with 1 requests in flight"):
        engine.sleep()
    assert engine.asleep == frozenset() and engine.runner.cache is not None
    engine.run_until([rid])
    assert engine.sleep()["asleep"] == ["graphs", "kv", "weights"]
    engine.wake_up()


@pytest.mark.parametrize("tag", ["kv", "graphs", "weights"])
def test_work_is_refused_while_any_tag_sleeps(make_engine, model, tag):
    engine = make_engine(model, SMALL)
    engine.sleep(tags=[tag])
    with pytest.raises(EngineAsleep, match=rf"engine is asleep \(.*{tag}.*\): call engine.wake_up\(\) before adding"):
        engine.generate(BATCH, GREEDY)
    assert not engine.requests  # nothing was admitted
    session = engine.open_session()  # no memory needed to open one and append to it
    session.append([4, 5, 6])
    rid = session.submit(GREEDY)
    with pytest.raises(EngineAsleep, match="before generating"):
        engine.step()
    engine.wake_up()
    assert engine.run_until([rid])[rid].result.finish_reason is FinishReason.LENGTH


def test_calls_are_idempotent(make_engine, model):
    engine = make_engine(model, SMALL)
    first = engine.sleep(tags=["kv"])
    assert first["tags"]["kv"]["changed"] and first["tags"]["graphs"]["changed"]  # graphs follow the KV
    again = engine.sleep(tags=["kv"])
    assert {t: r["changed"] for t, r in again["tags"].items()} == {"kv": False, "graphs": False}
    assert again["tags"]["kv"]["note"] == "already asleep" and again["tensor_bytes"] == 0
    woke = engine.wake_up()
    assert {t: r["changed"] for t, r in woke["tags"].items()} == {"weights": False, "kv": True, "graphs": True}
    assert woke["tags"]["weights"]["note"] == "already awake"
    assert not any(r["changed"] for r in engine.wake_up()["tags"].values())
    assert engine.asleep == frozenset()


def test_kv_sleep_frees_the_cache_and_sessions_recompute(make_engine, model):
    engine = make_engine(model, SMALL)
    session = engine.open_session()
    context = prompts([9], seed=19)[0]
    session.append(context)
    first = session.generate(GREEDY)
    cache = engine.runner.cache
    kv_bytes = cache.k.nbytes + cache.v.nbytes
    report = engine.sleep(tags="kv")
    assert report["tags"]["kv"]["tensor_bytes"] == kv_bytes and report["tensor_bytes"] == kv_bytes
    assert report["tags"]["kv"]["allocated_bytes"] is None  # measured on CUDA only
    assert engine.runner.cache is None and engine.pool.num_free == engine.pool.num_blocks
    assert engine.pool.table(session.sid) == []
    engine.check_integrity()
    assert engine.wake_up(tags="kv")["tags"]["kv"]["tensor_bytes"] == kv_bytes
    session.append([7])
    before = engine.stats.prefill_tokens
    out = next(iter(engine.run_until([session.submit(GREEDY)]).values()))
    full_context = context + first.token_ids + [7]
    assert out.prompt_tokens == len(full_context)
    assert engine.stats.prefill_tokens - before == len(full_context)  # the whole context was recomputed
    assert_same([out.result], reference(make_engine, model, [full_context], GREEDY))


def test_weights_go_to_the_host_and_come_back_bit_for_bit(make_engine, model):
    engine = make_engine(model, SMALL)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    nbytes = _storage_bytes(model)
    report = engine.sleep(tags=["weights"])
    assert report["tags"]["weights"]["tensor_bytes"] == nbytes > 0
    assert "graphs" in report["tags"] and engine.asleep == {"weights", "graphs"}
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())  # freed, not copied beside
    with pytest.raises(EngineAsleep, match=r"wake_up\(tags=\['weights'\]\) before update_weights"):
        engine.update_weights(saved, version=1)
    assert engine.wake_up(tags=["weights"])["tags"]["weights"]["tensor_bytes"] == nbytes
    assert engine.asleep == frozenset()  # the KV never slept: graphs came back with the weights
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert all(p.data_ptr() != 0 for p in model.parameters())


def test_offload_keeps_views_shared_and_spans_host_chunks(monkeypatch):
    monkeypatch.setattr(HostBytes, "CHUNK", 7)  # 7-byte chunks: every storage is split across several
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    with torch.no_grad():
        model[1].weight.data = model[0].weight.data[1:]  # a view, as stacked experts are: one storage
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    offload = WeightOffload(model)
    assert offload.offload() == (15 + 3 + 2) * 4  # the shared storage once
    assert len(offload._host.chunks) == 12 and offload._host.chunks[-1].numel() == 80 - 11 * 7
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert offload.restore() == 80 and offload.restore() == 0  # twice: nothing held the second time
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    assert model[1].weight.untyped_storage().data_ptr() == model[0].weight.untyped_storage().data_ptr()
    with torch.no_grad():
        model[0].weight[2, 0] = 42.0  # still a view after the round trip
    assert model[1].weight[1, 0] == 42.0


def test_weights_update_between_waking_the_weights_and_the_kv(make_engine, model):
    """The RL order: sleep everything, train, wake the weights, update them, wake the KV."""
    engine = make_engine(model, SMALL)
    new = {k: v * 1.01 for k, v in model.state_dict().items()}
    reference = make_engine(copy.deepcopy(model), SMALL)
    engine.sleep()
    engine.wake_up(tags=["weights"])
    assert engine.asleep == {"kv", "graphs"}
    engine.update_weights(new, version=1)  # a vote's step runs no forward: the KV may sleep
    engine.wake_up(tags=["kv"])
    assert engine.asleep == frozenset()
    got = engine.generate(BATCH, GREEDY)
    reference.update_weights(new, version=1)
    want = reference.generate(BATCH, GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert {v for r in got for v in r.weight_versions} == {1}


def test_graphs_follow_the_kv_and_the_weights(make_engine, model):
    engine = make_engine(model, SMALL)
    engine.sleep(tags=["kv"])
    assert engine.asleep == {"kv", "graphs"}
    with pytest.raises(ValueError, match=r"\['kv'\] stay asleep"):
        engine.wake_up(tags=["graphs"])
    engine.sleep(tags=["weights"])
    engine.wake_up(tags=["kv"])
    assert engine.asleep == {"weights", "graphs"}  # the weights still sleep: no graph over them yet
    report = engine.wake_up(tags=["weights"])
    assert report["tags"]["graphs"]["changed"] and "with weights" in report["tags"]["graphs"]["note"]
    assert engine.asleep == frozenset()
    engine.sleep(tags=["graphs"])  # alone: the KV and the weights stay
    assert engine.asleep == {"graphs"} and engine.runner.cache is not None
    engine.wake_up(tags=["graphs"])
    assert engine.asleep == frozenset()


def test_an_engine_over_shared_tensors_offloads_nothing(make_engine, model):
    engine = make_engine(type(model)(model.cfg), SMALL)
    trainer = {k: v.clone() for k, v in model.named_parameters()}
    engine.weights.bind(trainer, version=1)
    report = engine.sleep(tags=["weights"])
    weights = report["tags"]["weights"]
    assert not weights["changed"] and weights["tensor_bytes"] == 0 and "shared storage" in weights["note"]
    assert engine.asleep == frozenset() and "graphs" not in report["tags"]
    assert all(t.untyped_storage().nbytes() > 0 for t in trainer.values())  # the trainer's tensors untouched
    assert [r.token_ids for r in engine.generate(BATCH, GREEDY)] == \
        [r.token_ids for r in make_engine(model, SMALL).generate(BATCH, GREEDY)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_greedy_tokens_are_the_same_after_a_sleep(make_engine, model, schedule):
    engine = make_engine(model, small(schedule))
    before = engine.generate(BATCH, GREEDY)
    session = engine.open_session()
    session.append(BATCH[1])
    turn = session.generate(GREEDY)
    report = engine.sleep()
    assert report["asleep"] == ["graphs", "kv", "weights"] and report["tensor_bytes"] > 0
    engine.wake_up()
    after = engine.generate(BATCH, GREEDY)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    assert [r.logprobs for r in after] == [r.logprobs for r in before]  # the same weights, bit for bit
    session.append([3, 4])
    again = session.generate(GREEDY)  # its KV was recomputed after the wake
    engine2 = make_engine(model, small(schedule))
    ref = engine2.open_session()
    ref.append(BATCH[1])
    assert ref.generate(GREEDY).token_ids == turn.token_ids
    ref.append([3, 4])
    assert again.token_ids == ref.generate(GREEDY).token_ids
    drain(engine)


class HostBuffer:
    """A `StableBuffer` stand-in on the host: `release` scribbles over the bytes (memory the device
    gave back reads as anything), `restore` zero-fills them; the address never changes."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.mapped, self.releases = True, 0

    def release(self) -> int:
        self.tensor.fill_(0xAB)
        self.mapped, self.releases = False, self.releases + 1
        return self.tensor.numel()

    def restore(self) -> int:
        self.tensor.zero_()
        self.mapped = True
        return self.tensor.numel()


def _restacked(model: torch.nn.Module) -> list:
    experts = [m for m in model.modules() if hasattr(m, "restack")]
    for m in experts:
        m.restack()  # as the CUDA runner does: expert weights become views of one stacked tensor
    return experts


def _inside(t: torch.Tensor, buffer: HostBuffer) -> bool:
    start = buffer.tensor.data_ptr()
    return start <= t.data_ptr() < start + buffer.tensor.numel()


def test_stable_weights_move_once_then_keep_their_addresses(model):
    experts = _restacked(model)
    assert experts
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    weights = StableWeights(model, HostBuffer)
    nbytes = weights.offload()  # the move: storages to the host, freed, re-pointed into the buffer
    buffer = weights.buffer
    assert weights.moved and not buffer.mapped and nbytes == buffer.tensor.numel() >= _storage_bytes(model)
    assert all(_inside(t, buffer) for t in itertools.chain(model.parameters(), model.buffers()))
    assert weights.offload() == 0  # offloaded already
    assert weights.restore() == nbytes and weights.restore() == 0
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    addresses = [p.data_ptr() for p in model.parameters()]
    for _ in range(2):
        weights.offload()
        assert buffer.releases >= 2 and not any(torch.equal(saved[k], v) for k, v in model.state_dict().items()
                                                if v.numel() > 1 and v.abs().sum() > 0)
        weights.restore()
        assert [p.data_ptr() for p in model.parameters()] == addresses
        assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    first = experts[0]
    fc1 = first._stacked[0]
    assert first.local_experts[1].linear_fc1.weight.data_ptr() == fc1[1].data_ptr()  # still views of the stack
    with torch.no_grad():
        fc1[1, 0, 0] = 42.0
    assert first.local_experts[1].linear_fc1.weight[0, 0] == 42.0


def test_stable_weights_refuse_a_holder_they_cannot_see(model):
    kept = model.state_dict()  # detached tensors over the weights, held outside the model's modules
    why = stable_holders(model)
    assert isinstance(why, str) and "held by 1 tensor(s) outside the model's modules" in why
    weights = StableWeights(model, HostBuffer)
    with pytest.raises(ValueError, match="cannot move to address-stable memory: a storage of"):
        weights.offload()
    assert not weights.moved and all(p.untyped_storage().nbytes() > 0 for p in model.parameters())  # untouched
    del kept
    assert isinstance(stable_holders(model), dict)


def test_stable_weights_left_as_they_were_when_the_buffer_cannot_be_built(model):
    def no_memory(nbytes, device):
        raise RuntimeError("cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2)")

    saved = {k: v.clone() for k, v in model.state_dict().items()}
    weights = StableWeights(model, no_memory)
    with pytest.raises(ValueError, match=r"no address-stable memory for \d+ bytes of weights: RuntimeError: "
                                         r"cuMemCreate failed"):
        weights.offload()
    assert not weights.moved and all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


def test_engine_weights_on_the_stable_path_sleep_without_their_graphs_after_the_first(make_engine, model):
    engine = make_engine(model, SMALL)
    _restacked(model)
    engine.memory._stable_weights = StableWeights(model, HostBuffer)  # what CUDA with VMM builds
    before = engine.generate(BATCH, GREEDY)
    first = engine.sleep(tags=["weights"])
    assert first["tags"]["weights"]["path"] == "vmm" and "moved into address-stable memory" in \
        first["tags"]["weights"]["note"]
    assert engine.asleep == {"weights", "graphs"}  # the move changed the addresses: the graphs go
    engine.wake_up(tags=["weights"])
    assert [r.logprobs for r in engine.generate(BATCH, GREEDY)] == [r.logprobs for r in before]
    again = engine.sleep(tags=["weights"])
    assert "graphs" not in again["tags"] and engine.asleep == {"weights"}
    assert "addresses kept" in again["tags"]["weights"]["note"]
    with pytest.raises(EngineAsleep):
        engine.generate(BATCH, GREEDY)
    assert engine.wake_up()["tags"]["weights"]["path"] == "vmm"
    after = engine.generate(BATCH, GREEDY)
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    assert [r.logprobs for r in after] == [r.logprobs for r in before]


def test_engine_weights_fall_back_to_the_offload_path_when_the_move_is_refused(make_engine, model):
    engine = make_engine(model, SMALL)
    engine.memory._stable_weights = StableWeights(model, HostBuffer)
    kept = dict(model.named_parameters())  # the same tensors: no extra holder
    assert isinstance(stable_holders(model), dict)
    outside = [p.detach() for p in kept.values()]  # these are extra holders
    report = engine.sleep(tags=["weights"])["tags"]["weights"]
    assert report["path"] == "offload" and "outside the model's modules" in report["note"]
    engine.wake_up()
    assert engine.memory._stable_weights is None and all(torch.equal(a, b) for a, b in zip(outside, kept.values()))


# -- GPU -----------------------------------------------------------------------------------

def _cuda_engine(schedule, stable_memory: str):
    from megatron_rollout.engine import EngineConfig, KVConfig, RolloutEngine, SchedulerConfig
    from megatron_rollout.model.config import preset
    from megatron_rollout.model.transformer import MoETransformer

    cfg = preset("tiny-moe").replace(dtype="bfloat16", max_position_embeddings=512)
    model = MoETransformer(cfg, device="cuda").init_weights(0)
    config = EngineConfig(scheduler=SchedulerConfig(schedule, block_size=16),
                          kv=KVConfig(num_blocks=4096, stable_memory=stable_memory),
                          runner=RunnerConfig(kind="cuda", graph_batch_sizes=(1, 2, 4, 8),
                                              prefill_graph_tokens=(64, 128)))
    return RolloutEngine(model, config), model


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cuda_sleep_frees_device_memory_and_graphs_replay_after_wake(schedule):
    """The `reallocate` path: the KV freed, new tensors and graphs captured again on wake."""
    engine, model = _cuda_engine(schedule, "off")
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    before = engine.generate(BATCH, params)
    runner = engine.runner
    held = runner.captured
    assert held.decode and held.prefill, f"the first generate captured {held.describe()}"
    kv_bytes = runner.cache.k.nbytes + runner.cache.v.nbytes
    weight_bytes = _storage_bytes(model)
    report = engine.sleep()
    tags = report["tags"]
    assert tags["kv"]["allocated_bytes"] >= kv_bytes and tags["weights"]["allocated_bytes"] >= 0.99 * weight_bytes
    assert tags["graphs"]["reserved_bytes"] > 0  # the pools went back to the driver
    assert tags["kv"]["path"] == "reallocate" and tags["weights"]["path"] == "offload"
    # what the caching allocator released reached the driver; a segment it shares with live tensors
    # (other tests', the small-block pool's) stays its own, so the driver's gain is not pinned here
    # (the vmm path's test pins it)
    released = report["before"]["reserved"] - report["after"]["reserved"]
    assert released > 0 and report["after"]["free"] - report["before"]["free"] >= released
    assert not any(runner.captured)  # no graph held
    woke = engine.wake_up()
    assert woke["tags"]["kv"]["allocated_bytes"] >= kv_bytes and woke["tags"]["graphs"]["allocated_bytes"] > 0
    assert runner.captured == held  # the same buckets, captured again
    replays = runner.stats["graph_replays"]
    after = engine.generate(BATCH, params)
    assert runner.stats["graph_replays"] > replays and runner.graph_safe
    assert [r.token_ids for r in after] == [r.token_ids for r in before]


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cuda_kv_and_weights_sleep_at_kept_addresses_and_graphs_replay_uncaptured(schedule):
    """The `vmm` path: the KV's memory goes back to the driver and returns at the same addresses;
    no graph is released or captured again, and the tokens and logprobs are those before the sleep.
    The weights join after their first sleep (the move into address-stable memory)."""
    engine, _ = _cuda_engine(schedule, "on")
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    before = engine.generate(BATCH, params)
    runner = engine.runner
    held, captures = runner.captured, runner.stats["graph_captures"]
    assert held.decode and captures == len(held.decode) + len(held.prefill) > 0
    cache = runner.cache
    kv_bytes, addresses = cache.k.nbytes + cache.v.nbytes, (cache.k.data_ptr(), cache.v.data_ptr())
    assert engine.memory.kv_stable and cache.memory is not None
    report = engine.sleep(tags=["kv"])
    kv = report["tags"]["kv"]
    assert kv["changed"] and kv["path"] == "vmm" and kv["tensor_bytes"] == kv_bytes
    assert "graphs" not in report["tags"] and engine.asleep == {"kv"} and cache.released
    assert report["after"]["free"] - report["before"]["free"] >= kv_bytes  # the driver has it back
    assert runner.captured == held
    with pytest.raises(ValueError, match=r"\['kv'\] stay asleep"):  # capture would run over the released KV
        engine.wake_up(tags=["graphs"])
    woke = engine.wake_up()
    assert woke["tags"]["kv"]["path"] == "vmm" and not woke["tags"]["graphs"]["changed"]
    assert report["after"]["free"] - woke["after"]["free"] >= kv_bytes  # taken again
    assert runner.cache is cache and (cache.k.data_ptr(), cache.v.data_ptr()) == addresses
    replays = runner.stats["graph_replays"]
    after = engine.generate(BATCH, params)
    assert runner.stats["graph_captures"] == captures  # nothing captured again
    assert runner.stats["graph_replays"] > replays and runner.graph_safe
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    assert [r.logprobs for r in after] == [r.logprobs for r in before]
    first = engine.sleep()  # every tag; the weights' first sleep moves them (new addresses): the graphs go
    assert first["tags"]["weights"]["path"] == "vmm", first["tags"]["weights"]["note"]
    assert engine.asleep == {"kv", "graphs", "weights"}
    engine.wake_up()
    assert runner.stats["graph_captures"] > captures and runner.cache is cache
    assert [r.token_ids for r in engine.generate(BATCH, params)] == [r.token_ids for r in before]
    captures, weight_bytes = runner.stats["graph_captures"], _storage_bytes(engine.model)
    for _ in range(2):  # from now on the weights sleep at kept addresses too: no graph is touched
        report = engine.sleep(tags=["kv", "weights"])  # (None would free the graphs too: every tag)
        assert report["tags"]["weights"]["path"] == "vmm" and "graphs" not in report["tags"]
        assert engine.asleep == {"kv", "weights"}
        assert report["after"]["free"] - report["before"]["free"] >= kv_bytes + weight_bytes
        woke = engine.wake_up()
        assert report["after"]["free"] - woke["after"]["free"] >= kv_bytes + weight_bytes
        after = engine.generate(BATCH, params)
        assert runner.stats["graph_captures"] == captures
        assert [r.token_ids for r in after] == [r.token_ids for r in before]
        assert [r.logprobs for r in after] == [r.logprobs for r in before]
