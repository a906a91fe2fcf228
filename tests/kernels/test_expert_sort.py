"""`kernels.expert_sort` against the torch layouts it replaces, bit for bit, and its self-check.

The references are `expert_sort.torch_layout` (the one-hot prefix sum or the argsort, which
`moe_triton.padded_layout` ran before) and `comm.exchange.sorted_destinations` (the stable
argsort). CPU runs need TRITON_INTERPRET=1 and Triton; the GPU case is marked.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rollout.comm.exchange import sorted_destinations
from megatron_rollout.kernels import expert_sort
from megatron_rollout.kernels.fused import interpreting, triton_available

_INTERPRET = interpreting() and triton_available()
DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    pytest.param("cpu", marks=pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1 and triton"),
                 id="interpret"),
]
CASES = [  # (pairs, experts): one pair, a chunk and a bit, E not a power of two, MAX_PAIRS (32 rows);
    # past it (three launches): one pair more, the preset's 64 rows, chunks and a bit, over 128 experts
    (1, 8), (65, 8), (200, 9), (256, 128), (257, 128), (512, 128), (3001, 128), (1500, 200)]


def _ids(pairs: int, experts: int, device: str, same: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(pairs * 1000 + experts)
    flat = torch.zeros(pairs, dtype=torch.int64) if same else torch.randint(0, experts, (pairs,), generator=gen)
    return flat.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pairs,experts", CASES)
@pytest.mark.parametrize("same", [False, True], ids=["random", "one-expert"])
@pytest.mark.parametrize("block_m", [16, 128])
def test_padded_layout_matches_the_torch_layout(device, pairs, experts, same, block_m, monkeypatch):
    from megatron_rollout.kernels import moe_triton

    flat = _ids(pairs, experts, device, same)
    assert expert_sort.runnable(flat, experts)
    got = expert_sort.expert_layout(flat, experts, block_m)
    monkeypatch.setattr(expert_sort, "runnable", lambda *a: False)  # padded_layout's torch path
    dest, row_pair, block_expert = moe_triton.padded_layout(flat, experts, block_m)
    assert torch.equal(got.dest, dest) and got.dest.dtype == torch.int64
    assert torch.equal(got.row_source, row_pair)
    assert torch.equal(got.block_expert, block_expert)
    counts = torch.bincount(flat.cpu(), minlength=experts)
    assert got.ends.cpu().tolist() == ((counts + block_m - 1) // block_m * block_m).cumsum(0).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pairs,experts", CASES)
def test_unpadded_layout_is_the_stable_expert_sort(device, pairs, experts):
    topk = 4
    flat = _ids(pairs, experts, device)
    got = expert_sort.expert_layout(flat, experts, 1, div=topk)
    dest, offsets = sorted_destinations(flat, experts, 0)  # the argsort branch
    assert torch.equal(got.dest, dest)
    assert torch.equal(got.ends, offsets)
    source = torch.empty_like(dest)
    source[dest] = torch.arange(pairs, device=flat.device) // topk
    assert torch.equal(got.row_source.long(), source)
    assert got.block_expert.numel() == 0


def test_what_the_kernels_cannot_lay_out_is_refused():
    flat = torch.zeros(8, dtype=torch.int64)
    assert not expert_sort.runnable(flat[:0], 8)  # no pairs
    assert not expert_sort.runnable(flat, expert_sort.MAX_EXPERTS + 1)
    if not _INTERPRET:
        assert not expert_sort.runnable(flat, 8)  # a CPU tensor, no interpreter
    with pytest.raises(ValueError, match="block_m and div must be positive"):
        expert_sort.expert_layout(flat, 8, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_device_whose_kernels_disagree_is_refused(device, monkeypatch):
    """`self_check` passes on the real kernels; a kernel that lays out wrongly gets its device
    refused, and `layout` then serves the torch layout there."""
    monkeypatch.setattr(expert_sort, "_REFUSED", {})
    monkeypatch.setattr(expert_sort, "_CHECKED", set())
    dev = torch.device(device)
    assert expert_sort.self_check(dev, 128) is None
    good = expert_sort.expert_layout

    def wrong(flat, experts, block_m, div=1):
        out = good(flat, experts, block_m, div)
        return out._replace(dest=out.dest.flip(0))

    monkeypatch.setattr(expert_sort, "expert_layout", wrong)
    monkeypatch.setattr(expert_sort, "_CHECKED", set())
    why = expert_sort.self_check(dev, 128)
    assert why and "dest differs from the torch layout" in why
    flat = _ids(40, 128, device)
    assert not expert_sort.runnable(flat, 128)
    got, ref = expert_sort.layout(flat, 128, 16), expert_sort.torch_layout(flat, 128, 16)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("pairs,experts,same", [(1, 128, False), (8, 128, False), (8, 128, True), (37, 16, False),
                                                (128, 128, False), (512, 128, False), (8, 4, False)])
@pytest.mark.parametrize("block_m", [16, 64])
def test_blocks_past_the_active_bound_hold_no_pair(pairs, experts, same, block_m):
    """`active_blocks` bounds the blocks the Triton experts launch: every block holding a pair lies
    below it, so the programs past it would only have exited (checked on the torch layout)."""
    flat = _ids(pairs, experts, "cpu", same)
    if pairs <= experts and not same:  # the worst case: every pair opens an expert of its own
        flat = torch.randperm(experts)[:pairs]
    out = expert_sort.torch_layout(flat, experts, block_m)
    bound = expert_sort.active_blocks(pairs, experts, block_m)
    assert bound <= out.block_expert.numel()
    assert int(out.ends[-1]) <= bound * block_m
    assert bool((out.block_expert[bound:] == experts).all())
    assert bool((out.row_source[bound * block_m:] == -1).all())
    if pairs <= experts and not same:
        assert int(out.ends[-1]) == bound * block_m  # the bound is tight there
