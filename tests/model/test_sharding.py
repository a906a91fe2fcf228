"""Sharding maps: every rank's slice, and back."""
import pytest
import torch

from megatron_rollout.comm.facade import Shard
from megatron_rollout.model.config import preset
from megatron_rollout.model.sharding import (
    full_name,
    full_shapes,
    local_name,
    local_shapes,
    shard_tensor,
    unshard_tensor,
)

CFG = preset("tiny-moe")


@pytest.mark.parametrize("atp", [1, 2, 4])
def test_unshard_inverts_shard_over_atp(atp: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for name, shape in full_shapes(CFG).items():
        full = torch.randn(shape, generator=gen)
        parts = [shard_tensor(name, full, CFG, Shard(r, atp, 0, 1)) for r in range(atp)]
        assert torch.equal(unshard_tensor(name, parts, CFG), full), name


def test_expert_names_round_trip_and_partition_over_ep() -> None:
    owners: dict[str, int] = {}
    for ep in range(4):
        shard = Shard(0, 1, ep, 4)
        for name in full_shapes(CFG):
            local = local_name(name, CFG, shard)
            if local is None:
                continue
            assert full_name(local, CFG, shard) == name
            if ".experts." in name:
                assert name not in owners  # each expert lives on exactly one EP rank
                owners[name] = ep
        assert all(".local_experts.0." in n or ".local_experts.1." in n
                   for n in local_shapes(CFG, shard) if ".experts." in n)  # 8 experts / EP4 = 2 local
    assert len(owners) == sum(".experts." in n for n in full_shapes(CFG))


def test_dense_fc1_shards_keep_gate_and_up_halves() -> None:
    name = "decoder.layers.0.mlp.linear_fc1.weight"  # layer 0 is dense in tiny-moe
    full = torch.arange(2 * CFG.ffn_hidden_size, dtype=torch.float32)[:, None].expand(-1, CFG.hidden_size)
    part = shard_tensor(name, full, CFG, Shard(1, 2, 0, 1))
    f = CFG.ffn_hidden_size
    assert part[:, 0].tolist() == list(range(f // 2, f)) + list(range(f + f // 2, 2 * f))
