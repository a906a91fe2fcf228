"""Transformer building blocks with Megatron-core's module names.

Every module here is named so that `state_dict()` keys equal Megatron `GPTModel`'s under the
local (non-Transformer-Engine) layer spec. Layers hold their *local* shard: attention heads and
the dense MLP are split over ATP, routed experts over EP; the embedding, the output layer, the
router and the shared expert are replicated (small next to the experts, and it keeps sampling and
routing free of collectives).

Forward methods that may cross ranks are generators: they `yield` a `BoundaryPoint` right
before each collective, so a caller can run P's forward segment by segment (docs/design.md §6).
Driving a generator to its end (`run_to_end`) is the plain forward. Those primitives live in
`megatron_rollout.forward` (below both model and comm) and are re-exported here.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megatron_rollout.comm.facade import Comm, Shard
from megatron_rollout.forward import BoundaryPoint, Forward, Site, run_to_end  # noqa: F401 (re-exported)
from megatron_rollout.model.attention import AttentionBackend
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.ops import ROW_MULTIPLE, Routing, UsesOps, apply_rope, linear  # noqa: F401 (re-exported)
from megatron_rollout.types import Axis, Phase


class RMSNorm(UsesOps, nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rmsnorm(x, self.weight, self.eps)


class Linear(nn.Module):
    """`y = x @ weight.T`, no bias. An FP8 weight (see `fp8.py`) carries its scale alongside."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.fp8 = None  # an fp8.FP8Weight once quantised

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8.matmul(x)
        return linear(x, self.weight)


def rope_tables(positions: torch.Tensor, dim: int, base: float, dtype: torch.dtype):
    """cos, sin: [N, dim] for rotate-half RoPE, computed in fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class SelfAttention(UsesOps, nn.Module):
    """Grouped-query attention, heads split over ATP (column-parallel QKV, row-parallel proj).

    `linear_qkv` uses Megatron's per-query-group layout: for each local group, its query heads,
    then its key head, then its value head. A contiguous row block is therefore one ATP shard."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, device=None) -> None:
        super().__init__()
        if cfg.num_query_groups % shard.atp_size:
            raise ValueError(f"num_query_groups ({cfg.num_query_groups}) must divide by ATP "
                             f"({shard.atp_size})")
        self.layer, self.cfg = layer, cfg
        self.groups = cfg.num_query_groups // shard.atp_size
        self.per_group = cfg.heads_per_group
        d, dt = cfg.kv_channels, cfg.torch_dtype
        self.linear_qkv = Linear(cfg.hidden_size, self.groups * (self.per_group + 2) * d, dt, device)
        self.linear_proj = Linear(self.groups * self.per_group * d, cfg.hidden_size, dt, device)
        if cfg.qk_layernorm:
            self.q_layernorm = RMSNorm(d, cfg.layernorm_epsilon, dt, device)
            self.k_layernorm = RMSNorm(d, cfg.layernorm_epsilon, dt, device)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionBackend,
                comm: Comm, phase: Phase) -> Forward:
        n, d = x.shape[0], self.cfg.kv_channels
        qk_norm = (self.q_layernorm.weight, self.k_layernorm.weight, self.q_layernorm.eps) if self.cfg.qk_layernorm \
            else (None, None, self.cfg.layernorm_epsilon)
        q, k, v = self.ops.qkv(self.linear_qkv(x), self.groups, self.per_group, d, rope, *qk_norm)
        heads = attn.attend(self.layer, q, k, v)  # [N, hq, d]
        out = self.linear_proj(heads.reshape(n, self.groups * self.per_group * d))
        if comm.size(Axis.ATP) > 1:
            yield BoundaryPoint(self.layer, Site.ATTN_REDUCE)
            out = comm.all_reduce(out, Axis.ATP, phase)
        return out


def swiglu(fc1: "Linear", fc2: "Linear", x: torch.Tensor) -> torch.Tensor:
    gate, up = fc1(x).chunk(2, dim=-1)
    return fc2(F.silu(gate) * up)


