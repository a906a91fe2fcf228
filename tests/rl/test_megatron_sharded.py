"""A Megatron GPTModel sharded TP 2 x EP 2 over 4 gloo processes hot-swaps into the rollout.

The reference is a full native model's tensors. The test loads them into Megatron's shards by
its own slicing, and checks that slicing against Megatron's `sharded_state_dict` (the global
offset of every plainly sharded tensor), so the library's gather is compared with what Megatron
itself says about its layout; then `MegatronTrainer.named_weights()` (the gather) goes through
`engine.update_weights`, and the rollout's weights must equal the reference tensor by tensor.
Construction and the mapping run on CPU; the training step (forward) needs CUDA.
"""
import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_rollout.engine import KVConfig
from tests.world import run_world  # noqa: E402


def _megatron_slice(name, full, tp, tp_size, ep, per_rank):
    """Megatron's local tensor for `name` on (tp, ep) and its local name, written independently of rl/."""
    import re

    m = re.match(r"^(.*\.local_experts\.)(\d+)(\..*)$", name)
    if m:
        e = int(m.group(2))
        return (f"{m.group(1)}{e - ep * per_rank}{m.group(3)}", full) if e // per_rank == ep else (None, None)
    if name.endswith("layernorm.weight") or name.endswith("router.weight"):
        return name, full
    if name.endswith("linear_fc1.weight"):  # SwiGLU: [gate_tp; up_tp]
        gate, up = full.chunk(2)
        return name, torch.cat([gate.chunk(tp_size)[tp], up.chunk(tp_size)[tp]])
    if name.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
        return name, full.chunk(tp_size, 0)[tp]
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return name, full.chunk(tp_size, 1)[tp]
    raise AssertionError(f"no slicing rule for {name}")


def _world(rank):
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_rollout.engine import EngineConfig, RolloutEngine, SamplingParams
    from megatron_rollout.model.config import preset
    from megatron_rollout.model.transformer import MoETransformer
    from rl.megatron_trainer import MegatronTrainer, build_gpt_model
    from rl.objective import LossConfig

    ps.initialize_model_parallel(2, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    cfg = preset("tiny-moe")
    gpt = build_gpt_model(cfg)
    reference = MoETransformer(cfg).init_weights(7).state_dict()
    per_rank = cfg.num_moe_experts // 2
    own = dict(gpt.named_parameters())
    loaded, offsets_checked = set(), 0
    sharded = gpt.sharded_state_dict()
    with torch.no_grad():
        for name, full in reference.items():
            local, value = _megatron_slice(name, full, tp, 2, ep, per_rank)
            if local is None:
                continue
            own[local].copy_(value)
            loaded.add(local)
            entry = sharded.get(local)
            if isinstance(entry, ShardedTensor) and ".local_experts." not in local:
                # Megatron's own claim: this local tensor sits at global_offset in a global_shape tensor.
                region = full[tuple(slice(o, o + s) for o, s in zip(entry.global_offset, value.shape))]
                assert tuple(entry.global_shape) == tuple(full.shape), (local, entry.global_shape)
                assert torch.equal(region, value), f"{local}: Megatron places it at {entry.global_offset}"
                offsets_checked += 1
    assert loaded == set(own), sorted(set(own) - loaded)[:3]
    trainer = MegatronTrainer(gpt, torch.optim.SGD(gpt.parameters(), lr=0.1), LossConfig(), cfg)
    engine = RolloutEngine(MoETransformer(cfg).init_weights(0), EngineConfig(kv=KVConfig(num_blocks=32)))
    engine.update_weights(trainer.named_weights(), 1)  # a collective: every rank gathers
    got = engine.model.state_dict()
    equal = sorted(n for n in reference if torch.equal(got[n], reference[n]))
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    tokens = engine.generate([[256, 72, 105]], params)[0].token_ids
    want = RolloutEngine(MoETransformer(cfg).init_weights(7), EngineConfig(kv=KVConfig(num_blocks=32))).generate(
        [[256, 72, 105]], params)[0].token_ids
    return dict(tp=tp, ep=ep, local=len(own), total=len(reference), equal=len(equal), offsets=offsets_checked,
                tokens=tokens, want=want, version=engine.weight_version, sharded=trainer.sharded)


def test_megatron_tp2_ep2_shards_hot_swap_into_the_rollout():
    res = run_world(_world, 4, timeout=240)
    assert {r["tp"] for r in res} == {r["ep"] for r in res} == {0, 1}, [(r["tp"], r["ep"]) for r in res]
    for r in res:
        assert r["sharded"] and r["local"] < r["total"]  # each rank holds half the experts
        assert r["equal"] == r["total"], r  # every full tensor equals the reference
        assert r["offsets"] >= 20  # Megatron's layout confirmed for the plainly sharded tensors
        assert r["tokens"] == r["want"] and len(r["tokens"]) == 6 and r["version"] == 1
