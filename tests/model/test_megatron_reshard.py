"""weights.megatron_reshard: a TP/EP-sharded Megatron trainer's state gathered into full rollout tensors
with bucketed collectives, in a 2-process gloo world (tests/world.py).

Each rank holds Megatron's slices of one full model (`megatron_local_state`: vocab-parallel embedding
and output layer, column/row-parallel attention and MLPs, the SwiGLU fc1 as [gate_r; up_r], EP-local
experts numbered from 0) plus `_extra_state` entries; the gather must give back the full tensors exactly.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.engine import KVConfig
from megatron_rollout.model.config import PRESETS
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.weights.megatron_reshard import _buckets, megatron_local_state
from tests.world import run_world

CFG = PRESETS["tiny-moe"]  # dense layer, MoE layers with a shared expert, qk norm, untied output layer


def _gather_everything(rank: int) -> dict:
    import torch.distributed as dist

    from megatron_rollout.weights.megatron_reshard import gather_megatron_state

    def refuse(*args, **kwargs):
        raise AssertionError("all_gather_object was called: tensors must not be pickled")

    dist.all_gather_object = refuse
    full = MoETransformer(CFG).init_weights(7).state_dict()
    world = dist.group.WORLD
    alone = [dist.new_group([r]) for r in range(2)][rank]  # every rank creates every group
    out = {}
    for label, tp, ep, tp_group, ep_group in (("tp2-ep2", 2, 2, world, world), ("tp1-ep2", 1, 2, alone, world),
                                              ("tp2-ep1", 2, 1, world, alone)):
        local = megatron_local_state(full, CFG, rank if tp > 1 else 0, tp, rank if ep > 1 else 0, ep)
        local["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None
        gathered = gather_megatron_state(local, CFG, tp_group, ep_group, bucket_bytes=16 << 10)
        out[label] = (list(gathered.tensors) == list(full)
                      and all(torch.equal(gathered.tensors[n], t) for n, t in full.items()),
                      gathered.stats.bytes_gathered, gathered.stats.buckets)
    # a rank whose state differs from its group's is refused on every rank, not mis-assembled
    local = megatron_local_state(full, CFG, rank, 2, rank, 2)
    if rank == 1:
        del local["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"]
    try:
        gather_megatron_state(local, CFG, world, world)
        out["mismatch"] = "not refused"
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def test_a_sharded_trainer_is_gathered_exactly_in_buckets():
    results = run_world(_gather_everything, 2, timeout=240)
    nbytes = {n: t.numel() * t.element_size() for n, t in MoETransformer(CFG).state_dict().items()}
    experts = sum(b for n, b in nbytes.items() if ".local_experts." in n)
    split = sum(b for n, b in nbytes.items() if n.endswith(("linear_qkv.weight", "linear_proj.weight",
                "word_embeddings.weight", "output_layer.weight")) or (n.endswith(("fc1.weight", "fc2.weight"))
                                                                     and ".local_experts." not in n))
    for rank, out in enumerate(results):
        for label in ("tp2-ep2", "tp1-ep2", "tp2-ep1"):
            exact, _, buckets = out[label]
            assert exact, (rank, label)
            assert buckets > 2, (rank, label)  # 16 KiB buckets: several collectives, not one
        # every rank receives both ranks' halves of what is split: the full bytes of those tensors
        assert out["tp2-ep2"][1] == experts + split
        assert out["tp1-ep2"][1] == experts
        assert out["tp2-ep1"][1] == split
        assert "different expert-parallel tensors" in out["mismatch"]


def test_buckets_keep_one_dtype_and_a_size_bound():
    named = [("a", torch.zeros(100)), ("b", torch.zeros(100)), ("c", torch.zeros(300)),
             ("d", torch.zeros(10, dtype=torch.bfloat16)), ("e", torch.zeros(10))]
    got = [[n for n, _ in b] for b in _buckets(named, bucket_bytes=800)]
    assert got == [["a", "b"], ["c"], ["d"], ["e"]]


@pytest.mark.parametrize("bad", [0, -1])
def test_a_bucket_size_must_be_positive(bad):
    from megatron_rollout.weights.megatron_reshard import gather_megatron_state

    with pytest.raises(ValueError, match=f"bucket_bytes must be positive, got {bad}"):
        gather_megatron_state({}, CFG, bucket_bytes=bad)


def _sharded_gpt_into_engine(rank: int) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_rollout.engine import EngineConfig, RolloutEngine
    from megatron_rollout.weights.megatron_layout import transformer_config

    ps.initialize_model_parallel(2, 1, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    tc = transformer_config(CFG)
    gpt = GPTModel(tc, get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm"),
                   vocab_size=CFG.vocab_size, max_sequence_length=CFG.max_position_embeddings,
                   position_embedding_type="rope", rotary_base=int(CFG.rotary_base))
    reference = MoETransformer(CFG).init_weights(7).state_dict()
    local = megatron_local_state(reference, CFG, tp, 2, ep, 2)
    own = dict(gpt.named_parameters())
    sharded, offsets = gpt.sharded_state_dict(), 0
    with torch.no_grad():
        for name, value in local.items():
            own[name].copy_(value)
            entry = sharded.get(name)
            if isinstance(entry, ShardedTensor) and ".local_experts." not in name:  # Megatron's own placement
                full = reference[name]
                region = full[tuple(slice(o, o + s) for o, s in zip(entry.global_offset, value.shape))]
                offsets += torch.equal(region, value) and tuple(entry.global_shape) == tuple(full.shape)
    try:
        RolloutEngine.from_megatron(gpt, share_storage=True)
        refused = "not refused"
    except ValueError as exc:
        refused = str(exc)
    # gathers over ps's TP and EP groups
    engine = RolloutEngine.from_megatron(gpt, EngineConfig(kv=KVConfig(num_blocks=32)))
    got = engine.model.state_dict()
    return dict(tp=tp, ep=ep, local=len(local), own=len(own), offsets=offsets, refused=refused,
                equal=sum(torch.equal(got[n], t) for n, t in reference.items()), total=len(reference))


def test_an_engine_built_from_a_tp2_ep2_gpt_model_holds_its_full_weights():
    pytest.importorskip("megatron.core")
    results = run_world(_sharded_gpt_into_engine, 2, timeout=300)
    assert [(r["tp"], r["ep"]) for r in results] == [(0, 0), (1, 1)]
    for r in results:
        assert r["local"] == r["own"] < r["total"]  # the slicer filled every Megatron parameter, half the experts
        assert r["offsets"] >= 20  # and put each plainly sharded tensor where Megatron says it lies
        assert r["equal"] == r["total"], r
        assert "TP=2, EP=2" in r["refused"] and "share_storage=False" in r["refused"]
