"""`benchmarks.micro.per_expert_loop`, the baseline `micro.experts` times the grouped GEMM against,
computes what the package's expert path computes (CPU, float32)."""
import torch

from benchmarks import micro
from megatron_rollout.comm.exchange import compute_local
from megatron_rollout.model.config import preset
from megatron_rollout.model.layers import MoELayer
from megatron_rollout.model.transformer import MoETransformer


def test_the_per_expert_loop_matches_compute_local():
    model = MoETransformer(preset("tiny-moe")).init_weights(0)
    layer = next(m for m in model.modules() if isinstance(m, MoELayer))
    x = torch.randn(37, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        weights, ids = layer.router(x)
        want = compute_local(x, ids, weights, layer.experts)
        got = micro.per_expert_loop(x, ids, weights, layer.experts)
        none = micro.per_expert_loop(x, torch.full_like(ids, -1), weights, layer.experts)
    assert want.abs().sum() > 0
    torch.testing.assert_close(got, want)
    assert none.shape == x.shape and not none.any()  # no pair routed here: zeros, not an empty cat