class MLP(nn.Module):
    """SwiGLU with gate and up fused in `linear_fc1` (gate rows first), split `parts` ways."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype, parts: int = 1, device=None) -> None:
        super().__init__()
        if ffn % parts:
            raise ValueError(f"FFN size {ffn} must divide by ATP ({parts})")
        self.linear_fc1 = Linear(hidden, 2 * ffn // parts, dtype, device)
        self.linear_fc2 = Linear(ffn // parts, hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(self.linear_fc1, self.linear_fc2, x)


class DenseMLP(MLP):
    """A dense layer's MLP, split over ATP with an all-reduce (Megatron's TP MLP)."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, device=None) -> None:
        super().__init__(cfg.hidden_size, cfg.ffn_hidden_size, cfg.torch_dtype, shard.atp_size, device)
        self.layer = layer

    def forward(self, x: torch.Tensor, comm: Comm, phase: Phase) -> Forward:  # type: ignore[override]
        out = swiglu(self.linear_fc1, self.linear_fc2, x)
        if comm.size(Axis.ATP) > 1:
            yield BoundaryPoint(self.layer, Site.MLP_REDUCE)
            out = comm.all_reduce(out, Axis.ATP, phase)
        return out


class Router(UsesOps, nn.Module):
    def __init__(self, cfg: ModelConfig, device=None) -> None:
        super().__init__()
        self.topk, self.renormalize = cfg.moe_router_topk, cfg.moe_renormalize_topk
        self.weight = nn.Parameter(torch.empty(cfg.num_moe_experts, cfg.hidden_size,
                                               dtype=cfg.torch_dtype, device=device))

    def forward(self, x: torch.Tensor) -> Routing:
        """Softmax over all experts in fp32, then top-k. Returns weights [N, k] (x's dtype) and
        expert ids [N, k]."""
        return self.ops.router(x, self.weight, self.topk, self.renormalize)


