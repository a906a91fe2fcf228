"""FP8 weights: e4m3 rounding bounds, which layers get quantised, backend choice, and the logit
error of an FP8 tiny-moe against the same model in bf16 (measured: 5.1% relative, both scalings)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rollout.model import fp8
from megatron_rollout.model.config import PRESETS
from megatron_rollout.model.layers import Linear
from megatron_rollout.model.transformer import MoETransformer

CFG = PRESETS["tiny-moe"]


def _weight(out: int = 200, inp: int = 300, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen)
    w[:64, :64] *= 1e5  # one region far larger: one scale pushes the rest into e4m3 subnormals
    return w


@pytest.mark.parametrize("block", [None, 128, 32])
def test_rounding_error_is_within_e4m3_precision(block):
    w = _weight()
    q = fp8.quantize_fp8(w, block)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == w.shape
    assert q.scale.shape == (() if block is None else (-(-200 // block), -(-300 // block)))
    err = (q.dequantize() - w).abs()
    # 3 mantissa bits: half an ulp is <= 2^-4 of the value; below 2^-6 (subnormal) the spacing is 2^-9 x scale
    bound = 2.0 ** -4 * w.abs() + 2.0 ** -10 * q.expanded_scale()
    assert (err <= bound * (1 + 1e-6)).all()
    assert err.max() > 0  # it did round


def test_block_scales_beat_one_scale_next_to_an_outlier_region():
    w = _weight()
    small = (slice(64, 200), slice(64, 300))  # the 64x64 blocks without the large region
    per_tensor = (fp8.quantize_fp8(w, None).dequantize() - w)[small].abs().mean()
    per_block = (fp8.quantize_fp8(w, 64).dequantize() - w)[small].abs().mean()
    assert per_block < per_tensor / 4


def test_zero_weight_quantises_to_zero():
    for block in (None, 16):
        assert torch.equal(fp8.quantize_fp8(torch.zeros(32, 48), block).dequantize(), torch.zeros(32, 48))


def test_quantize_model_targets_only_matmul_weights():
    model = MoETransformer(CFG).init_weights(seed=0)
    names = fp8.quantize_model_fp8(model)
    # per layer qkv + proj; dense layer 0: fc1, fc2; MoE layers 1, 2: 8 experts x 2 + shared expert x 2
    assert len(names) == 3 * 2 + 2 + 2 * (8 * 2 + 2)
    assert model.output_layer.fp8 is None
    assert all(isinstance(model.get_submodule(n), Linear) for n in names)
    assert not any("router" in n or "norm" in n or "embedding" in n for n in names)
    with pytest.raises(ValueError, match="no Linear layer matches"):
        fp8.quantize_model_fp8(model, include=("*nothing*",))


def test_auto_on_cpu_is_the_dequantised_path():
    w = fp8.quantize_fp8(_weight(64, 96), 32)
    x = torch.randn(5, 3, 96)
    assert fp8.resolve_backend("auto", w, x) is fp8.DequantBackend
    assert torch.equal(w.matmul(x), F.linear(x, w.dequantize()))


def test_explicit_backend_that_is_missing_fails_with_a_hint():
    with pytest.raises(ValueError, match="unknown FP8 backend 'cutlass'"):
        fp8.quantize_fp8(torch.ones(16, 16), backend="cutlass")
    w = fp8.quantize_fp8(torch.randn(16, 16), backend="scaled_mm")
    with pytest.raises(RuntimeError, match="scaled_mm.*compute capability >= 8.9"):
        w.matmul(torch.randn(2, 16))  # a CPU input
    if fp8.TransformerEngineBackend.missing() is None:
        pytest.skip("transformer_engine is installed here")
    with pytest.raises(RuntimeError, match="pip install.*transformer_engine"):
        fp8.quantize_model_fp8(MoETransformer(CFG), backend="transformer_engine")


@pytest.mark.parametrize("block", [None, 128])
def test_fp8_tiny_moe_logits_stay_close_to_bf16(block):
    cfg = CFG.replace(dtype="bfloat16")
    ref = MoETransformer(cfg).init_weights(seed=0)
    quant = MoETransformer(cfg).init_weights(seed=0)
    fp8.quantize_model_fp8(quant, block=block)
    ids = torch.randint(0, cfg.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ref(ids).float(), quant(ids).float()
    rel = ((got - want).norm() / want.norm()).item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"\n[fp8 block={block}] logits relative error vs bf16: {rel:.4f}, argmax agreement {agree:.3f}")
    assert 0.01 < rel < 0.07  # measured 0.051 (per tensor) and 0.051 (128x128 blocks)
    assert agree > 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("block, dtype", [(None, torch.bfloat16), (None, torch.float32), (128, torch.bfloat16)])
def test_scaled_mm_path_on_cuda(block, dtype):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    gen = torch.Generator().manual_seed(0)
    w = fp8.quantize_fp8((torch.randn(384, 640, generator=gen) * 0.05).cuda(), block)
    x = torch.randn(3, 37, 640, generator=gen).cuda().to(dtype)
    x[0, 0] *= 30  # an outlier token
    assert fp8.resolve_backend("auto", w, x) is fp8.ScaledMMBackend
    got = w.matmul(x)
    want = F.linear(x.float(), w.dequantize())  # exact weights, unquantised activations
    assert got.shape == (3, 37, 384) and got.dtype == dtype
    rel = ((got.float() - want).norm() / want.norm()).item()
    print(f"\n[scaled_mm block={block} {dtype}] relative error vs dequantised fp32: {rel:.4f}")
    assert rel < 0.05  # only the activations' e4m3 rounding (and bf16 output) remain


@pytest.mark.gpu
def test_fp8_model_on_cuda_uses_scaled_mm():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    cfg = CFG.replace(dtype="bfloat16")
    ref = MoETransformer(cfg, device="cuda").init_weights(seed=0)
    quant = MoETransformer(cfg, device="cuda").init_weights(seed=0)
    fp8.quantize_model_fp8(quant, backend="scaled_mm")  # explicit: any fallback would raise
    ids = torch.randint(0, cfg.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        want, got = ref(ids).float(), quant(ids).float()
    rel = ((got - want).norm() / want.norm()).item()
    print(f"\n[fp8 scaled_mm tiny-moe] logits relative error vs bf16: {rel:.4f}")
    assert rel < 0.1


# -- stacked FP8 experts (what the CUDA exchange's Triton kernels read) -------------------------

@pytest.mark.parametrize("block", [None, 16])
def test_quantised_experts_are_stacked_views(block):
    model = MoETransformer(CFG).init_weights(seed=0)
    fp8.quantize_model_fp8(model, block=block)
    experts = model.decoder.layers[1].mlp.experts
    fc1, fc2 = fp8.stacked_experts_fp8(experts)
    assert fc1.data.shape == (8, 2 * CFG.moe_ffn_hidden_size, CFG.hidden_size) and fc1.block == block
    assert fc1.group == ((block, block) if block else tuple(fc1.data.shape[1:]))
    for i, e in enumerate(experts.local_experts):
        alone = fp8.quantize_fp8(e.linear_fc1.weight, block)  # what the expert's own quantisation gives
        assert e.linear_fc1.fp8.data.data_ptr() == fc1.data[i].data_ptr()
        assert torch.equal(e.linear_fc1.fp8.dequantize(), alone.dequantize())
        assert e.linear_fc1.fp8.scale.shape == alone.scale.shape


def test_requantising_stacked_experts_keeps_their_storage():
    model = MoETransformer(CFG).init_weights(seed=0)
    fp8.quantize_model_fp8(model, block=16)
    experts = model.decoder.layers[1].mlp.experts
    fc1, fc2 = fp8.stacked_experts_fp8(experts)
    ptrs = (fc1.data.data_ptr(), fc1.scale.data_ptr(), fc2.data.data_ptr(), fc2.scale.data_ptr())
    with torch.no_grad():
        for e in experts.local_experts:  # a weight update lands in the full-precision weights
            e.linear_fc1.weight.mul_(3.0)
    fp8.quantize_model_fp8(model, block=16)
    new1, new2 = fp8.stacked_experts_fp8(experts)
    assert (new1.data.data_ptr(), new1.scale.data_ptr(), new2.data.data_ptr(), new2.scale.data_ptr()) == ptrs
    w = experts.local_experts[3].linear_fc1.weight
    assert torch.equal(new1.data[3].float() * new1.scale[3].repeat_interleave(16, 0).repeat_interleave(16, 1),
                       fp8.quantize_fp8(w, 16).dequantize())


def test_stacked_experts_are_dropped_when_an_expert_changes():
    model = MoETransformer(CFG).init_weights(seed=0)
    fp8.quantize_model_fp8(model)
    experts = model.decoder.layers[1].mlp.experts
    last = experts.local_experts[-1]
    last.linear_fc2.fp8 = fp8.quantize_fp8(last.linear_fc2.weight)
    assert fp8.stacked_experts_fp8(experts) is None  # no longer a view of the stack: the exchange must not read it
    last.linear_fc2.fp8 = fp8.quantize_fp8(last.linear_fc2.weight, 16)
    with pytest.raises(ValueError, match="differ in block"):
        fp8.stack_experts_fp8(experts)
    fp8.quantize_model_fp8(model, include=("*self_attention*",))
    assert fp8.stacked_experts_fp8(experts) is None  # experts outside the patterns: their old FP8 stays, unstacked


def test_requantising_refreshes_derived_scales_in_place():
    """The block scales `_scaled_mm` derives (padded, transposed) are what a captured graph reads:
    re-rounding updates them in their own storage."""
    w = torch.randn(256, 384)
    q = fp8.quantize_fp8(w, 128)
    q.cache = {"scaled_mm": fp8.ScaledMMBackend._padded_scale(q)}
    derived = q.cache["scaled_mm"]
    ptrs = (q.data.data_ptr(), q.scale.data_ptr(), derived.data_ptr())
    fp8.requantize_(q, w * 5.0)
    assert (q.data.data_ptr(), q.scale.data_ptr(), q.cache["scaled_mm"].data_ptr()) == ptrs
    assert torch.equal(q.dequantize(), fp8.quantize_fp8(w * 5.0, 128).dequantize())
    assert torch.equal(derived, fp8.ScaledMMBackend._padded_scale(q))
