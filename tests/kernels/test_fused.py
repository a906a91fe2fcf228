"""Fused kernels (`kernels.fused`) against the portable path, and the wiring that installs them.

Each kernel is compared with its reference (the model's own forward code) on fresh random bf16
inputs, with the outputs poisoned (NaN, -1) before the run so an unwritten element fails:
- `rmsnorm`, `add_rmsnorm`: the sum `h + delta` bit for bit; the norm within 3 bf16 ulps per
  element (one ulp of `x * rsqrt(..)` moved by a differently ordered fp32 mean of squares, then
  the weight product), normwise rel err < 2e-3, and at least 99% of elements bitwise equal;
- `qkv_norm_rope`: v bit for bit; without QK-norm q and k bit for bit (elementwise only); with it
  normwise rel err < 2e-3 and >= 99% bitwise equal;
- `router_topk`: ids equal to `torch.topk`'s except on near-ties (rows whose chosen experts' exact
  fp64 logits equal the reference's within 1e-4 and that are at most 1% of rows), weights rel err
  < 1e-2 and >= 98% bitwise equal on rows with equal ids; exact ties go to the lowest expert id.
Whole models (tiny-moe, and a 2-layer model with the preset's head size and 32 experts): logits
rel err < 1e-2 per step and greedy tokens equal for 16 decode steps (a differing token is
accepted only at a near-tie of the reference, at most 2 of them); the CUDA runner's graphs with the
fused ops installed against the portable runner; no Triton compilation after warm-up.

Devices: the cases marked `gpu` run on CUDA; the `interpret` cases run the same kernels on CPU
through Triton's interpreter (`TRITON_INTERPRET=1 PYTHONPATH=<triton> pytest -m interpret`) at
smaller sizes, and skip where Triton is missing (CI). The ops hook itself (`MoETransformer.use_ops`)
and the residual wiring the kernels rely on are tested on CPU unconditionally.
"""
from __future__ import annotations

import copy

import pytest
import torch

from megatron_rollout.forward import run_to_end
from megatron_rollout.kernels import fused
from megatron_rollout.model.attention import DenseKVCache
from megatron_rollout.model.config import ModelConfig, preset
from megatron_rollout.model.layers import RMSNorm, Router, rope_tables
from megatron_rollout.model.ops import REFERENCE, ModelOps
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.types import Phase

