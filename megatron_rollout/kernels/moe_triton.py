"""Triton grouped expert MLP for small batches (decode): SwiGLU fc1 and weighted fc2 in two kernels.

At decode sizes a layer routes a few hundred (token, expert) pairs over ~all experts, a handful
per expert, so the layer is bound by reading the expert weights once. `torch._grouped_mm` tiles
each expert's rows into large M tiles; these kernels instead use 16-row tiles:

1. `padded_layout` (torch, sync-free, capturable) gives every pair a row in an expert-sorted
   layout padded to 16 rows per expert, and every 16-row block its expert (E past the end);
2. `_fc1_swiglu_kernel`: program (block, n-tile) reads the block's token rows of x and the
   expert's gate and up rows of `linear_fc1.weight` for its n-tile, and writes silu(gate) * up;
3. `_fc2_kernel`: program (block, n-tile) multiplies by `linear_fc2.weight` and scales each row
   by its pair's routing weight; the caller sums the k rows of each token.

fp32 accumulation, bf16 in and out. Blocks past the last expert exit at once, so the grid can be
sized from the static bound `pairs + experts * 15` (CUDA graphs). Left out: large batches
(`torch._grouped_mm` is faster there), FP8 weights, expert parallelism.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16


def padded_layout(flat: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """flat: [P] expert of each pair. Returns (dest [P] int64 row of each pair, row_pair [R] int32
    pair of each row or -1, block_expert [R // block_m] int32 expert of each block or E)."""
    pairs = flat.numel()
    dev = flat.device
    onehot = torch.zeros(num_experts, pairs, dtype=torch.int32, device=dev)
    onehot.scatter_(0, flat[None, :], 1)
    csum = onehot.cumsum(1, dtype=torch.int32)  # scan along the contiguous dim: one row per expert
    counts = csum[:, -1]
    rank = csum.gather(0, flat[None, :]).squeeze(0) - 1
    padded = (counts + block_m - 1) // block_m * block_m
    end = padded.cumsum(0, dtype=torch.int32)
    dest = ((end - padded)[flat] + rank).long()
    rows = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    row_pair = torch.full((rows,), -1, dtype=torch.int32, device=dev)
    row_pair[dest] = torch.arange(pairs, dtype=torch.int32, device=dev)
    starts = torch.arange(0, rows, block_m, dtype=torch.int32, device=dev)
    block_expert = torch.searchsorted(end, starts, right=True).to(torch.int32)
    return dest, row_pair, block_expert


@triton.jit
def _fc1_swiglu_kernel(X, W1, Act, RowPair, BlockExpert, num_experts,
                       H: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
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
        acc_g = tl.zeros([BM, BN], tl.float32)
        acc_u = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, H, BK):
            x = tl.load(X + tok[:, None] * H + k0 + k[None, :], mask=valid[:, None], other=0.0)
            wg = tl.load(wbase + cols[:, None] * H + k0 + k[None, :])
            wu = tl.load(wbase + (F + cols)[:, None] * H + k0 + k[None, :])
            acc_g += tl.dot(x, tl.trans(wg))
            acc_u += tl.dot(x, tl.trans(wu))
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(Act + rows.to(tl.int64)[:, None] * F + cols[None, :], act.to(Act.dtype.element_ty))


@triton.jit
def _fc2_kernel(Act, W2, Y, RowPair, BlockExpert, Weights, num_experts,
                H: tl.constexpr, F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
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
        r64 = rows.to(tl.int64)
        acc = tl.zeros([BM, BN], tl.float32)
        for k0 in range(0, F, BK):
            a = tl.load(Act + r64[:, None] * F + k0 + k[None, :], mask=valid[:, None], other=0.0)
            w = tl.load(wbase + cols[:, None] * F + k0 + k[None, :])
            acc += tl.dot(a, tl.trans(w))
        scale = tl.load(Weights + tl.where(valid, pair, 0), mask=valid, other=0.0).to(tl.float32)
        tl.store(Y + r64[:, None] * H + cols[None, :], (acc * scale[:, None]).to(Y.dtype.element_ty))


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


def routed_experts_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, fc1: torch.Tensor,
                          fc2: torch.Tensor, first: int = 0) -> torch.Tensor:
    """sum_k weights[n, k] * MLP_{ids[n, k]}(x[n]). x: [N, H] bf16; ids, weights: [N, k];
    fc1: [E, 2F, H], fc2: [E, H, F] contiguous. Returns [N, H]."""
    n, topk = ids.shape
    num_experts, two_f, hidden = fc1.shape
    ffn = two_f // 2
    flat = ids.reshape(-1) - first
    dest, row_pair, block_expert = padded_layout(flat, num_experts)
    rows = row_pair.numel()
    blocks = rows // BLOCK_M
    x = x.contiguous()
    act = torch.empty(rows, ffn, dtype=x.dtype, device=x.device)
    bn1, bk1 = _tile(ffn, 64), _tile(hidden, 64)
    _fc1_swiglu_kernel[(blocks, ffn // bn1)](x, fc1, act, row_pair, block_expert, num_experts,
                                             H=hidden, F=ffn, TOPK=topk, BM=BLOCK_M, BN=bn1, BK=bk1,
                                             num_warps=4, num_stages=3)
    y = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    bn2, bk2 = _tile(hidden, 64), _tile(ffn, 64)
    w = weights.reshape(-1).contiguous()
    _fc2_kernel[(blocks, hidden // bn2)](act, fc2, y, row_pair, block_expert, w, num_experts,
                                         H=hidden, F=ffn, BM=BLOCK_M, BN=bn2, BK=bk2, num_warps=4, num_stages=3)
    return y.index_select(0, dest).view(n, topk, hidden).sum(1)
