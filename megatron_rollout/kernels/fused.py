"""Fused Triton kernels for a decode step's small operations, the model's ops interface implemented by them.

Why: at decode sizes a layer's GEMMs are short and the step is dominated by small eager kernels
(RMSNorm is six, RoPE about five each for q and k, the router's fp32 linear + softmax + top-k +
renormalisation about eight, the residual adds): ~0.2 ms per layer inside a CUDA graph at batch 1.
Four kernels replace them, one launch each:

- `rmsnorm`: `weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)` per row (an fp32 weight, a
  Megatron trainer's norm shared as it is: the fp32 product, rounded once, as `ModelOps.rmsnorm`);
- `add_rmsnorm`: `h = h + delta` and `rmsnorm(h)` in one pass (between attention and MLP, and
  between layers: the model carries each layer's MLP output to the next layer's norm);
- `qkv_norm_rope`: from the QKV projection's per-query-group layout (each group's query heads,
  then its key head, then its value head) to contiguous q [N, hq, d], k, v [N, hkv, d], with the
  per-head QK-norm and rotate-half RoPE of `layers.apply_rope` (cos/sin from `layers.rope_tables`);
- `router_topk`: logits (bf16 operands, fp32 accumulation), softmax, top-k and optional
  renormalisation, per 16-token block holding all experts.

Two more for the routed experts' grouped path (`kernels.moe.routed_experts`), where a prefill's
elementwise passes over [tokens x top-k, ...] cost as much as a grouped GEMM:

- `silu_mul`: the SwiGLU between the two grouped GEMMs (`Experts.activation`: silu(gate) * up
  from the fc1 output [pairs, 2F]) in one pass instead of a silu over a strided half and a multiply;
- `moe_combine`: the expert outputs back to token order, times the routing weights, summed over
  the k pairs of each token (fp32 sum, one rounding) in one pass instead of a gather, a multiply
  and a sum.

Exactness against the portable path (the references below run `model.layers`' own forwards):
every elementwise step does the reference's fp32 operation and rounds to bf16 where it does
(round to nearest even, written out as bit arithmetic so that Triton's interpreter, whose
float-to-bf16 conversion truncates, computes the same bits as the GPU). What differs is only the
order of the fp32 sums (mean of squares, softmax denominator, the router's dot products); a
different fp32 sum can move a bf16 result by one unit in the last place on a few elements, so
tests state tolerances and also count bitwise-equal elements. The router chooses on the fp32
logits: on distinct values it picks the same experts as `torch.topk` over the probabilities and
in the same (descending) order; on exactly equal logits it takes the lowest expert id first
(`torch.topk` does not specify an order); values within the fp32 rounding of the dot products
(~1e-6 relative) can come out in either order. NaN logits give undefined but in-range ids.

`TritonOps` holds these kernels behind `model.ops.ModelOps`, the interface every layer calls its
small ops through; `install_fused_ops(model)` chooses it for a model (`MoETransformer.use_ops`), so
the model code is one and a model without it runs the reference; `uninstall_fused_ops` restores
the reference. The kernels run on CUDA, or on CPU under `TRITON_INTERPRET=1` (how the tests check
them). Every fused op falls back to the reference when autograd needs it, the dtype is not bf16,
or the shapes do not fit the kernels. On CUDA, installing first runs `self_check` (each kernel once
at the model's sizes against its reference): a kernel that does not build or disagrees on the
device leaves the model on the reference.

Left out: fp16/fp32 kernels, fusing the RoPE output into the KV store, the gather into expert
order (the sort of a decode batch is `kernels.expert_sort`), and backward passes (inference only).
"""
from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch

from megatron_rollout.kernels import pdl
from megatron_rollout.model.layers import Experts, Router, SelfAttention, TransformerLayer, rope_tables
from megatron_rollout.model.ops import QKV, REFERENCE, AddNorm, ModelOps, Routing  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CI and CPU-only installs: the reference ops and the "torch" backend still work
    triton = None

BACKENDS = ("auto", "triton", "torch")
LAUNCHES: dict[str, int] = {"rmsnorm": 0, "add_rmsnorm": 0, "qkv_norm_rope": 0, "router_topk": 0, "silu_mul": 0,
                            "moe_combine": 0}
"""Kernel launches per op (host-side count; a fallback to the reference does not count): lets a
test see that the kernels, not the references, ran."""
ROUTER_BLOCK_M = 16
"""Tokens per router program (tl.dot's minimum M)."""


class RouterTiles(NamedTuple):
    """Launch shape of the router kernel: the k-tile cap (hidden columns per step), warps, stages,
    and `split`: programs per 16-row block, each reading 1/split of the weight (1: one program
    reads all of it; more: `_router_split_kernel`, whose last program per block routes; up to
    `SPLIT_MAX_ROWS` rows)."""

    block_k: int = 128
    warps: int = 4
    stages: int = 4
    split: int = 8


