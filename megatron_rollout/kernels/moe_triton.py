"""Triton grouped expert MLP for small batches (decode): SwiGLU fc1 and weighted fc2 in two kernels.

At decode sizes a layer routes a few hundred (token, expert) pairs over ~all experts, a handful
per expert, so the layer is bound by reading the expert weights once. `torch._grouped_mm` tiles
each expert's rows into large M tiles; these kernels instead use 16-row tiles:

1. `padded_layout` (`kernels.expert_sort`: sync-free, capturable; one Triton launch at decode
   sizes, three past them) gives every pair a row in an expert-sorted layout padded to 16 rows
   per expert, and every 16-row block its expert (E past the end);
2. `_fc1_swiglu_kernel`: program (block, n-tile) reads the block's token rows of x and the
   expert's gate and up rows of `linear_fc1.weight` for its n-tile, and writes silu(gate) * up;
3. `_fc2_kernel`: program (block, n-tile) multiplies by `linear_fc2.weight`; then the fused ops'
   combine (where installed) weighs the rows and sums each token's k rows in one launch, or fc2
   scales each row by its routing weight and torch sums them.

fp32 accumulation, bf16 in and out. The grid is sized from a static bound (CUDA graphs):
`expert_sort.active_blocks`, the blocks that can hold pairs (at most min(pairs, E) experts each
padding at most 15 rows); blocks past the last expert exit at once.

FP8 weights (`model.fp8.StackedFP8`): the same kernels load e4m3 weights, which halves the bytes
a decode step reads, and widen them to bf16 in registers (weight-only FP8: the activations stay
bf16, the products run on bf16 tensor cores). Scales apply per output column once (per-tensor
scaling) or per k-tile (128x128 block scaling). With FP8 weights these kernels also serve large
batches (`LARGE_TILES`: 128-row tiles): there is no FP8 grouped GEMM beside them. Left out: large bf16 batches
(`torch._grouped_mm` is faster there), FP8 activations, expert parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from megatron_rollout.kernels import expert_sort, pdl
from megatron_rollout.kernels.pdl import entry as pdl_entry
from megatron_rollout.model.fp8 import StackedFP8

BLOCK_M = 16


@dataclass(frozen=True)
class Tiles:
    """Launch shape of both kernels: rows per tile (`block_m`), the caps of the n and k tiles (the
    largest power of two <= cap that divides the dimension), warps and pipeline stages."""

    block_m: int = BLOCK_M
    n_cap: int = 64
    k_cap: int = 64
    warps: int = 4
    stages: int = 3


DECODE_TILES = Tiles(k_cap=128, stages=4)
"""bf16 weights at decode sizes: 52.5 / 222.2 / 325.3 us per layer at 1 / 16 / 64 tokens against
59.4 / 230.9 / 335.0 for 64-wide k-tiles in 3 stages, the best or within 1% of it at each size
(H200, `bench.kernels`' bf16 grid, commit a5b1293; docs/kernels.md)."""
FP8_DECODE_TILES = Tiles(k_cap=128, stages=4)
"""FP8 weights at decode sizes (the same shape as `DECODE_TILES`, chosen by its own grid): 279 us
per layer at 64 rows against 321 us for 64-wide k-tiles in 3 stages and 485 us for the bf16
grouped GEMM (H200, `bench.kernels`' FP8 grid, fifth lease; docs/kernels.md)."""
LARGE_TILES = Tiles(block_m=128)
"""FP8 weights at prefill sizes (`kernels.moe.FP8_LARGE_ROWS`): 128-row tiles amortise weight reads;
the fastest of one pass over the grid at 4,096 tokens (2.17 ms per layer, 1.30x the bf16 grouped
GEMM; the next two shapes within 5%, not separated by repeated rounds yet)."""


def padded_layout(flat: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """flat: [P] expert of each pair. Returns (dest [P] int64 row of each pair, row_pair [R] int32
    pair of each row or -1, block_expert [R // block_m] int32 expert of each block or E), from
    `kernels.expert_sort` (its Triton kernels, or torch where they do not run)."""
    dest, row_pair, block_expert, _ = expert_sort.layout(flat, num_experts, block_m)
    return dest, row_pair, block_expert


@triton.jit
def _dot_tile(acc, a, w, S, srow, k0, SCALED: tl.constexpr, GK: tl.constexpr, KG: tl.constexpr):
    """acc + a @ w.T for one k-tile; FP8 weights are widened to a's dtype, and with several scale
    groups along k (block scaling) each tile's product is scaled by its group's column scales."""
    if SCALED:
        w = w.to(a.dtype)
    part = tl.dot(a, tl.trans(w))
    if SCALED and KG > 1:
        part = part * tl.load(S + srow + k0 // GK)[None, :]
    return acc + part


@triton.jit
def _scale_cols(acc, S, srow, SCALED: tl.constexpr, KG: tl.constexpr):
    """One scale group along k (per-tensor scaling): scale the finished columns once."""
    if SCALED and KG == 1:
        acc = acc * tl.load(S + srow)[None, :]
    return acc


@triton.jit
def _fc1_swiglu_kernel(X, W1, S1, Act, RowPair, BlockExpert, num_experts,
                       H: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       SCALED: tl.constexpr, GN: tl.constexpr, GK: tl.constexpr, KG: tl.constexpr,
                       SE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_entry(PDL)
    b = tl.program_id(0)
    n = tl.program_id(1)
    e = tl.load(BlockExpert + b)
    if e < num_experts:
        rows = b * BM + tl.arange(0, BM)
        pair = tl.load(RowPair + rows)
        valid = pair >= 0
        tok = tl.where(valid, pair // TOPK, 0).to(tl.int64)
        cols = n * BN + tl.arange(0, BN)
        k = tl.arange(0, BK)
        wbase = W1 + e.to(tl.int64) * (2 * F * H)
        sbase = e * SE
        srow_g = sbase + (cols // GN) * KG  # scale row of each gate / up column
        srow_u = sbase + ((F + cols) // GN) * KG
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, H, BK):
            x = tl.load(X + tok[:, None] * H + k0 + k[None, :], mask=valid[:, None], other=0.0)
            wg = tl.load(wbase + cols[:, None] * H + k0 + k[None, :])
            wu = tl.load(wbase + (F + cols)[:, None] * H + k0 + k[None, :])
            acc_g = _dot_tile(acc_g, x, wg, S1, srow_g, k0, SCALED, GK, KG)
            acc_u = _dot_tile(acc_u, x, wu, S1, srow_u, k0, SCALED, GK, KG)
        acc_g = _scale_cols(acc_g, S1, srow_g, SCALED, KG)
        acc_u = _scale_cols(acc_u, S1, srow_u, SCALED, KG)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(Act + rows.to(tl.int64)[:, None] * F + cols[None, :], act.to(Act.dtype.element_ty))


@triton.jit
def _fc2_kernel(Act, W2, S2, Y, RowPair, BlockExpert, Weights, num_experts,
                H: tl.constexpr, F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                SCALED: tl.constexpr, GN: tl.constexpr, GK: tl.constexpr, KG: tl.constexpr, SE: tl.constexpr,
                WEIGHTED: tl.constexpr, PDL: tl.constexpr = False):
    pdl_entry(PDL)
    b = tl.program_id(0)
    n = tl.program_id(1)
    e = tl.load(BlockExpert + b)
    if e < num_experts:
        rows = b * BM + tl.arange(0, BM)
        pair = tl.load(RowPair + rows)
        valid = pair >= 0
        cols = n * BN + tl.arange(0, BN)
        k = tl.arange(0, BK)
        wbase = W2 + e.to(tl.int64) * (H * F)
        srow = e * SE + (cols // GN) * KG
        r64 = rows.to(tl.int64)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, F, BK):
            a = tl.load(Act + r64[:, None] * F + k0 + k[None, :], mask=valid[:, None], other=0.0)
            w = tl.load(wbase + cols[:, None] * F + k0 + k[None, :])
            acc = _dot_tile(acc, a, w, S2, srow, k0, SCALED, GK, KG)
        acc = _scale_cols(acc, S2, srow, SCALED, KG)
        if WEIGHTED:  # else the caller's combine applies the routing weights
            acc = acc * tl.load(Weights + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)[:, None]
        tl.store(Y + r64[:, None] * H + cols[None, :], acc.to(Y.dtype.element_ty))


def _tile(n: int, cap: int) -> int | None:
    """Largest power of two <= cap that divides n and is >= 16 (tl.dot's minimum)."""
    t = cap
    while t >= 16:
        if n % t == 0:
            return t
        t //= 2
    return None


def supported(hidden: int, ffn: int) -> bool:
    return _tile(hidden, 64) is not None and _tile(ffn, 64) is not None


def _operand(fc: "torch.Tensor | StackedFP8", k_tile: int) -> tuple[torch.Tensor, dict]:
    """One projection's weights for the kernels: the [E, N, K] tensor, and the scale arguments
    (the [E, NG, KG] scales, the groups' sizes GN x GK, KG and SE = NG * KG scales per expert)."""
    if not isinstance(fc, StackedFP8):
        return fc, dict(scales=fc, SCALED=False, GN=1, GK=1, KG=1, SE=1)  # any pointer: never read
    (gn, gk), w, scale = fc.group, fc.data, fc.scale
    rows, cols = -(-w.shape[1] // gn), -(-w.shape[2] // gk)
    if tuple(scale.shape) != (w.shape[0], rows, cols):
        raise ValueError(f"scales {tuple(scale.shape)} do not match weights {tuple(w.shape)} in groups of {fc.group}")
    if cols > 1 and gk % k_tile:
        raise ValueError(f"scale groups of {gk} along k need k-tiles that divide them (tile {k_tile})")
    return w, dict(scales=scale.float().contiguous(), SCALED=True, GN=gn, GK=gk, KG=cols, SE=rows * cols)


def routed_experts_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                          fc1: "torch.Tensor | StackedFP8", fc2: "torch.Tensor | StackedFP8", first: int = 0,
                          tiles: Tiles = DECODE_TILES, combine=None) -> torch.Tensor:
    """sum_k weights[n, k] * MLP_{ids[n, k]}(x[n]). x: [N, H] bf16; ids, weights: [N, k];
    fc1: [E, 2F, H], fc2: [E, H, F], contiguous tensors in x's dtype or stacked FP8 experts
    (`model.fp8.StackedFP8`). `tiles`: the launch shape (16-row tiles for decode; larger ones
    amortise weight reads over prefill-sized batches). `combine(ys, dest, weights)` (the fused
    ops' `moe_combine`, where installed): the rows back to token order, weighted and summed in one
    launch, as the grouped path does; else fc2 weighs its rows and torch gathers and sums them.
    Returns [N, H]."""
    n, topk = ids.shape
    num_experts, two_f, hidden = (fc1.data if isinstance(fc1, StackedFP8) else fc1).shape
    ffn = two_f // 2
    flat = ids.reshape(-1) - first
    block_m = tiles.block_m
    dest, row_pair, block_expert = padded_layout(flat, num_experts, block_m)
    blocks = expert_sort.active_blocks(flat.numel(), num_experts, block_m)
    rows = blocks * block_m
    x = x.contiguous()
    launch = dict(num_warps=tiles.warps, num_stages=tiles.stages, **pdl.options(x.device))
    act = torch.empty(rows, ffn, dtype=x.dtype, device=x.device)
    bn1, bk1 = _tile(ffn, tiles.n_cap), _tile(hidden, tiles.k_cap)
    w1, a1 = _operand(fc1, bk1)
    _fc1_swiglu_kernel[(blocks, ffn // bn1)](x, w1, a1.pop("scales"), act, row_pair, block_expert, num_experts,
                                             H=hidden, F=ffn, TOPK=topk, BM=block_m, BN=bn1, BK=bk1, **a1,
                                             **launch)
    y = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    bn2, bk2 = _tile(hidden, tiles.n_cap), _tile(ffn, tiles.k_cap)
    w2, a2 = _operand(fc2, bk2)
    w = weights.reshape(-1).contiguous()
    _fc2_kernel[(blocks, hidden // bn2)](act, w2, a2.pop("scales"), y, row_pair, block_expert, w, num_experts,
                                         H=hidden, F=ffn, BM=block_m, BN=bn2, BK=bk2, **a2,
                                         WEIGHTED=combine is None, **launch)
    if combine is not None:
        return combine(y, dest.view(n, topk), weights)
    return y.index_select(0, dest).view(n, topk, hidden).sum(1)
