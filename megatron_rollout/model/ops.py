"""The small ops a layer calls, and the hook that chooses their implementation.

A layer's forward is large matmuls (`layers.Linear`, the experts, attention) joined by small ops:
norms, the residual add fused with the next norm, the QKV split with QK-norm and RoPE, the router's
softmax and top-k, SwiGLU's activation, and the experts' weighted combine. `ModelOps` holds those
small ops with the model's own math; every module that calls one reads it from its `ops` attribute
(`UsesOps`). `MoETransformer.use_ops(ops)` points every such module of a model at another
implementation at once: `kernels.fused.TritonOps` fuses them into Triton kernels on CUDA, and the
CUDA runner installs it through `kernels.fused.install_fused_ops` (docs/design.md §4). Nothing is
patched: the forward code is one, and the reference is what runs until a kernel set is chosen.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class AddNorm(NamedTuple):
    h: torch.Tensor  # h + delta, [N, H]
    normed: torch.Tensor  # rmsnorm(h + delta), [N, H]


class QKV(NamedTuple):
    q: torch.Tensor  # [N, hq, d], QK-norm and RoPE applied, contiguous
    k: torch.Tensor  # [N, hkv, d], likewise
    v: torch.Tensor  # [N, hkv, d], contiguous


class Routing(NamedTuple):
    weights: torch.Tensor  # [N, k] in x's dtype
    ids: torch.Tensor  # [N, k] int64 expert ids, by descending probability


ROW_MULTIPLE = 8
"""CPU matmuls see a multiple of this many rows (zero rows appended, their results dropped). The CPU
BLAS picks its kernel and its split over threads by the row count, and the rounding of a row's
result follows that choice; at multiples of 8 rows (measured with 1, 2 and 4 threads up to 4,096
rows) it is one choice, so a row's output does not depend on how many rows share its batch. That
is what makes a seeded request's tokens and logprobs independent of the schedule and of the other
requests (tests/engine/test_batch_invariance.py), and a GRPO run on CPU reproducible."""


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for x [rows, in]; on CPU each row's result is independent of the other rows."""
    pad = -x.shape[0] % ROW_MULTIPLE if x.device.type == "cpu" and x.dim() == 2 else 0
    if pad == 0:
        return F.linear(x, weight)
    return F.linear(torch.cat([x, x.new_zeros(pad, x.shape[1])]), weight)[: x.shape[0]]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [N, heads, dim]; cos, sin: [N, dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class ModelOps:
    """The reference small ops: the model's own math, on any device and dtype."""

    name = "torch"
    fuses_combine = False
    """Whether the expert paths should call `combine` after their second GEMM instead of weighing
    rows inside it (a fused combine saves a pass; the reference does not)."""

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x's rows in fp32. A weight in x's dtype scales the row rounded to that dtype; a
        weight in another dtype (a Megatron trainer's fp32 norm, shared by `weights.megatron_bridge`)
        scales the fp32 row and the product is rounded once to x's dtype, as torch's `rms_norm`
        (Megatron's local-spec norm) and Transformer Engine's norms compute it."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if weight.dtype != x.dtype:
            return (xf * weight.float()).to(x.dtype)
        return weight * xf.to(x.dtype)

    def add_rmsnorm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> AddNorm:
        """The residual add and the next norm: (h + delta, rmsnorm(h + delta))."""
        h = h + delta
        return AddNorm(h, self.rmsnorm(h, weight, eps))

    def qkv(self, qkv: torch.Tensor, groups: int, per_group: int, head_dim: int,
            rope: tuple[torch.Tensor, torch.Tensor], q_weight: torch.Tensor | None,
            k_weight: torch.Tensor | None, eps: float) -> QKV:
        """What attention does between `linear_qkv` and the kernel: qkv [N, G*(P+2)*d] in Megatron's
        per-group layout split into q, k, v, QK-norm (where weights are given) and RoPE on q and k."""
        n, d = qkv.shape[0], head_dim
        view = qkv.view(n, groups, per_group + 2, d)
        q = view[:, :, :per_group].reshape(n, groups * per_group, d)
        k, v = view[:, :, -2], view[:, :, -1]
        if q_weight is not None:
            q, k = self.rmsnorm(q, q_weight, eps), self.rmsnorm(k, k_weight, eps)
        cos, sin = rope
        return QKV(apply_rope(q, cos, sin).contiguous(), apply_rope(k, cos, sin).contiguous(), v.contiguous())

    def router(self, x: torch.Tensor, weight: torch.Tensor, topk: int, renormalize: bool) -> Routing:
        """Softmax over all experts in fp32, then top-k (renormalised if asked)."""
        probs = linear(x.float(), weight.float()).softmax(dim=-1)
        weights, ids = probs.topk(topk, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights.to(x.dtype), ids)

    def silu_mul(self, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation: h [n, 2F] (gate | up) -> silu(gate) * up [n, F]."""
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    def combine(self, ys: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """out[n] = sum_j weights[n, j] * ys[dest[n, j]]: ys [P, H] expert-sorted rows; dest, weights [N, k]."""
        n, k = dest.shape
        y = ys.index_select(0, dest.reshape(-1)).view(n, k, -1)
        return (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)


REFERENCE = ModelOps()


class UsesOps:
    """A module whose forward calls the model's small ops through `self.ops` (the reference until
    `MoETransformer.use_ops` points it elsewhere)."""

    ops: ModelOps = REFERENCE