ROUTER_TILES = RouterTiles()
"""Eight programs per row block: 11.6 / 11.9 us at 1 / 64 rows against 13.8 / 13.6 for one program
reading the whole weight (H200, `bench.kernels`' router grid, commit a5b1293; docs/kernels.md)."""
SPLIT_MAX_ROWS = 64
"""Most rows the split router serves; more take one program per block whatever `split` says: at
4,096 rows the split took 50.5 us against 21.6 (the blocks alone fill the GPU, and the logits
round trip costs; H200, `bench.kernels`, commit 77fa576)."""


def interpreting() -> bool:
    """True under Triton's CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available() -> bool:
    return triton is not None


# -- references: the model's own math ---------------------------------------------------------

def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return REFERENCE.rmsnorm(x, weight, eps)


def add_rmsnorm_ref(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> AddNorm:
    return REFERENCE.add_rmsnorm(h, delta, weight, eps)


def qkv_norm_rope_ref(qkv: torch.Tensor, groups: int, per_group: int, head_dim: int, cos: torch.Tensor,
                      sin: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                      eps: float) -> QKV:
    return REFERENCE.qkv(qkv, groups, per_group, head_dim, (cos, sin), q_weight, k_weight, eps)


def router_ref(x: torch.Tensor, weight: torch.Tensor, topk: int, renormalize: bool) -> Routing:
    return REFERENCE.router(x, weight, topk, renormalize)


def silu_mul_ref(h: torch.Tensor) -> torch.Tensor:
    return REFERENCE.silu_mul(h)


def moe_combine_ref(ys: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return REFERENCE.combine(ys, dest, weights)


# -- Triton kernels ---------------------------------------------------------------------------

if triton is not None:
    from megatron_rollout.kernels.pdl import entry as pdl_entry

    _NEG_INF = tl.constexpr(float("-inf"))

    @triton.jit
    def _bf16(x):
        """fp32 -> the fp32 value of the nearest bf16 (ties to even), as integer arithmetic."""
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return b.to(tl.float32, bitcast=True)

    @triton.jit(do_not_specialize=["n_rows"])  # one variant per shape, whatever the batch
    def _rmsnorm_kernel(X, Dlt, W, Y, Hout, eps, inv_n, n_rows, stride_x, stride_d, stride_y, stride_h,
                        N_COLS: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, ROWS: tl.constexpr,
                        W_FP32: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program i: rows [i * ROWS, (i + 1) * ROWS) of X, each normalised on its own."""
        pdl_entry(PDL)
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        cmask = cols < N_COLS
        mask = (row < n_rows)[:, None] & cmask[None, :]
        x = tl.load(X + row[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            d = tl.load(Dlt + row[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            x = _bf16(x + d)
            tl.store(Hout + row[:, None] * stride_h + cols[None, :], x.to(Hout.dtype.element_ty), mask=mask)
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_n + eps)[:, None]
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        y = _normed(x * r, w, W_FP32)
        tl.store(Y + row[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _normed(xr, w, W_FP32: tl.constexpr):
        """The weight times the normalised fp32 row: a bf16 weight scales the row rounded to bf16, an
        fp32 weight the fp32 row (`ModelOps.rmsnorm`); one rounding of the product."""
        if W_FP32:
            return _bf16(w * xr)
        return _bf16(w * _bf16(xr))

    @triton.jit
    def _head_norm(x, xr, W, c, rot, eps, inv_d, W_FP32: tl.constexpr):
        """RMSNorm of each row of x [R, D]; xr holds the same rows at the rotated columns."""
        r = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_d + eps)[:, None]
        w = tl.load(W + c).to(tl.float32)[None, :]
        wr = tl.load(W + rot).to(tl.float32)[None, :]
        return _normed(x * r, w, W_FP32), _normed(xr * r, wr, W_FP32)

    @triton.jit
    def _rope(x, xr, cos, sin, first):
        """x * cos + cat(-x2, x1) * sin, each product and the sum rounded to bf16 as torch does
        (cos, sin: one row per row of x)."""
        a = _bf16(x * cos)
        b = _bf16(xr * sin)
        return _bf16(a + tl.where(first[None, :], -b, b))

    @triton.jit(do_not_specialize=["n_tokens"])
    def _qkv_rope_kernel(QKV_, Q, K, V, Cos, Sin, QW, KW, eps, inv_d, n_tokens, stride_qkv, stride_cos, stride_sin,
                         GROUPS: tl.constexpr, PER: tl.constexpr, PER_P: tl.constexpr, D: tl.constexpr,
                         NORM: tl.constexpr, TOK: tl.constexpr, W_FP32: tl.constexpr = False,
                         PDL: tl.constexpr = False):
        """Program (token block, group): TOK tokens' query heads of one group as [TOK * PER_P, D]
        rows, then their key heads [TOK, D], then their value heads copied. Every load is issued
        before the first store (a load after a store to another tensor must wait for it: 5.7 against
        6.7 us at 256 tokens, 56.5 against 57.1 at 4,096, `bench.kernels`, 2026-12-02)."""
        pdl_entry(PDL)
        g = tl.program_id(1)
        c = tl.arange(0, D)
        rot = (c + D // 2) % D
        first = c < D // 2
        # each token's cos and sin, read once: [TOK, D], then one row per query head
        t = tl.program_id(0).to(tl.int64) * TOK + tl.arange(0, TOK)
        kmask = (t < n_tokens)[:, None]
        cos_t = tl.load(Cos + t[:, None] * stride_cos + c[None, :], mask=kmask, other=0.0).to(tl.float32)
        sin_t = tl.load(Sin + t[:, None] * stride_sin + c[None, :], mask=kmask, other=0.0).to(tl.float32)
        cos = tl.reshape(tl.broadcast_to(cos_t[:, None, :], (TOK, PER_P, D)), (TOK * PER_P, D))
        sin = tl.reshape(tl.broadcast_to(sin_t[:, None, :], (TOK, PER_P, D)), (TOK * PER_P, D))
        r = tl.arange(0, TOK * PER_P)
        n = tl.program_id(0).to(tl.int64) * TOK + r // PER_P
        h = r % PER_P
        qmask = ((h < PER) & (n < n_tokens))[:, None]
        base = QKV_ + n[:, None] * stride_qkv + g * ((PER + 2) * D)
        kb = QKV_ + t[:, None] * stride_qkv + g * ((PER + 2) * D) + PER * D
        x = tl.load(base + h[:, None] * D + c[None, :], mask=qmask, other=0.0).to(tl.float32)
        xr = tl.load(base + h[:, None] * D + rot[None, :], mask=qmask, other=0.0).to(tl.float32)
        kx = tl.load(kb + c[None, :], mask=kmask, other=0.0).to(tl.float32)
        kxr = tl.load(kb + rot[None, :], mask=kmask, other=0.0).to(tl.float32)
        vx = tl.load(kb + D + c[None, :], mask=kmask)
        if NORM:
            x, xr = _head_norm(x, xr, QW, c, rot, eps, inv_d, W_FP32)
        q = _rope(x, xr, cos, sin, first)
        tl.store(Q + n[:, None] * (GROUPS * PER * D) + (g * PER + h)[:, None] * D + c[None, :],
                 q.to(Q.dtype.element_ty), mask=qmask)
        # their key heads: [TOK, D]
        if NORM:
            kx, kxr = _head_norm(kx, kxr, KW, c, rot, eps, inv_d, W_FP32)
        k = _rope(kx, kxr, cos_t, sin_t, first)
        tl.store(K + t[:, None] * (GROUPS * D) + g * D + c[None, :], k.to(K.dtype.element_ty), mask=kmask)
        # their value heads, copied
        tl.store(V + t[:, None] * (GROUPS * D) + g * D + c[None, :], vx, mask=kmask)

    @triton.jit
    def _router_logits(X, W, rows, rmask, r64, stride_x, cols, cmask, H: tl.constexpr, BM: tl.constexpr,
                       N: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr):
        """[BM, N] fp32 logits of `rows` for the experts `cols`, k-tile by k-tile in order."""
        kk = tl.arange(0, BK)
        acc = tl.zeros([BM, N], tl.float32)
        for k0 in range(0, H, BK):
            kmask = (k0 + kk) < H
            x = tl.load(X + r64[:, None] * stride_x + k0 + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                        other=0.0)
            w = tl.load(W + cols[:, None] * H + k0 + kk[None, :], mask=cmask[:, None] & kmask[None, :], other=0.0)
            if DOT_FP32:  # the interpreter's tl.dot misreads bf16 operands: multiply their fp32 values
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:  # bf16 products are exact in fp32; the tensor cores accumulate in fp32
                acc += tl.dot(x, tl.trans(w))
        return acc

    @triton.jit
    def _route(logits, r64, rmask, Wout, Ids, E: tl.constexpr, E_P: tl.constexpr, TOPK: tl.constexpr,
               TOPK_P: tl.constexpr, RENORM: tl.constexpr, BM: tl.constexpr):
        """Softmax, top-k and renormalisation of [BM, E_P] logits; stores weights and ids."""
        e = tl.arange(0, E_P)
        emask = e < E
        logits = tl.where(emask[None, :], logits, _NEG_INF)
        m = tl.max(logits, axis=1)
        p = tl.exp(logits - m[:, None])
        probs = tl.math.div_rn(p, tl.sum(p, axis=1)[:, None])  # IEEE division, as torch's softmax
        kcol = tl.arange(0, TOPK_P)
        top_w = tl.zeros([BM, TOPK_P], tl.float32)
        top_i = tl.zeros([BM, TOPK_P], tl.int32)
        vals = logits
        for i in tl.static_range(TOPK):
            best = tl.max(vals, axis=1)
            idx = tl.min(tl.where(vals == best[:, None], e[None, :], E_P), axis=1)  # lowest id on exact ties
            idx = tl.minimum(idx, E - 1)  # NaN rows: keep ids in range
            hit = e[None, :] == idx[:, None]
            top_w = tl.where(kcol[None, :] == i, tl.sum(tl.where(hit, probs, 0.0), axis=1)[:, None], top_w)
            top_i = tl.where(kcol[None, :] == i, idx[:, None], top_i)
            vals = tl.where(hit, _NEG_INF, vals)
        if RENORM:
            top_w = tl.math.div_rn(top_w, tl.sum(top_w, axis=1)[:, None])
        omask = rmask[:, None] & (kcol[None, :] < TOPK)
        out = r64[:, None] * TOPK + kcol[None, :]
        tl.store(Wout + out, _bf16(top_w).to(Wout.dtype.element_ty), mask=omask)
        tl.store(Ids + out, top_i.to(tl.int64), mask=omask)

    @triton.jit(do_not_specialize=["n_rows"])
    def _router_kernel(X, W, Wout, Ids, n_rows, stride_x,
                       H: tl.constexpr, E: tl.constexpr, E_P: tl.constexpr, TOPK: tl.constexpr,
                       TOPK_P: tl.constexpr, RENORM: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                       DOT_FP32: tl.constexpr, PDL: tl.constexpr = False):
        """One program per BM rows: every expert's logits, then the routing."""
        pdl_entry(PDL)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        rmask = rows < n_rows
        r64 = rows.to(tl.int64)
        e = tl.arange(0, E_P)
        logits = _router_logits(X, W, rows, rmask, r64, stride_x, e, e < E, H, BM, E_P, BK, DOT_FP32)
        _route(logits, r64, rmask, Wout, Ids, E, E_P, TOPK, TOPK_P, RENORM, BM)

    @triton.jit(do_not_specialize=["n_rows"])
    def _router_split_kernel(X, W, Logits, Arrived, Wout, Ids, n_rows, stride_x,
                             H: tl.constexpr, E: tl.constexpr, E_P: tl.constexpr, ES: tl.constexpr,
                             TOPK: tl.constexpr, TOPK_P: tl.constexpr, RENORM: tl.constexpr, BM: tl.constexpr,
                             BK: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr = False):
        """Program (b, s): the logits of row block b for experts s*ES.. (a slice of the weight), to
        fp32 scratch; the block's last program to arrive (a counter per block) routes its rows."""
        pdl_entry(PDL)
        b = tl.program_id(0)
        rows = b * BM + tl.arange(0, BM)
        rmask = rows < n_rows
        r64 = rows.to(tl.int64)
        cols = tl.program_id(1) * ES + tl.arange(0, ES)
        part = _router_logits(X, W, rows, rmask, r64, stride_x, cols, cols < E, H, BM, ES, BK, DOT_FP32)
        tl.store(Logits + r64[:, None] * E_P + cols[None, :], part)  # scratch rows cover whole blocks
        tl.debug_barrier()  # every thread's logits are written before the counter says so
        arrived = tl.atomic_add(Arrived + b, 1, sem="acq_rel", scope="gpu")
        if arrived == E_P // ES - 1:
            e = tl.arange(0, E_P)
            logits = tl.load(Logits + r64[:, None] * E_P + e[None, :], cache_modifier=".cg")
            _route(logits, r64, rmask, Wout, Ids, E, E_P, TOPK, TOPK_P, RENORM, BM)

    @triton.jit(do_not_specialize=["n_rows"])
    def _silu_mul_kernel(H, A, n_rows, stride_h, stride_a, F: tl.constexpr, BLOCK: tl.constexpr,
                         ROWS: tl.constexpr, PDL: tl.constexpr = False):
        """Rows r of program i's block: a[r, c] = bf16(bf16(silu(gate)) * up) with gate = h[r, c],
        up = h[r, F + c]."""
        pdl_entry(PDL)
        row = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
        c = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
        mask = (row < n_rows) & (c < F)
        g = tl.load(H + row * stride_h + c, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(H + row * stride_h + F + c, mask=mask, other=0.0).to(tl.float32)
        s = _bf16(tl.math.div_rn(g, 1.0 + tl.exp(-g)))
        tl.store(A + row * stride_a + c, _bf16(s * u).to(A.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_kernel(Y, Dest, W, Out, stride_y, stride_o, K: tl.constexpr, HID: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Token n: out[n] = bf16(sum_j bf16(ys[dest[n, j]] * w[n, j])), the sum in fp32 in j order."""
        pdl_entry(PDL)
        n = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < HID
        acc = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(K):
            row = tl.load(Dest + n * K + j).to(tl.int64)
            w = tl.load(W + n * K + j).to(tl.float32)
            y = tl.load(Y + row * stride_y + c, mask=mask, other=0.0).to(tl.float32)
            acc += _bf16(y * w)
        tl.store(Out + n * stride_o + c, _bf16(acc).to(Out.dtype.element_ty), mask=mask)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _runnable(*tensors: torch.Tensor, norm_weights: tuple[torch.Tensor, ...] = ()) -> bool:
    """The kernels can run on these tensors: Triton present, bf16 (`norm_weights`: bf16 or fp32), on
    CUDA (or interpreting), no autograd."""
    grad = torch.is_grad_enabled()

    def fits(t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
        return t.dtype in dtypes and not (grad and t.requires_grad) and (t.is_cuda or interpreting())

    return (triton is not None and all(fits(t, (torch.bfloat16,)) for t in tensors)
            and all(fits(w, (torch.bfloat16, torch.float32)) for w in norm_weights))


def _empty(out: torch.Tensor | None, shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    dtype = dtype or like.dtype
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {tuple(shape)}, got "
                         f"{out.dtype} {tuple(out.shape)} (contiguous={out.is_contiguous()})")
    return out


def _norm_warps(block: int) -> int:
    return max(1, min(8, block // 256))


BLOCK_MIN_ROWS = 256
"""From this many rows (tokens) the norm and the QKV norm + RoPE kernels give each program a block
of rows (`NORM_BLOCK_ROWS`, `QKV_BLOCK_TOKENS`: one, since the sweep below, like every decode size)."""
NORM_BLOCK_ROWS = 1
"""Rows per `_rmsnorm_kernel` program from `BLOCK_MIN_ROWS` rows. One: blocks of 2, 4 and 8 rows
were slower or within 5% at 256, 1,024 and 4,096 rows (`bench.kernels --row-blocks 1,2,4,8`, H200,
2026-12-02, graph us per call at 4,096 rows: rmsnorm 11.3 / 10.8 / 11.6 / 12.9, add_rmsnorm
19.9 / 20.7 / 21.0 / 23.0)."""


def _norm_rows(n: int) -> int:
    return NORM_BLOCK_ROWS if n >= BLOCK_MIN_ROWS else 1


# -- kernel wrappers (fall back to the references where the kernels do not apply) --------------

def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., H] (one launch). `out` (optional): the result tensor."""
    hidden = x.shape[-1]
    if not _runnable(x, norm_weights=(weight,)) or x.numel() == 0 or weight.shape != (hidden,):
        ref = rmsnorm_ref(x, weight, eps)
        return ref if out is None else out.copy_(ref)
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = _empty(out, x.shape, x)
    block, rows = _pow2(hidden), _norm_rows(x2.shape[0])
    LAUNCHES["rmsnorm"] += 1
    _rmsnorm_kernel[(triton.cdiv(x2.shape[0], rows),)](
        x2, x2, weight, y, y, eps, 1.0 / hidden, x2.shape[0], x2.stride(0), x2.stride(0), hidden, hidden,
        N_COLS=hidden, BLOCK=block, HAS_DELTA=False, ROWS=rows, W_FP32=weight.dtype == torch.float32,
        num_warps=_norm_warps(block * rows),
        enable_fp_fusion=False, **pdl.options(x.device))
    return y


def add_rmsnorm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                out_h: torch.Tensor | None = None, out: torch.Tensor | None = None) -> AddNorm:
    """(h + delta, rmsnorm(h + delta)) for h, delta [N, H] (one launch, one read of each)."""
    hidden = h.shape[-1]
    if (not _runnable(h, delta, norm_weights=(weight,)) or h.numel() == 0 or h.shape != delta.shape or h.dim() != 2
            or weight.shape != (hidden,)):
        ref = add_rmsnorm_ref(h, delta, weight, eps)
        if out_h is None and out is None:
            return ref
        return AddNorm(ref.h if out_h is None else out_h.copy_(ref.h),
                       ref.normed if out is None else out.copy_(ref.normed))
    if h.stride(-1) != 1:
        h = h.contiguous()
    if delta.stride(-1) != 1:
        delta = delta.contiguous()
    hs, y = _empty(out_h, h.shape, h), _empty(out, h.shape, h)
    block, rows = _pow2(hidden), _norm_rows(h.shape[0])
    LAUNCHES["add_rmsnorm"] += 1
    _rmsnorm_kernel[(triton.cdiv(h.shape[0], rows),)](
        h, delta, weight, y, hs, eps, 1.0 / hidden, h.shape[0], h.stride(0), delta.stride(0), hidden, hidden,
        N_COLS=hidden, BLOCK=block, HAS_DELTA=True, ROWS=rows, W_FP32=weight.dtype == torch.float32,
        num_warps=_norm_warps(block * rows),
        enable_fp_fusion=False, **pdl.options(h.device))
    return AddNorm(hs, y)


QKV_BLOCK_TOKENS = 1
"""Tokens per `_qkv_rope_kernel` program from `BLOCK_MIN_ROWS` tokens. One: at 4,096 tokens 1, 2,
4 and 8 tokens took 56.5 / 61.3 / 55.5 / 57.3 us, at 256 tokens 5.7 / 5.8 / 5.9 / 6.0
(`bench.kernels --row-blocks`, 2026-12-02)."""


def qkv_norm_rope(qkv: torch.Tensor, groups: int, per_group: int, head_dim: int, cos: torch.Tensor,
                  sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  eps: float = 1e-6, out: QKV | None = None) -> QKV:
    """Split the QKV projection's output [N, G*(P+2)*d] into q [N, G*P, d], k, v [N, G, d], with
    QK-norm (when the weights are given) and RoPE applied (one launch)."""
    n, d = qkv.shape[0], head_dim
    weights = [w for w in (q_weight, k_weight) if w is not None]
    fits = (qkv.dim() == 2 and qkv.shape[1] == groups * (per_group + 2) * d and d >= 2 and d == _pow2(d)
            and cos.shape == (n, d) and sin.shape == (n, d) and cos.stride(-1) == 1 and sin.stride(-1) == 1
            and all(w.shape == (d,) for w in weights) and (q_weight is None) == (k_weight is None)
            and len({w.dtype for w in weights}) <= 1)
    if not fits or not _runnable(qkv, cos, sin, norm_weights=tuple(weights)) or n == 0:
        ref = qkv_norm_rope_ref(qkv, groups, per_group, d, cos, sin, q_weight, k_weight, eps)
        return ref if out is None else QKV(*(o.copy_(r) for o, r in zip(out, ref)))
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = _empty(out.q if out else None, (n, groups * per_group, d), qkv)
    k = _empty(out.k if out else None, (n, groups, d), qkv)
    v = _empty(out.v if out else None, (n, groups, d), qkv)
    norm = q_weight is not None
    qw, kw = (q_weight, k_weight) if norm else (cos, cos)  # unused pointers when NORM is off
    LAUNCHES["qkv_norm_rope"] += 1
    tok = QKV_BLOCK_TOKENS if n >= BLOCK_MIN_ROWS else 1
    rows = tok * _pow2(per_group)
    _qkv_rope_kernel[(triton.cdiv(n, tok), groups)](
        qkv, q, k, v, cos, sin, qw, kw, eps, 1.0 / d, n, qkv.stride(0), cos.stride(0), sin.stride(0), GROUPS=groups,
        PER=per_group, PER_P=_pow2(per_group), D=d, NORM=norm, TOK=tok,
        W_FP32=norm and q_weight.dtype == torch.float32,
        num_warps=max(1, min(8, d * rows // 256)) if d * rows >= 1024 else 1, enable_fp_fusion=False,
        **pdl.options(qkv.device))
    return QKV(q, k, v)


def router_topk(x: torch.Tensor, weight: torch.Tensor, topk: int, renormalize: bool,
                out: Routing | None = None, tiles: RouterTiles = ROUTER_TILES) -> Routing:
    """Softmax over `weight @ x` (fp32), top-k, optional renormalisation (one launch). x: [N, H]
    bf16, weight: [E, H]. Returns weights [N, k] (x's dtype) and ids [N, k] int64. `tiles`: the
    launch shape (`bench.kernels --router-tiles` times a grid of them)."""
    experts, hidden = weight.shape[0], x.shape[-1]
    fits = x.dim() == 2 and weight.shape == (experts, hidden) and 0 < topk <= experts <= 256 and hidden >= 16
    if not fits or not _runnable(x, weight) or x.shape[0] == 0:
        ref = router_ref(x, weight, topk, renormalize)
        return ref if out is None else Routing(out.weights.copy_(ref.weights), out.ids.copy_(ref.ids))
    n = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    w_out = _empty(out.weights if out else None, (n, topk), x)
    ids = _empty(out.ids if out else None, (n, topk), x, torch.int64)
    bk = min(tiles.block_k, _pow2(hidden))
    e_p = max(16, _pow2(experts))
    split = min(_pow2(max(1, tiles.split)), e_p // 16) if n <= SPLIT_MAX_ROWS else 1  # >= 16 experts a slice
    blocks = triton.cdiv(n, ROUTER_BLOCK_M)
    shape = dict(H=hidden, E=experts, E_P=e_p, TOPK=topk, TOPK_P=_pow2(topk), RENORM=bool(renormalize),
                 BM=ROUTER_BLOCK_M, BK=bk, DOT_FP32=interpreting(), num_warps=tiles.warps, num_stages=tiles.stages,
                 **pdl.options(x.device))
    LAUNCHES["router_topk"] += 1
    if split == 1:
        _router_kernel[(blocks,)](x, weight, w_out, ids, n, x.stride(0), **shape)
    else:
        logits = torch.empty(blocks * ROUTER_BLOCK_M, e_p, dtype=torch.float32, device=x.device)
        arrived = torch.zeros(blocks, dtype=torch.int32, device=x.device)  # per call: P and D may route at once
        _router_split_kernel[(blocks, split)](x, weight, logits, arrived, w_out, ids, n, x.stride(0),
                                             ES=e_p // split, **shape)
    return Routing(w_out, ids)


SILU_BLOCK_ROWS = 1
"""(token, expert) rows per `_silu_mul_kernel` program from `SILU_BLOCK_MIN_ROWS` rows. One: at
4,096 tokens (32,768 rows) 1, 2, 4 and 8 rows took 54.4 / 62.7 / 67.6 / 108.8 us
(`bench.kernels --row-blocks`, 2026-12-02)."""
SILU_BLOCK_MIN_ROWS = 4096
"""Past every decode graph's rows (256 rows x top-8 = 2,048): decode keeps one row per program."""


def silu_mul(h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for h [n, 2F] = (gate | up) -> [n, F] (one launch, one read of h)."""
    if h.dim() != 2 or h.shape[1] % 2 or not _runnable(h) or h.shape[0] == 0:
        ref = silu_mul_ref(h)
        return ref if out is None else out.copy_(ref)
    if h.stride(-1) != 1:
        h = h.contiguous()
    ffn = h.shape[1] // 2
    n = h.shape[0]
    a = _empty(out, (n, ffn), h)
    block = min(1024, _pow2(ffn))
    rows = SILU_BLOCK_ROWS if n >= SILU_BLOCK_MIN_ROWS else 1
    LAUNCHES["silu_mul"] += 1
    _silu_mul_kernel[(triton.cdiv(n, rows), triton.cdiv(ffn, block))](
        h, a, n, h.stride(0), a.stride(0), F=ffn, BLOCK=block, ROWS=rows, num_warps=_norm_warps(block * rows),
        enable_fp_fusion=False, **pdl.options(h.device))
    return a


def moe_combine(ys: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """out[n] = sum_j weights[n, j] * ys[dest[n, j]] (one launch: the gather back to pair order,
    the routing-weight products and the sum over k). ys [P, H]; dest (int), weights [N, k]."""
    fits = (ys.dim() == 2 and dest.dim() == 2 and dest.shape == weights.shape and not dest.is_floating_point()
            and weights.dtype == ys.dtype)
    if not fits or not _runnable(ys, weights) or dest.shape[0] == 0:
        ref = moe_combine_ref(ys, dest, weights)
        return ref if out is None else out.copy_(ref)
    n, k = dest.shape
    hidden = ys.shape[1]
    if ys.stride(-1) != 1:
        ys = ys.contiguous()
    dest, weights = dest.contiguous(), weights.contiguous()
    y = _empty(out, (n, hidden), ys)
    block = min(2048, _pow2(hidden))
    LAUNCHES["moe_combine"] += 1
    _combine_kernel[(n, triton.cdiv(hidden, block))](ys, dest, weights, y, ys.stride(0), y.stride(0), K=k,
                                                     HID=hidden, BLOCK=block, num_warps=_norm_warps(block),
                                                     enable_fp_fusion=False, **pdl.options(ys.device))
    return y


# -- the kernel set behind the model's ops interface --------------------------------------------

class TritonOps(ModelOps):
    """The fused kernels; each falls back to the reference where it does not apply."""

    name = "triton"
    fuses_combine = True

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm(x, weight, eps)

    def add_rmsnorm(self, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> AddNorm:
        return add_rmsnorm(h, delta, weight, eps)

    def qkv(self, qkv: torch.Tensor, groups: int, per_group: int, head_dim: int,
            rope: tuple[torch.Tensor, torch.Tensor], q_weight: torch.Tensor | None,
            k_weight: torch.Tensor | None, eps: float) -> QKV:
        return qkv_norm_rope(qkv, groups, per_group, head_dim, *rope, q_weight, k_weight, eps)

    def router(self, x: torch.Tensor, weight: torch.Tensor, topk: int, renormalize: bool) -> Routing:
        return router_topk(x, weight, topk, renormalize)

    def silu_mul(self, h: torch.Tensor) -> torch.Tensor:
        return silu_mul(h)

    def combine(self, ys: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return moe_combine(ys, dest, weights)


def _make_ops(model: torch.nn.Module, backend: str) -> tuple[ModelOps, str]:
    """The ops for `backend`, and why the reference was kept where "auto" finds the kernels do not apply."""
    if backend not in BACKENDS:
        raise ValueError(f"fused-ops backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return REFERENCE, "the reference ops were asked for"
    cfg = model.cfg
    device = next(model.parameters()).device
    if backend == "auto":
        if triton is None:
            return REFERENCE, "triton is not installed"
        if device.type != "cuda":
            return REFERENCE, f"model is on {device}, the fused kernels run on CUDA"
        if cfg.torch_dtype != torch.bfloat16:
            return REFERENCE, f"model dtype is {cfg.dtype}, the fused kernels are bf16"
        return TritonOps(), ""
    if triton is None:
        raise ImportError("fused-ops backend 'triton' needs Triton: pip install triton (it comes with CUDA torch)")
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"fused-ops backend 'triton' needs the model on CUDA (it is on {device}); on CPU set "
                         "TRITON_INTERPRET=1 to run the kernels in Triton's interpreter")
    return TritonOps(), ""


def self_check(model: torch.nn.Module, ops: ModelOps, rows: int = 16, tol: float = 1e-2) -> str | None:
    """Run each op once on random inputs at the model's sizes (this compiles the kernels) and compare
    with the reference. Returns None when all agree, else what failed: a kernel that does not build
    or disagrees on this device is then not installed, and the model keeps the reference."""
    first = next((m for m in model.modules() if isinstance(m, TransformerLayer)), None)
    router = next((m for m in model.modules() if isinstance(m, Router)), None)
    if first is None:
        return None
    norm, attn = first.input_layernorm, first.self_attention
    dev, dt = norm.weight.device, model.cfg.torch_dtype  # activations; a shared trainer's norms may be fp32
    gen = torch.Generator(device=dev).manual_seed(0)
    h = (torch.randn(rows, norm.weight.shape[0], device=dev, generator=gen)).to(dt)
    delta = (torch.randn(rows, norm.weight.shape[0], device=dev, generator=gen)).to(dt)
    w, eps = norm.weight, norm.eps
    checks = [("rmsnorm", lambda o: (o.rmsnorm(h, w, eps),)),
              ("add_rmsnorm", lambda o: tuple(o.add_rmsnorm(h, delta, w, eps)))]
    if isinstance(attn, SelfAttention):
        d, groups, per = attn.cfg.kv_channels, attn.groups, attn.per_group
        qkv = torch.randn(rows, groups * (per + 2) * d, device=dev, generator=gen).to(dt)
        rope = rope_tables(torch.arange(rows, device=dev) * 37, d, attn.cfg.rotary_base, dt)
        qk = ((attn.q_layernorm.weight, attn.k_layernorm.weight, attn.q_layernorm.eps) if attn.cfg.qk_layernorm
              else (None, None, attn.cfg.layernorm_epsilon))
        checks.append(("qkv_norm_rope", lambda o: tuple(o.qkv(qkv, groups, per, d, rope, *qk))))
    if router is not None:
        x = torch.randn(rows, router.weight.shape[1], device=dev, generator=gen).to(dt)
        checks.append(("router_topk", lambda o: tuple(o.router(x, router.weight, router.topk, router.renormalize))))
    experts = next((m for m in model.modules() if isinstance(m, Experts)), None)
    if experts is not None:
        ffn, hidden, k = experts.local_experts[0].linear_fc2.weight.shape[1], norm.weight.shape[0], 4
        gu = torch.randn(rows, 2 * ffn, device=dev, generator=gen).to(dt)
        ys = torch.randn(rows * k, hidden, device=dev, generator=gen).to(dt)
        dest = torch.randperm(rows * k, device=dev, generator=gen).view(rows, k)
        cw = torch.rand(rows, k, device=dev, generator=gen).to(dt)
        checks += [("silu_mul", lambda o: (o.silu_mul(gu),)), ("moe_combine", lambda o: (o.combine(ys, dest, cw),))]
    with torch.no_grad():
        for name, run in checks:
            try:
                got = run(ops)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            except Exception as exc:  # a kernel that does not build here: keep the reference
                return f"{name} failed: {type(exc).__name__}: {exc}"
            for g, r in zip(got, run(REFERENCE)):
                if g.shape != r.shape or g.dtype != r.dtype:
                    return f"{name}: got {g.dtype} {tuple(g.shape)}, expected {r.dtype} {tuple(r.shape)}"
                if not g.is_floating_point():  # router ids: near-ties may swap a few
                    agree = float((g == r).double().mean())
                    if agree < 0.9:
                        return f"{name}: only {agree:.0%} of the expert ids agree with the reference"
                    continue
                err = float((g.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30))
                if not err < tol:  # NaN fails too
                    return f"{name}: rel err {err:.2e} against the reference (tolerance {tol:g})"
    return None


def install_fused_ops(model: torch.nn.Module, backend: str = "auto", verify: bool | None = None) -> dict:
    """Choose the fused kernels for a built `MoETransformer` (`model.use_ops`; idempotent).

    "auto" chooses the Triton kernels for a bf16 model on CUDA and keeps the reference otherwise;
    "triton" forces them (CPU only under TRITON_INTERPRET=1); "torch" keeps the reference.
    `verify` (default: on CUDA) runs `self_check` first and keeps the reference if a kernel fails
    to build or disagrees. Returns what was done: backend, installed, modules (how many modules call
    the ops), reason (why the reference stays, where it does), verified."""
    ops, reason = _make_ops(model, backend)
    verify = bool(next(model.parameters()).device.type == "cuda" if verify is None else verify)
    if ops is not REFERENCE and verify:
        failure = self_check(model, ops)
        if failure is not None:
            log.warning("fused ops not installed, the reference stays: %s", failure)
            ops, reason = REFERENCE, failure
    modules = model.use_ops(None if ops is REFERENCE else ops)
    if ops is REFERENCE:
        log.info("fused ops not installed: %s", reason)
        return {"backend": "none", "installed": False, "reason": reason}
    log.info("fused ops (%s) installed on %d modules", ops.name, modules)
    return {"backend": ops.name, "installed": True, "modules": modules, "reason": reason, "verified": verify}


def uninstall_fused_ops(model: torch.nn.Module) -> int:
    """Put the model back on the reference ops; returns how many modules call them."""
    return model.use_ops(None)


def installed_backend(model: torch.nn.Module) -> str | None:
    """The kernel set chosen for `model` ("triton"), or None on the reference."""
    ops = model.ops
    return None if ops is REFERENCE else ops.name
