"""Grouped-GEMM experts and the sync-free expert exchange against the portable per-expert path.

CPU: destinations in expert-sorted order (both the one-hot and the argsort method), stacked
weights that alias the Megatron-named parameters (an in-place weight update lands in both; a
bind-style re-point disables the fast path), and the portable path left exactly as it was.
GPU: `routed_experts` vs `compute_local` on random bf16 inputs, the `Experts.grouped` fast path vs
the loop, and the exchange inside a captured CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

import megatron_rollout.kernels.moe as moe
from megatron_rollout.comm.exchange import compute_local, sorted_destinations
from megatron_rollout.comm.facade import LocalComm
from megatron_rollout.kernels import expert_sort
from megatron_rollout.kernels.moe import DeviceLocalComm, install_device_exchange, routed_experts
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.transformer import MoETransformer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _moe_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=128, num_layers=2, num_attention_heads=4, num_query_groups=2,
                kv_channels=32, num_moe_experts=16, moe_router_topk=4, moe_ffn_hidden_size=64, dtype="bfloat16")
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("one_hot", [True, False])
def test_sorted_destinations_is_a_stable_expert_sort(one_hot):
    gen = torch.Generator().manual_seed(0)
    flat = torch.randint(0, 7, (200,), generator=gen)
    dest, offsets = sorted_destinations(flat, 9, 1 << 30 if one_hot else 0)
    order = torch.argsort(flat, stable=True)
    expect = torch.empty_like(order)
    expect[order] = torch.arange(200)
    assert torch.equal(dest, expect)
    assert offsets.tolist() == torch.bincount(flat, minlength=9).cumsum(0).tolist()
    assert offsets.dtype == torch.int32


def test_restacked_weights_alias_the_megatron_parameters():
    model = MoETransformer(_moe_cfg()).init_weights(0)
    experts = model.decoder.layers[0].mlp.experts
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    experts.restack()
    fc1, fc2 = experts.stacked()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # values unchanged
    new = torch.randn(fc1.shape[1:]).bfloat16()
    with torch.no_grad():
        experts.local_experts[5].linear_fc1.weight.copy_(new)  # what update_weights does
    assert torch.equal(fc1[5], new)
    experts.local_experts[0].linear_fc1.weight.data = torch.zeros_like(fc1[0])  # what WeightStore.bind does
    assert experts.stacked() is None


def test_portable_grouped_path_is_unchanged_on_cpu():
    model = MoETransformer(_moe_cfg()).init_weights(1)
    experts = model.decoder.layers[1].mlp.experts
    x = torch.randn(30, 128).bfloat16()
    counts = [3, 0, 5, 2, 0, 0, 4, 1, 2, 3, 0, 4, 1, 2, 3, 0]
    loop = torch.cat([experts.local_experts[k](p) for k, p in enumerate(x.split(counts)) if counts[k]])
    experts.restack()
    assert torch.equal(experts.grouped(x, counts), loop)  # no fast path on CPU: bit-identical


def test_install_device_exchange_on_a_single_rank_model():
    model = MoETransformer(_moe_cfg()).init_weights(2)
    assert isinstance(model.comm, LocalComm)
    assert install_device_exchange(model) is True
    assert isinstance(model.comm, DeviceLocalComm)
    fp32 = MoETransformer(_moe_cfg(dtype="float32")).init_weights(2)
    assert install_device_exchange(fp32) is False  # grouped GEMMs need bf16: graphs stay off


def test_routed_experts_matches_compute_local_on_cpu():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing")
    model = MoETransformer(_moe_cfg()).init_weights(3)
    experts = model.decoder.layers[0].mlp.experts
    experts.restack()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(41, 128, generator=gen).bfloat16()
    ids = torch.randint(0, 16, (41, 4), generator=gen)
    w = torch.rand(41, 4, generator=gen).bfloat16()
    try:
        out = routed_experts(x, ids, w, experts)
    except (RuntimeError, NotImplementedError) as exc:  # some CPU builds lack a bf16 grouped GEMM
        pytest.skip(f"no CPU grouped GEMM here: {exc}")
    with torch.no_grad():
        assert _rel(out, compute_local(x, ids, w, experts)) < 1e-2


# -- GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 3000])
def test_routed_experts_matches_portable_on_gpu(tokens):
    model = MoETransformer(_moe_cfg(num_moe_experts=32, moe_router_topk=8), device="cuda").init_weights(4)
    experts = model.decoder.layers[0].mlp.experts
    experts.restack()
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 128, generator=gen).bfloat16().cuda()
    logits = torch.randn(tokens, 32, generator=gen).cuda()
    w, ids = logits.softmax(-1).topk(8, dim=-1)
    w = w.bfloat16()
    with torch.no_grad():
        ref = compute_local(x, ids, w, experts)
        out = routed_experts(x, ids, w, experts)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-2


@pytest.mark.gpu
def test_small_kernel_choice_holds_for_every_engine_of_a_shape():
    """Two models of one shape get the first measurement's choice (the two expert paths round
    differently: a timing coin flip between two engines must not change their tokens)."""
    models = [MoETransformer(_moe_cfg(), device="cuda").init_weights(i) for i in (1, 2)]
    for m in models:
        install_device_exchange(m)
    first, second = (moe.choose_small_kernels(m) for m in models)
    assert first["choice"] in ("triton", "grouped_mm") and "reused" not in first
    assert second["reused"] and second["choice"] == first["choice"]
    assert models[1].comm.device_exchange.small == first["choice"]


@pytest.mark.gpu
def test_grouped_fast_path_matches_loop_on_gpu():
    model = MoETransformer(_moe_cfg(), device="cuda").init_weights(5)
    experts = model.decoder.layers[0].mlp.experts
    x = torch.randn(300, 128, device="cuda").bfloat16()
    counts = torch.distributions.Multinomial(300, torch.ones(16)).sample().long().tolist()
    with torch.no_grad():
        loop = experts.grouped(x, counts)  # not stacked yet: the loop
        experts.restack()
        fast = experts.grouped(x, counts)
    assert _rel(fast, loop) < 1e-2


def _captured_routing(experts):
    """Static inputs (24 tokens, top-4 of 16 experts) and a CUDA graph of `routed_experts` on them,
    warmed (and compiled) on a side stream first: (x, ids, weights, graph, out)."""
    x = torch.randn(24, 128, device="cuda").bfloat16()
    ids = torch.randint(0, 16, (24, 4), device="cuda")
    w = torch.rand(24, 4, device="cuda").bfloat16()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        routed_experts(x, ids, w, experts)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = routed_experts(x, ids, w, experts)
    return x, ids, w, graph, out


@pytest.mark.gpu
def test_routed_experts_in_a_cuda_graph():
    model = MoETransformer(_moe_cfg(), device="cuda").init_weights(6)
    experts = model.decoder.layers[0].mlp.experts
    experts.restack()
    x, ids, w, graph, out = _captured_routing(experts)
    x.copy_(torch.randn_like(x))
    ids.copy_(torch.randint(0, 16, (24, 4), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        assert _rel(out, compute_local(x, ids, w, experts)) < 1e-2


# -- the Triton small-batch expert kernels (moe_triton) ----------------------------------------

_INTERPRET = __import__("os").environ.get("TRITON_INTERPRET") == "1" and \
    __import__("importlib.util").util.find_spec("triton") is not None
DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    pytest.param("cpu", marks=pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1 and triton"),
                 id="interpret"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_triton_small_batch_experts_match_loop(device, tokens, monkeypatch):
    from megatron_rollout.kernels import moe_triton
    from megatron_rollout.kernels.moe_triton import padded_layout, routed_experts_triton

    gen = torch.Generator().manual_seed(tokens)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    e, k, h, f = 8, 2, 64, 32
    fc1 = (torch.randn(e, 2 * f, h, generator=gen) * 0.1).to(device, dtype)
    fc2 = (torch.randn(e, h, f, generator=gen) * 0.1).to(device, dtype)
    x = torch.randn(tokens, h, generator=gen).to(device, dtype)
    ids = torch.randint(0, e, (tokens, k), generator=gen).to(device)
    w = torch.rand(tokens, k, generator=gen).to(device, dtype)
    out = routed_experts_triton(x, ids, w, fc1, fc2)
    ref = torch.zeros(tokens, h, dtype=torch.float64)
    for n in range(tokens):
        for j in range(k):
            ex = int(ids[n, j])
            gate, up = (fc1[ex].double().cpu() @ x[n].double().cpu()).chunk(2)
            ref[n] += float(w[n, j]) * (fc2[ex].double().cpu() @ (torch.nn.functional.silu(gate) * up))
    assert _rel(out.cpu(), ref) < (2e-2 if device == "cuda" else 1e-5)
    from megatron_rollout.kernels import fused

    combined = routed_experts_triton(x, ids, w, fc1, fc2, combine=fused.moe_combine)  # weights applied by it
    assert _rel(combined.cpu(), ref) < (2e-2 if device == "cuda" else 1e-5)
    dest, row_pair, block_expert = padded_layout(ids.reshape(-1), e)
    assert torch.equal(row_pair[dest].long().cpu(), torch.arange(tokens * k))
    blocks = block_expert.cpu().tolist()
    assert blocks == sorted(blocks) and blocks[-1] == e  # experts ascending, then past-the-end blocks
    for limit in (1 << 30, 0):  # the torch layout, by its one-hot and its argsort branch, lays out alike
        monkeypatch.setattr(expert_sort, "ONE_HOT_LIMIT", limit)
        torch_layout = expert_sort.torch_layout(ids.reshape(-1), e, moe_triton.BLOCK_M)
        assert all(torch.equal(a, b) for a, b in zip(torch_layout, (dest, row_pair, block_expert)))


def _dequantised_reference(x, ids, w, fc1, fc2):
    """float64 sum_k w * SwiGLU-MLP over already dequantised [E, 2F, H] / [E, H, F] weights."""
    ref = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            ex = int(ids[n, j])
            gate, up = (fc1[ex].double() @ x[n].double().cpu()).chunk(2)
            ref[n] += float(w[n, j]) * (fc2[ex].double() @ (torch.nn.functional.silu(gate) * up))
    return ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("block_m,n_cap", [(16, 64), (64, 128)])
def test_triton_fp8_experts_match_the_dequantised_weights(device, block, block_m, n_cap):
    """Weight-only FP8: the kernels widen e4m3 weights and apply per-tensor or 128x128 block scales
    (fc1's k = 256 spans two scale groups: scaled per k-tile; fc2's k = 128 is one)."""
    from megatron_rollout.kernels.moe_triton import Tiles, routed_experts_triton
    from megatron_rollout.model import fp8

    gen = torch.Generator().manual_seed(3)
    e, k, h, f, tokens = 4, 2, 256, 128, 7
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    stacks = []
    for shape in ((2 * f, h), (h, f)):
        weights = [fp8.quantize_fp8(torch.randn(*shape, generator=gen) * 0.05 * (i + 1), block) for i in range(e)]
        stacks.append(fp8.stack_fp8(weights))
    fc1, fc2 = stacks
    x = torch.randn(tokens, h, generator=gen).to(device, dtype)
    ids = torch.randint(0, e, (tokens, k), generator=gen).to(device)
    w = torch.rand(tokens, k, generator=gen).to(device, dtype)
    on = [fp8.StackedFP8(s.data.to(device), s.scale.to(device), s.block) for s in stacks]
    tiles = Tiles(block_m=block_m, n_cap=n_cap, k_cap=64 if block_m == 16 else 128)
    out = routed_experts_triton(x, ids, w, *on, 0, tiles)
    deq = [torch.stack([fp8.FP8Weight(s.data[i], s.scale[i].reshape(()) if block is None else s.scale[i],
                                      block).dequantize() for i in range(e)]) for s in stacks]
    ref = _dequantised_reference(x.cpu(), ids.cpu(), w.cpu(), *deq)
    assert _rel(out.cpu(), ref) < (2e-2 if device == "cuda" else 1e-5)


def test_fp8_scales_that_do_not_fit_the_weights_are_refused():
    _operand = pytest.importorskip("megatron_rollout.kernels.moe_triton", reason="needs triton")._operand
    from megatron_rollout.model.fp8 import StackedFP8

    w = torch.zeros(4, 256, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="do not match"):
        _operand(StackedFP8(w, torch.ones(4, 2, 1), 128), 64)
    with pytest.raises(ValueError, match="k-tiles that divide"):
        _operand(StackedFP8(w, torch.ones(4, 8, 8), 32), 64)
    assert _operand(StackedFP8(w, torch.ones(4, 2, 2), 128), 64)[1]["KG"] == 2


def _fp8_moe(device: str, block: int | None):
    from megatron_rollout.model import fp8

    model = MoETransformer(_moe_cfg(), device=device).init_weights(6)
    fp8.quantize_model_fp8(model, block=block, backend="dequant")
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, 128])
def test_fp8_experts_run_sync_free_in_a_cuda_graph(block):
    model = _fp8_moe("cuda", block)
    assert install_device_exchange(model)  # FP8 experts are graph-safe on one rank
    experts = model.decoder.layers[0].mlp.experts
    assert moe.expert_path(experts) == "fp8"
    x, ids, w, graph, out = _captured_routing(experts)
    for _ in range(2):  # new inputs in place, then a large batch (64-row tiles) eagerly
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.randint(0, 16, (24, 4), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        with torch.no_grad():  # the portable path over the experts' own (dequant-backend) FP8 weights
            assert _rel(out, compute_local(x, ids, w, experts)) < 1e-2
    big_x = torch.randn(1024, 128, device="cuda").bfloat16()
    big_ids = torch.randint(0, 16, (1024, 4), device="cuda")
    big_w = torch.rand(1024, 4, device="cuda").bfloat16()
    with torch.no_grad():
        big = routed_experts(big_x, big_ids, big_w, experts)
        assert _rel(big, compute_local(big_x, big_ids, big_w, experts)) < 1e-2


@pytest.mark.parametrize("tokens,one_hot", [(24, True), (1024, False)])  # FP8_DECODE_TILES; LARGE_TILES, argsort
@pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
def test_routed_experts_on_fp8_experts_match_the_portable_path_in_the_interpreter(tokens, one_hot, monkeypatch):
    """`routed_experts` dispatches stacked FP8 experts to the Triton kernels; the portable path
    (`compute_local`, each expert's own dequant-backend FP8 weight) is the reference."""
    from megatron_rollout.model import fp8

    if not one_hot:
        monkeypatch.setattr(expert_sort, "ONE_HOT_LIMIT", 0)  # where the Triton sort does not run

    model = MoETransformer(_moe_cfg(dtype="float32")).init_weights(6)
    fp8.quantize_model_fp8(model, block=None, backend="dequant")
    experts = model.decoder.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 128, generator=gen)
    ids = torch.rand(tokens, 16, generator=gen).topk(4, dim=-1).indices
    w = torch.rand(tokens, 4, generator=gen)
    with torch.no_grad():
        assert _rel(routed_experts(x, ids, w, experts), compute_local(x, ids, w, experts)) < 1e-5


def test_fp8_experts_are_graph_safe_only_on_one_rank():
    model = _fp8_moe("cpu", None)
    experts = model.decoder.layers[0].mlp.experts
    assert moe.expert_path(experts) == "fp8"
    assert install_device_exchange(model) and isinstance(model.comm, DeviceLocalComm)

    class _CrossRankComm:  # what install_device_exchange reads of a multi-rank DistComm
        sync_free = True

    model = _fp8_moe("cpu", None)
    model.comm = _CrossRankComm()
    assert not install_device_exchange(model)  # its exchange has no FP8 grouped path: not graph-safe