class Experts(UsesOps, nn.Module):
    """This rank's routed experts, `local_experts.K` = global expert `first + K`."""

    def __init__(self, cfg: ModelConfig, shard: Shard, device=None) -> None:
        super().__init__()
        if cfg.num_moe_experts % shard.ep_size:
            raise ValueError(f"num_moe_experts ({cfg.num_moe_experts}) must divide by EP ({shard.ep_size})")
        self.num_local = cfg.num_moe_experts // shard.ep_size
        self.first = shard.ep_rank * self.num_local
        self.local_experts = nn.ModuleList(
            MLP(cfg.hidden_size, cfg.moe_ffn_hidden_size, cfg.torch_dtype, device=device)
            for _ in range(self.num_local))
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # see restack()
        self._stacked_fp8 = None  # `fp8.stack_experts_fp8`: the experts' FP8 weights, stacked

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: [n, H] sorted by local expert, `counts[K]` rows for expert K. Returns [n, H]."""
        if sum(counts) == 0:
            return x.new_zeros(x.shape)
        if x.is_cuda and self.stacked() is not None:  # GPU fast path: one grouped GEMM per projection
            offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32).to(x.device)
            return self.grouped_offsets(x, offsets)
        return torch.cat([self.local_experts[k](part) for k, part in enumerate(x.split(counts)) if counts[k]])

    # -- grouped-GEMM fast path (CUDA, bf16) -------------------------------------------------
    def restack(self) -> None:
        """Make every expert's `linear_fc1/fc2.weight` a view of one stacked tensor per projection
        ([E, 2F, H] and [E, H, F]), so `update_weights` (an in-place copy per Megatron name) lands
        in the tensors the grouped GEMM reads, at stable addresses. Called by the CUDA runner; the
        portable path never needs it. `WeightStore.bind` re-points parameters and undoes it
        (`stacked()` then returns None and the per-expert path runs). Experts already stacked (by
        `adopt`, over a trainer's storage) stay where they are."""
        if self.aliased():
            return
        fc1 = torch.stack([e.linear_fc1.weight.detach() for e in self.local_experts])
        fc2 = torch.stack([e.linear_fc2.weight.detach() for e in self.local_experts])
        self.adopt(fc1, fc2)

    def adopt(self, fc1: torch.Tensor, fc2: torch.Tensor) -> None:
        """Point expert K's `linear_fc1/fc2.weight` at `fc1[K]` and `fc2[K]` ([E, 2F, H], [E, H, F],
        contiguous): the stack the grouped paths read (`weights.megatron_experts` hands over a
        trainer's own)."""
        want = (self.num_local, *self.local_experts[0].linear_fc1.weight.shape)
        if tuple(fc1.shape) != want or not fc1.is_contiguous() or not fc2.is_contiguous():
            raise ValueError(f"expert stacks must be contiguous {want} and its fc2 counterpart, got "
                             f"{tuple(fc1.shape)} (contiguous={fc1.is_contiguous()}), {tuple(fc2.shape)}")
        for i, e in enumerate(self.local_experts):
            e.linear_fc1.weight.data = fc1[i]
            e.linear_fc2.weight.data = fc2[i]
        self._stacked = (fc1, fc2)

    def aliased(self) -> bool:
        """Whether the experts' weights are still views of the stack (`restack`, `adopt`)."""
        st = self._stacked
        if st is None:
            return False
        first, last = self.local_experts[0], self.local_experts[-1]
        return (first.linear_fc1.weight.data_ptr() == st[0].data_ptr()
                and last.linear_fc2.weight.data_ptr() == st[1][-1].data_ptr())

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stacked weights when they still alias the experts' parameters (bf16, not FP8)."""
        st = self._stacked
        if st is None or st[0].dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
            return None
        first = self.local_experts[0]
        if first.linear_fc1.fp8 is not None or first.linear_fc2.fp8 is not None or not self.aliased():
            return None
        return st

    def grouped_offsets(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x: [n, H] sorted by local expert; offsets: [E] int32 cumulative row counts (on x's
        device, so no host sync). Returns [n, H]. Needs `stacked()`."""
        st = self.stacked()
        if st is None:
            raise RuntimeError("grouped_offsets needs stacked bf16 expert weights: call restack() on a CUDA "
                               "model (after any WeightStore.bind)")
        fc1, fc2 = st
        h = torch._grouped_mm(x, fc1.transpose(1, 2), offs=offsets)  # [n, 2F]
        return torch._grouped_mm(self.activation(h), fc2.transpose(1, 2), offs=offsets)  # [n, H]

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        """SwiGLU between the grouped projections: h [n, 2F] (gate | up) -> silu(gate) * up [n, F]."""
        return self.ops.silu_mul(h)


@dataclass(frozen=True)
class LayerParts:
    """The attention and router classes a layer builds; `model.parts.layer_parts(cfg)` picks them
    (multi-latent attention, DeepSeek's scored router) without this module importing those."""

    attention: type[nn.Module] = SelfAttention
    router: type[nn.Module] = Router


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, device=None,
                 router: type[nn.Module] = Router) -> None:
        super().__init__()
        self.layer = layer
        self.router = router(cfg, device)
        self.experts = Experts(cfg, shard, device)
        if cfg.moe_shared_expert_intermediate_size:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size,
                                      cfg.torch_dtype, device=device)

    def forward(self, x: torch.Tensor, comm: Comm, phase: Phase) -> Forward:
        weights, ids = self.router(x)
        yield BoundaryPoint(self.layer, Site.MOE_EXCHANGE)
        out = yield from comm.exchange(phase).run(x, ids, weights, self.experts, self.layer)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        return out


class TransformerLayer(UsesOps, nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, shard: Shard, device=None,
                 parts: LayerParts = LayerParts()) -> None:
        super().__init__()
        dt, eps = cfg.torch_dtype, cfg.layernorm_epsilon
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dt, device)
        self.self_attention = parts.attention(cfg, layer, shard, device)
        self.pre_mlp_layernorm = RMSNorm(cfg.hidden_size, eps, dt, device)
        moe = cfg.is_moe_layer(layer)
        self.mlp = MoELayer(cfg, layer, shard, device, parts.router) if moe else DenseMLP(cfg, layer, shard, device)

    def forward(self, h: torch.Tensor, rope, attn: AttentionBackend, comm: Comm, phase: Phase) -> Forward:
        h, m = yield from self.residual(h, None, rope, attn, comm, phase)
        return h + m

    def residual(self, h: torch.Tensor, delta: torch.Tensor | None, rope, attn: AttentionBackend, comm: Comm,
                 phase: Phase) -> Forward:
        """This layer on the residual stream `h + delta` (delta: the previous layer's MLP output, not
        yet added, or None). Returns (h, this layer's MLP output), unadded, so that the caller adds
        them together with the next layer's first norm (`ModelOps.add_rmsnorm`)."""
        norm, ops = self.input_layernorm, self.ops
        if delta is None:
            x = ops.rmsnorm(h, norm.weight, norm.eps)
        else:
            h, x = ops.add_rmsnorm(h, delta, norm.weight, norm.eps)
        a = yield from self.self_attention(x, rope, attn, comm, phase)
        h, x = ops.add_rmsnorm(h, a, self.pre_mlp_layernorm.weight, self.pre_mlp_layernorm.eps)
        m = yield from self.mlp(x, comm, phase)
        return h, m