_INTERPRET = fused.interpreting() and fused.triton_available()
CUDA = pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")
INTERP = pytest.param("cpu", marks=[pytest.mark.interpret,
                                    pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")],
                      id="interpret")

PRESET = preset("qwen3-30b-a3b-12l")
DECODE_OPS = ("rmsnorm", "add_rmsnorm", "qkv_norm_rope", "router_topk")
"""The ops every fused forward launches; the MoE two run on the device exchange's grouped path
(`test_routed_experts_with_fused_ops_match`)."""
TINY = preset("tiny-moe")


def _cases(gpu: list, interp: list) -> list:
    """(device, *case) params: the GPU list on CUDA, the (smaller) interpreter list on CPU."""
    return ([pytest.param("cuda", *c, marks=pytest.mark.gpu, id=f"cuda-{c}") for c in gpu]
            + [pytest.param("cpu", *c, marks=INTERP.marks, id=f"interpret-{c}") for c in interp])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _same(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of elements bitwise equal."""
    return float((a.view(torch.int16) == b.view(torch.int16)).double().mean())


def _within_ulps(a: torch.Tensor, b: torch.Tensor, ulps: int) -> bool:
    """|a - b| <= ulps bf16 units in the last place of the larger of the two, elementwise."""
    a, b = a.float(), b.float()
    _, exp = torch.frexp(torch.maximum(a.abs(), b.abs()))
    ulp = torch.ldexp(torch.ones_like(a), exp - 8)  # bf16 keeps 8 significant bits
    return bool(((a - b).abs() <= ulps * ulp).all())


def _gen(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape, device, gen, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, device=device, generator=gen) * scale).bfloat16()


def _poison(shape, device, dtype=torch.bfloat16) -> torch.Tensor:
    if dtype == torch.int64:
        return torch.full(shape, -1, dtype=dtype, device=device)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _launched(name: str, before: dict) -> int:
    return fused.LAUNCHES[name] - before[name]


# -- kernels against references -----------------------------------------------------------------

NORM_GPU = [(1, 2048), (7, 2048), (64, 2048), (4096, 2048), (4095, 2048), (1, 64), (7, 64), (64, 64), (4096, 64),
            (5, 128), (3, 96), (300, 96)]
NORM_INTERP = [(1, 2048), (7, 64), (16, 2048), (3, 96), (258, 64)]


@pytest.mark.parametrize("device,rows,hidden", _cases(NORM_GPU, NORM_INTERP))
def test_rmsnorm_matches_reference(device, rows, hidden):
    gen = _gen(device, rows * 1000 + hidden)
    # rows at different scales: the norm must not depend on one global magnitude
    x = _randn((rows, hidden), device, gen) * torch.logspace(-2, 2, rows, device=device).bfloat16()[:, None]
    w = (1 + 0.2 * torch.randn(hidden, device=device, generator=gen)).bfloat16()
    eps = PRESET.layernorm_epsilon
    out, before = _poison((rows, hidden), device), dict(fused.LAUNCHES)
    y = fused.rmsnorm(x, w, eps, out=out)
    ref = fused.rmsnorm_ref(x, w, eps)
    assert _launched("rmsnorm", before) == 1 and y.data_ptr() == out.data_ptr()
    assert not y.isnan().any()
    assert _rel(y, ref) < 2e-3 and _within_ulps(y, ref, 3) and _same(y, ref) >= 0.99, (_rel(y, ref), _same(y, ref))


@pytest.mark.parametrize("device,rows,hidden", _cases(NORM_GPU, NORM_INTERP))
def test_add_rmsnorm_matches_reference(device, rows, hidden):
    gen = _gen(device, rows * 7 + hidden)
    h, delta = _randn((rows, hidden), device, gen, 4.0), _randn((rows, hidden), device, gen)
    w = (1 + 0.2 * torch.randn(hidden, device=device, generator=gen)).bfloat16()
    out_h, out, before = _poison((rows, hidden), device), _poison((rows, hidden), device), dict(fused.LAUNCHES)
    got = fused.add_rmsnorm(h, delta, w, 1e-6, out_h=out_h, out=out)
    ref = fused.add_rmsnorm_ref(h, delta, w, 1e-6)
    assert _launched("add_rmsnorm", before) == 1
    assert torch.equal(got.h, ref.h)  # one bf16 add: bit for bit
    y = got.normed
    assert not y.isnan().any()
    assert _rel(y, ref.normed) < 2e-3 and _within_ulps(y, ref.normed, 3) and _same(y, ref.normed) >= 0.99


@pytest.mark.parametrize("device,rows,hidden", _cases([(1, 2048), (300, 2048), (7, 96)], [(7, 64), (3, 96)]))
def test_norms_read_an_fp32_weight_as_the_reference_does(device, rows, hidden):
    """A bf16 Megatron GPTModel's norm weights are fp32, and a rollout sharing its storage reads them
    as they are (`weights.megatron_bridge`): the kernels run (no fallback) and match the reference,
    which rounds the fp32 product once (torch's `rms_norm` on mixed dtypes)."""
    gen = _gen(device, rows * 13 + hidden)
    x, delta = _randn((rows, hidden), device, gen, 4.0), _randn((rows, hidden), device, gen)
    w = 1 + 0.2 * torch.randn(hidden, device=device, generator=gen)  # fp32
    before = dict(fused.LAUNCHES)
    y, ref = fused.rmsnorm(x, w, 1e-6), fused.rmsnorm_ref(x, w, 1e-6)
    got, ref_add = fused.add_rmsnorm(x, delta, w, 1e-6), fused.add_rmsnorm_ref(x, delta, w, 1e-6)
    assert _launched("rmsnorm", before) == 1 and _launched("add_rmsnorm", before) == 1
    assert y.dtype == ref.dtype == torch.bfloat16 and torch.equal(got.h, ref_add.h)
    assert not torch.equal(ref, fused.rmsnorm_ref(x, w.bfloat16(), 1e-6))  # the fp32 weight is read as fp32
    for g, r in ((y, ref), (got.normed, ref_add.normed)):
        assert _rel(g, r) < 2e-3 and _within_ulps(g, r, 3) and _same(g, r) >= 0.99, (_rel(g, r), _same(g, r))
    d, groups, per = 64, 2, 4
    qkv = _randn((rows, groups * (per + 2) * d), device, gen, 3.0)
    cos, sin = rope_tables(torch.arange(rows, device=device) * 37, d, PRESET.rotary_base, torch.bfloat16)
    qw, kw = (1 + 0.2 * torch.randn(d, device=device, generator=gen) for _ in range(2))
    got_qkv = fused.qkv_norm_rope(qkv, groups, per, d, cos, sin, qw, kw, 1e-6)
    ref_qkv = fused.qkv_norm_rope_ref(qkv, groups, per, d, cos, sin, qw, kw, 1e-6)
    assert _launched("qkv_norm_rope", before) == 1
    for g, r in zip(got_qkv, ref_qkv):
        assert _rel(g, r) < 2e-3 and _same(g, r) >= 0.99, (_rel(g, r), _same(g, r))


# (pairs, FFN): the SwiGLU between the grouped expert GEMMs
SILU_GPU = [(1, 768), (64 * 8, 768), (4096 * 8, 768), (4096 * 8 - 3, 768), (5, 96), (3, 1500), (5000, 1500)]
SILU_INTERP = [(1, 768), (9, 96), (4, 1500), (4098, 16)]


@pytest.mark.parametrize("device,rows,ffn", _cases(SILU_GPU, SILU_INTERP))
def test_silu_mul_matches_reference(device, rows, ffn):
    gen = _gen(device, rows * 3 + ffn)
    h = _randn((rows, 2 * ffn), device, gen, 3.0)
    out, before = _poison((rows, ffn), device), dict(fused.LAUNCHES)
    a = fused.silu_mul(h, out=out)
    ref = fused.silu_mul_ref(h)
    assert _launched("silu_mul", before) == 1 and a.data_ptr() == out.data_ptr()
    # the same two bf16 roundings as the reference; exp may differ by an fp32 ulp
    assert _within_ulps(a, ref, 1) and _same(a, ref) >= 0.99, _same(a, ref)


# (tokens, top-k, hidden)
COMBINE_GPU = [(1, 8, 2048), (64, 8, 2048), (4096, 8, 2048), (5, 2, 96), (3, 4, 3000)]
COMBINE_INTERP = [(1, 8, 2048), (5, 2, 96), (3, 4, 3000)]


@pytest.mark.parametrize("device,tokens,k,hidden", _cases(COMBINE_GPU, COMBINE_INTERP))
def test_moe_combine_matches_reference(device, tokens, k, hidden):
    gen = _gen(device, tokens * 11 + k + hidden)
    ys = _randn((tokens * k + 3, hidden), device, gen)  # 3 rows no pair reads
    dest = torch.randperm(tokens * k + 3, device=device, generator=gen)[:tokens * k].view(tokens, k)
    w = torch.rand(tokens, k, device=device, generator=gen).bfloat16()
    out, before = _poison((tokens, hidden), device), dict(fused.LAUNCHES)
    y = fused.moe_combine(ys, dest, w, out=out)
    ref = fused.moe_combine_ref(ys, dest, w)
    assert _launched("moe_combine", before) == 1 and y.data_ptr() == out.data_ptr()
    assert _rel(y, ref) < 2e-3 and _within_ulps(y, ref, 2) and _same(y, ref) >= 0.98, (_rel(y, ref), _same(y, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [64, 4096])
def test_routed_experts_with_fused_ops_match(tokens):
    """`kernels.moe.routed_experts` on the grouped path, with and without the fused SwiGLU and
    combine installed: the same result within bf16 rounding, and the two kernels ran."""
    from megatron_rollout.kernels.moe import install_device_exchange, routed_experts
    from megatron_rollout.model.layers import MoELayer

    model = MoETransformer(PRESET.replace(num_layers=2), device="cuda").init_weights(2).requires_grad_(False)
    install_device_exchange(model)
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    x = _randn((tokens, PRESET.hidden_size), "cuda", _gen("cuda", tokens))
    with torch.no_grad():
        w, ids = layer.router(x)
        ref = routed_experts(x, ids, w, layer.experts)
        fused.install_fused_ops(model, "triton")
        before = dict(fused.LAUNCHES)
        got = routed_experts(x, ids, w, layer.experts)
    assert _launched("silu_mul", before) == 1 and _launched("moe_combine", before) == 1
    assert _rel(got, ref) < 1e-2, _rel(got, ref)
    fused.uninstall_fused_ops(model)
    assert fused.installed_backend(model) is None and layer.experts.ops is REFERENCE


def test_moe_ops_fall_back_where_they_do_not_apply():
    gen = _gen("cpu", 0)
    h = torch.randn(4, 10, generator=gen)  # fp32: the reference runs, no launch
    before = dict(fused.LAUNCHES)
    assert torch.equal(fused.silu_mul(h), fused.silu_mul_ref(h))
    ys, dest, w = torch.randn(6, 8, generator=gen), torch.tensor([[0, 5], [2, 3]]), torch.rand(2, 2, generator=gen)
    assert torch.equal(fused.moe_combine(ys, dest, w), fused.moe_combine_ref(ys, dest, w))
    assert fused.LAUNCHES == before


# (tokens, groups, heads per group, head dim)
QKV_GPU = [(1, 4, 8, 128), (7, 4, 8, 128), (64, 4, 8, 128), (4096, 4, 8, 128), (4093, 4, 8, 128), (1, 4, 2, 8),
           (7, 4, 2, 8), (64, 4, 2, 8), (4096, 4, 2, 8), (5, 2, 3, 64), (300, 2, 3, 64)]
QKV_INTERP = [(1, 4, 8, 128), (2, 4, 2, 8), (2, 2, 3, 64), (300, 2, 3, 16), (257, 4, 2, 8)]


@pytest.mark.parametrize("norm", [True, False], ids=["qknorm", "nonorm"])
@pytest.mark.parametrize("device,tokens,groups,per,d", _cases(QKV_GPU, QKV_INTERP))
def test_qkv_norm_rope_matches_reference(device, tokens, groups, per, d, norm):
    gen = _gen(device, tokens * 31 + groups * 7 + per + d)
    qkv = _randn((tokens, groups * (per + 2) * d), device, gen, 3.0)
    positions = torch.randint(0, PRESET.max_position_embeddings, (tokens,), device=device, generator=gen)
    cos, sin = rope_tables(positions, d, PRESET.rotary_base, torch.bfloat16)
    qw = (1 + 0.2 * torch.randn(d, device=device, generator=gen)).bfloat16() if norm else None
    kw = (1 + 0.2 * torch.randn(d, device=device, generator=gen)).bfloat16() if norm else None
    out = fused.QKV(_poison((tokens, groups * per, d), device), _poison((tokens, groups, d), device),
                    _poison((tokens, groups, d), device))
    before = dict(fused.LAUNCHES)
    got = fused.qkv_norm_rope(qkv, groups, per, d, cos, sin, qw, kw, 1e-6, out=out)
    ref = fused.qkv_norm_rope_ref(qkv, groups, per, d, cos, sin, qw, kw, 1e-6)
    assert _launched("qkv_norm_rope", before) == 1
    assert all(g.is_contiguous() and g.shape == r.shape for g, r in zip(got, ref))
    assert torch.equal(got.v, ref.v)
    for g, r in zip(got[:2], ref[:2]):
        assert not g.isnan().any()
        if norm:  # the per-head mean of squares is summed in another order
            assert _rel(g, r) < 2e-3 and _same(g, r) >= 0.99, (_rel(g, r), _same(g, r))
        else:  # RoPE alone is elementwise: the reference's roundings exactly
            assert torch.equal(g, r)


@pytest.mark.parametrize("device,rows", _cases([(4095,), (300,)], [(258,)]))
def test_the_sweeps_blocks_of_rows_match_reference(device, rows, monkeypatch):
    """One row per program is the default at every size; `benchmarks.kernels --row-blocks` launches
    blocks of rows (4 for the norms and the SwiGLU, 8 tokens of QKV), the last one partial here:
    the same checks as above hold for them."""
    monkeypatch.setattr(fused, "NORM_BLOCK_ROWS", 4)
    monkeypatch.setattr(fused, "QKV_BLOCK_TOKENS", 8)
    monkeypatch.setattr(fused, "SILU_BLOCK_ROWS", 4)
    monkeypatch.setattr(fused, "SILU_BLOCK_MIN_ROWS", 256)
    hidden, ffn = (2048, 768) if device == "cuda" else (64, 16)
    test_rmsnorm_matches_reference(device, rows, hidden)
    test_add_rmsnorm_matches_reference(device, rows, hidden)
    test_silu_mul_matches_reference(device, rows, ffn)
    test_qkv_norm_rope_matches_reference(device, rows, 4, 8 if device == "cuda" else 2, 128 if device == "cuda" else 8,
                                         True)


# (tokens, experts, hidden, top-k)
ROUTER_GPU = [(1, 128, 2048, 8), (7, 128, 2048, 8), (16, 128, 2048, 8), (64, 128, 2048, 8), (4096, 128, 2048, 8),
              (1, 8, 64, 2), (7, 8, 64, 2), (64, 8, 64, 2), (4096, 8, 64, 2), (33, 60, 96, 4)]
ROUTER_INTERP = [(1, 128, 2048, 8), (7, 8, 64, 2), (20, 128, 2048, 8), (5, 60, 96, 4)]


def _check_routing(got: fused.Routing, ref: fused.Routing, x: torch.Tensor, w: torch.Tensor, experts: int) -> None:
    assert got.ids.dtype == torch.int64 and got.weights.dtype == x.dtype
    assert not got.weights.isnan().any() and bool(((got.ids >= 0) & (got.ids < experts)).all())
    exact = (x.double() @ w.double().T).cpu()  # [N, E] fp64 logits
    same = (got.ids == ref.ids).all(-1).cpu()
    for row in (~same).nonzero().flatten().tolist():  # near-ties only: equally good choices
        a = exact[row, got.ids[row].cpu()]
        b = exact[row, ref.ids[row].cpu()]
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (row, a, b)
        assert len(set(got.ids[row].tolist())) == got.ids.shape[1]
    assert (~same).double().mean() <= 0.01, f"{int((~same).sum())} of {len(same)} rows chose other experts"
    rows = same.nonzero().flatten().to(x.device)
    gw, rw = got.weights[rows], ref.weights[rows]
    assert _rel(gw, rw) < 1e-2 and _same(gw, rw) >= 0.98, (_rel(gw, rw), _same(gw, rw))


@pytest.mark.parametrize("split", [1, 8], ids=["one-program", "split"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "plain"])
@pytest.mark.parametrize("device,tokens,experts,hidden,topk", _cases(ROUTER_GPU, ROUTER_INTERP))
def test_router_matches_reference(device, tokens, experts, hidden, topk, renormalize, split):
    """Both kernels (`RouterTiles.split`: the weight read by one program per row block, or by
    `split` programs whose last routes); a split past experts / 16 is clamped."""
    gen = _gen(device, tokens * 13 + experts + hidden + topk)
    x = _randn((tokens, hidden), device, gen)
    w = _randn((experts, hidden), device, gen, 0.02)  # the benchmark's init scale
    out = fused.Routing(_poison((tokens, topk), device), _poison((tokens, topk), device, torch.int64))
    before = dict(fused.LAUNCHES)
    got = fused.router_topk(x, w, topk, renormalize, out=out, tiles=fused.RouterTiles(split=split))
    assert _launched("router_topk", before) == 1
    _check_routing(got, fused.router_ref(x, w, topk, renormalize), x, w, experts)
    if renormalize:
        assert torch.allclose(got.weights.float().sum(-1), torch.ones(tokens, device=device), atol=2e-2)


@pytest.mark.parametrize("device", [CUDA, INTERP])
def test_router_exact_ties_take_the_lowest_expert_first(device):
    gen = _gen(device, 5)
    x = _randn((9, 64), device, gen)
    w = _randn((16, 64), device, gen, 0.02)
    w[11] = w[4] = (x[0].float() * 0.05).bfloat16()  # equal logits, and the largest for row 0
    got = fused.router_topk(x, w, 4, True)
    assert got.ids[0, :2].tolist() == [4, 11]
    assert got.weights[0, 0] == got.weights[0, 1]


# -- whole models --------------------------------------------------------------------------------

def _wide_cfg() -> ModelConfig:
    """Two layers with the preset's head size and QK-norm, 32 experts top-4, one dense layer."""
    return ModelConfig(vocab_size=512, hidden_size=512, num_layers=2, num_attention_heads=8, num_query_groups=2,
                       kv_channels=128, ffn_hidden_size=256, num_moe_experts=32, moe_router_topk=4,
                       moe_ffn_hidden_size=64, moe_layer_freq=(0, 1), qk_layernorm=True, rotary_base=1e6,
                       max_position_embeddings=1024, dtype="bfloat16")


def _models(cfg: ModelConfig, device: str, seed: int, backend: str) -> tuple[MoETransformer, MoETransformer]:
    ref = MoETransformer(cfg).init_weights(seed).to(device).requires_grad_(False)
    fast = copy.deepcopy(ref)
    report = fused.install_fused_ops(fast, backend)
    assert report["installed"] and report["backend"] == backend, report
    return ref, fast


def _decode(model: MoETransformer, cache: DenseKVCache, tokens: list[int], device: str) -> torch.Tensor:
    cache.begin([len(tokens)])
    positions = cache.positions().to(device)
    logits = run_to_end(model.step(torch.tensor(tokens, device=device), positions, cache, Phase.D))
    cache.end()
    return logits[-1].float()


def _greedy_agreement(cfg: ModelConfig, device: str, seed: int, steps: int, backend: str = "triton") -> dict:
    """Reference and fused greedy decoding side by side; the reference's token is fed to both."""
    ref, fast = _models(cfg, device, seed, backend)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (5,), generator=gen).tolist()
    caches = DenseKVCache(cfg.num_layers, 1), DenseKVCache(cfg.num_layers, 1)
    before = dict(fused.LAUNCHES)
    feed, worst, ties, equal = prompt, 0.0, 0, 0
    with torch.no_grad():
        for _ in range(steps):
            a = _decode(ref, caches[0], feed, device)
            b = _decode(fast, caches[1], feed, device)
            worst = max(worst, _rel(b, a))
            ta, tb = int(a.argmax()), int(b.argmax())
            if ta == tb:
                equal += 1
            else:  # acceptable only where the reference itself nearly ties
                top2 = a.topk(2).values
                margin = float(top2[0] - top2[1])
                assert margin <= 2 * float((a - b).abs().max()), (ta, tb, margin)
                ties += 1
            feed = [ta]
    return {"rel": worst, "ties": ties, "equal": equal,
            "launches": {k: fused.LAUNCHES[k] - before[k] for k in fused.LAUNCHES}}


@pytest.mark.parametrize("cfg", [TINY.replace(dtype="bfloat16"), _wide_cfg()], ids=["tiny-moe", "wide"])
@pytest.mark.gpu
def test_fused_model_greedy_matches_on_cuda(cfg):
    got = _greedy_agreement(cfg, "cuda", 3, steps=16)
    assert got["rel"] < 1e-2 and got["ties"] <= 2 and got["equal"] >= 14, got
    assert all(got["launches"][k] > 0 for k in DECODE_OPS), got  # every kernel ran, not the references


@pytest.mark.interpret
@pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
def test_fused_model_greedy_matches_in_the_interpreter():
    got = _greedy_agreement(TINY.replace(dtype="bfloat16"), "cpu", 3, steps=6)
    assert got["rel"] < 1e-2 and got["ties"] <= 1 and got["equal"] >= 5, got
    assert all(got["launches"][k] > 0 for k in DECODE_OPS), got


@pytest.mark.parametrize("device", [CUDA, INTERP])
def test_autograd_falls_back_to_the_references(device):
    """A trainer sharing the model: with gradients needed every fused op runs the reference, so the
    loss and every gradient equal the unfused model's (bit for bit on CPU)."""
    cfg = TINY.replace(dtype="bfloat16")
    ref = MoETransformer(cfg).init_weights(6).to(device)
    fast = copy.deepcopy(ref)
    fused.install_fused_ops(fast, "triton")
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(6)).to(device)
    before = dict(fused.LAUNCHES)
    losses = [m.token_logprobs(ids).sum() for m in (ref, fast)]
    for loss in losses:
        loss.backward()
    # CPU: bit for bit; CUDA: backward's atomic adds may sum in another order
    same = torch.equal if device == "cpu" else (lambda a, b: _rel(a, b) < 1e-2)
    assert fused.LAUNCHES == before and same(losses[0], losses[1])
    grads = {n: p.grad for n, p in ref.named_parameters()}  # None for experts no token chose
    assert sum(g is not None for g in grads.values()) > len(grads) // 2
    for name, p in fast.named_parameters():
        assert (p.grad is None and grads[name] is None) or same(p.grad, grads[name]), name


@pytest.mark.gpu
def test_cuda_runner_graphs_with_fused_ops_match_the_portable_runner():
    from megatron_rollout.kv.paged import PagedKVCache
    from megatron_rollout.runner.base import ModelRunner
    from megatron_rollout.runner.config import RunnerConfig
    from megatron_rollout.runner.cuda import CudaRunner
    from megatron_rollout.types import SeqSpan, SpanInput

    cfg = _wide_cfg()
    ref_model = MoETransformer(cfg, device="cuda").init_weights(4).requires_grad_(False)
    model = copy.deepcopy(ref_model)
    caches = [PagedKVCache(cfg, 64, 4, cfg.num_query_groups, device="cuda") for _ in range(2)]
    ref = ModelRunner(ref_model, caches[0])
    fast = CudaRunner(model, caches[1], RunnerConfig(graph_batch_sizes=(1, 2, 4)))
    if fused.installed_backend(model) is None:  # until the runner installs them itself
        assert fused.install_fused_ops(model)["installed"]
    gen = torch.Generator().manual_seed(0)
    tables = [tuple(range(i * 16, (i + 1) * 16)) for i in range(3)]

    def inputs(spec):
        return [SpanInput(SeqSpan(tables[i], past, new), torch.randint(0, cfg.vocab_size, (new,), generator=gen)
                          .tolist(), True) for i, (past, new) in enumerate(spec)]

    before = dict(fused.LAUNCHES)
    with torch.no_grad():
        batch = inputs([(0, 11), (0, 20), (0, 3)])
        assert _rel(run_to_end(fast.forward(batch, Phase.P)), run_to_end(ref.forward(batch, Phase.P))) < 3e-2
        lens = [11, 20, 3]
        for _ in range(3):  # 3 rows: bucket 4, one padded row
            batch = inputs([(n, 1) for n in lens])
            a, b = run_to_end(ref.forward(batch, Phase.D)), run_to_end(fast.forward(batch, Phase.D))
            assert b.shape == a.shape and _rel(b, a) < 3e-2  # the runner test's bound (Triton attention)
            lens = [n + 1 for n in lens]
    assert fast.stats["graph_replays"] == 3
    assert all(fused.LAUNCHES[k] > before[k] for k in DECODE_OPS)


@pytest.mark.gpu
def test_split_router_replays_in_a_graph():
    """The split router's per-call counters and scratch are captured with it: replays on new
    inputs route as the reference does (its counters restart at 0 every replay)."""
    gen = _gen("cuda", 21)
    w = _randn((128, 2048), "cuda", gen, 0.02)
    x = _randn((64, 2048), "cuda", gen)
    split = fused.RouterTiles(split=8)
    fused.router_topk(x, w, 8, True, tiles=split)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fused.router_topk(x, w, 8, True, tiles=split)
    for _ in range(3):
        x.copy_(_randn((64, 2048), "cuda", gen))
        graph.replay()
        _check_routing(got, fused.router_ref(x, w, 8, True), x, w, 128)


@pytest.mark.gpu
def test_no_triton_compilation_after_warm_up():
    from benchmarks.compiles import CompileCounter

    gen = _gen("cuda", 9)
    norm_w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    router_w = _randn((128, 2048), "cuda", gen, 0.02)
    qw = torch.ones(128, device="cuda", dtype=torch.bfloat16)

    def run(n):
        x = _randn((n, 2048), "cuda", gen)
        fused.rmsnorm(x, norm_w, 1e-6)
        fused.add_rmsnorm(x, x, norm_w, 1e-6)
        fused.router_topk(x, router_w, 8, True)
        cos, sin = rope_tables(torch.arange(n, device="cuda"), 128, 1e6, torch.bfloat16)
        fused.qkv_norm_rope(_randn((n, 4 * 10 * 128), "cuda", gen), 4, 8, 128, cos, sin, qw, qw, 1e-6)

    run(1)
    run(4096)  # the smallest and the largest batch: every launch shape the ops choose by size
    torch.cuda.synchronize()
    with CompileCounter() as counter:
        for n in (1, 7, 16, 64, 333, 4096):
            run(n)
        torch.cuda.synchronize()
    assert counter.counts.triton == 0, counter.counts


# -- CPU, always: the wiring, the fallbacks, install/uninstall ----------------------------------

def _variants() -> list[ModelConfig]:
    return [TINY, TINY.replace(dtype="bfloat16"), TINY.replace(qk_layernorm=False, tie_word_embeddings=True),
            TINY.replace(moe_renormalize_topk=False, moe_layer_freq=(1, 0, 1))]


def test_install_auto_on_cpu_installs_nothing_and_says_why():
    model = MoETransformer(TINY).init_weights(0)
    report = fused.install_fused_ops(model)
    assert report["installed"] is False and report["reason"]
    assert fused.installed_backend(model) is None and model.ops is REFERENCE
    with pytest.raises(ValueError, match="backend must be one of"):
        fused.install_fused_ops(model, "cuda")


class _Counting(ModelOps):
    """The reference ops, counting which ones the model calls."""

    name = "counting"

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __getattribute__(self, attr):
        if attr in ("rmsnorm", "add_rmsnorm", "qkv", "router", "silu_mul", "combine"):
            calls = object.__getattribute__(self, "calls")
            calls[attr] = calls.get(attr, 0) + 1
        return object.__getattribute__(self, attr)


def test_the_ops_hook_routes_every_small_op_and_uninstall_restores():
    model = MoETransformer(TINY).init_weights(0)
    ids = torch.randint(0, TINY.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids)
        ops = _Counting()
        # 3 layers x (input, pre-MLP, q, k) norms + the final norm; 2 routers and expert sets; 3 attentions
        # and layers
        assert model.use_ops(ops) == 13 + 2 + 2 + 3 + 3 == model.use_ops(ops)
        assert model.ops is ops and fused.installed_backend(model) == "counting"
        assert torch.equal(model(ids), before)  # the reference's math, called through the hook
    # every layer: the first norm (rmsnorm), the residual adds fused into norms, the QKV ops, the router
    assert ops.calls["qkv"] == 3 and ops.calls["router"] == 2 and ops.calls["add_rmsnorm"] == 3 + 2
    # layer 0's input norm and the final norm, and the reference's add_rmsnorm (5) and QK-norms (2 x 3) call it
    assert ops.calls["rmsnorm"] == 2 + 5 + 6
    clone = copy.deepcopy(model)
    assert fused.installed_backend(clone) == "counting" and clone.ops is not ops  # the copy has its own
    assert fused.uninstall_fused_ops(model) == 23 and model.ops is REFERENCE
    assert all("ops" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("cfg", _variants(), ids=["fp32", "bf16", "noqknorm-tied", "plain-topk"])
def test_the_fused_residual_wiring_equals_plain_residual_layers(cfg):
    """`MoETransformer.step` carries each layer's MLP output to the next layer's norm; that must be
    bit for bit the plain `h + attention(norm(h))`, `h + mlp(norm(h))` layer after layer."""
    from megatron_rollout.forward import run_to_end as run
    from megatron_rollout.model.attention import CausalBatch
    from megatron_rollout.model.rope import rope_for

    model = MoETransformer(cfg).init_weights(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        attn, positions = CausalBatch(2, 9), torch.arange(9).repeat(2)
        h = model.embedding.word_embeddings(ids.reshape(-1))
        rope = rope_for(cfg, positions, h.dtype)
        for layer in model.decoder.layers:
            x = layer.self_attention(layer.input_layernorm(h), rope, attn, model.comm, Phase.P)
            h = h + run(x)
            h = h + run(layer.mlp(layer.pre_mlp_layernorm(h), model.comm, Phase.P))
        assert torch.equal(model.logits(h).view(2, 9, -1), model(ids))


@pytest.mark.skipif(_INTERPRET, reason="the interpreter runs the kernels on CPU")
def test_kernels_fall_back_to_the_references_where_they_cannot_run():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).bfloat16()
    norm, router = RMSNorm(64, 1e-6, torch.bfloat16), Router(TINY.replace(dtype="bfloat16"))
    with torch.no_grad():
        router.weight.normal_(0, 0.02, generator=gen)
        before = dict(fused.LAUNCHES)
        assert torch.equal(fused.rmsnorm(x, norm.weight, norm.eps), norm(x))  # the module's own forward
        weights, ids = router(x)
        got = fused.router_topk(x, router.weight, router.topk, router.renormalize)
        assert torch.equal(got.weights, weights) and torch.equal(got.ids, ids)
    assert fused.LAUNCHES == before  # CPU without the interpreter: no kernel ran


class _WrongNorm(ModelOps):
    def rmsnorm(self, x, weight, eps):
        return super().rmsnorm(x, weight, eps) * 1.1


class _BrokenRouter(ModelOps):
    def router(self, x, weight, topk, renormalize):
        raise RuntimeError("no kernel image is available")


def test_self_check_catches_a_wrong_or_failing_kernel():
    model = MoETransformer(TINY.replace(dtype="bfloat16")).init_weights(0)
    assert fused.self_check(model, ModelOps()) is None
    assert fused.self_check(model, _WrongNorm()).startswith("rmsnorm: rel err")
    assert "router_topk failed: RuntimeError: no kernel image" in fused.self_check(model, _BrokenRouter())


@pytest.mark.interpret
@pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
def test_install_verifies_the_kernels_in_the_interpreter():
    report = fused.install_fused_ops(MoETransformer(TINY.replace(dtype="bfloat16")).init_weights(0), "triton",
                                     verify=True)
    assert report["installed"] and report["verified"], report


@pytest.mark.skipif(fused.triton_available(), reason="Triton is installed here")
def test_triton_backend_without_triton_names_the_install():
    with pytest.raises(ImportError, match="pip install triton"):
        fused.install_fused_ops(MoETransformer(TINY).init_weights(0), "triton")
