"""The reference small ops (`model.ops.ModelOps`) where their numerics are pinned to another library's."""
from __future__ import annotations

import warnings

import torch

from megatron_rollout.model.ops import REFERENCE


def test_rmsnorm_with_an_fp32_weight_is_torchs_mixed_dtype_rms_norm():
    """A bf16 Megatron GPTModel normalises with torch's RMSNorm over fp32 weights (local spec); the
    rollout sharing those weights must compute what it computes, bit for bit, and stay bf16."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 256, generator=gen) * torch.logspace(-2, 2, 33)[:, None]).bfloat16()
    norm = torch.nn.RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(256, generator=gen))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # torch: mixed dtypes cannot use its fused kernel
        megatron = norm(x)
        ours = REFERENCE.rmsnorm(x, norm.weight, 1e-6)
    assert ours.dtype == megatron.dtype == torch.bfloat16
    assert torch.equal(ours, megatron)
    rounded = REFERENCE.rmsnorm(x, norm.weight.detach().bfloat16(), 1e-6)  # the copy path casts the weight
    assert not torch.equal(rounded, ours) and (rounded.float() - ours.float()).abs().max() < 0.1
    h, normed = REFERENCE.add_rmsnorm(x, x, norm.weight.detach(), 1e-6)
    assert torch.equal(normed, REFERENCE.rmsnorm(h, norm.weight.detach(), 1e-6)) and normed.dtype == torch.bfloat16
