"""The expert sort of a decode-sized batch in one Triton launch: counts, stable ranks, padded rows.

Why: before its expert GEMMs every MoE layer lays its (token, expert) pairs out in expert order.
In torch that is a one-hot prefix sum and a dozen small kernels (scatter, scan, gathers, the
padding arithmetic, a fill, an index_put, a searchsorted), each 1.5-3 us inside a CUDA graph:
29 us per layer at 64 rows on the H200 (`bench.kernels`' expert sort), more than the decode
attention of the layer. Here one program does all of it, on pairs that fit a decode batch:

1. counts per expert (a one-hot sum over chunks of pairs held in registers);
2. each expert's rows padded to a multiple of `block_m`, their end rows by a prefix sum;
3. each pair's row: its expert's first row + its rank among the expert's pairs (an exclusive
   prefix sum over the chunk, plus the counts of the chunks before it): the stable expert order
   of `comm.exchange.sorted_destinations`, bit for bit;
4. the inverse (each row's pair, or -1 on padding) and every `block_m`-row block's expert (E past
   the last expert), as `kernels.moe_triton.padded_layout` returns them.

`block_m` = 1 gives the unpadded layout of the grouped-GEMM path (`kernels.moe.routed_experts`):
the ends are the group offsets, and with `div` = top-k each row holds the token it reads.

Left out: batches past `MAX_PAIRS` (one program walks every pair in series: the torch sorts stay
there), ids outside [0, E) (callers pass local expert ids), and CPU without Triton's interpreter.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from megatron_rollout.kernels.fused import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers keep the torch layout
    triton = None

MAX_PAIRS = 512
"""Most pairs one program lays out (64 decode rows at top-8); more stay on the torch path. The one
program walks its pairs in series: at 512 pairs it took 18.2 us against the one-hot sort's 28.7
(padded: 22.6 against 41.6), at 4,096 pairs 135.7 against 44.1 (H200, `bench.kernels`)."""
MAX_EXPERTS = 256
CHUNK = 64
"""Pairs per register tile: [CHUNK, experts] int32 one-hot."""


class ExpertLayout(NamedTuple):
    dest: torch.Tensor  # [P] int64: each pair's row in the expert-sorted (padded) layout
    row_source: torch.Tensor  # [R] int32: each row's pair // `div` (its pair, or its token), -1 on padding
    block_expert: torch.Tensor  # [R // block_m] int32: each block's expert, E past the last one ([0] if block_m 1)
    ends: torch.Tensor  # [E] int32: each expert's end row (padded cumulative counts)


def padded_rows(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded layout: a static bound (pairs + E * (block_m - 1), whole blocks), so
    that CUDA graphs keep one shape whatever the routing."""
    return -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m


def runnable(flat: torch.Tensor, num_experts: int) -> bool:
    """The kernel can lay out these pairs: Triton present, on CUDA (or interpreting), a decode batch."""
    return (triton is not None and (flat.is_cuda or interpreting()) and 0 < flat.numel() <= MAX_PAIRS
            and 0 < num_experts <= MAX_EXPERTS)


def expert_layout(flat: torch.Tensor, num_experts: int, block_m: int, div: int = 1) -> ExpertLayout:
    """flat: [P] expert of each pair, in [0, num_experts). One launch; see the module docstring.
    `div`: rows hold pair // div (top-k: the token a row reads). Callers check `runnable` first."""
    if block_m < 1 or div < 1:
        raise ValueError(f"block_m and div must be positive, got {block_m} and {div}")
    pairs = flat.numel()
    rows = padded_rows(pairs, num_experts, block_m)
    blocks = rows // block_m if block_m > 1 else 0
    dev = flat.device
    dest = torch.empty(pairs, dtype=torch.int64, device=dev)
    row_source = torch.empty(rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    ends = torch.empty(num_experts, dtype=torch.int32, device=dev)
    _layout_kernel[(1,)](flat.contiguous(), dest, row_source, block_expert, ends, pairs, rows, blocks,
                         E=num_experts, E_P=max(16, triton.next_power_of_2(num_experts)), BM=block_m, DIV=div,
                         C=CHUNK, num_warps=4)
    return ExpertLayout(dest, row_source, block_expert, ends)


if triton is not None:

    @triton.jit(do_not_specialize=["pairs", "rows", "blocks"])
    def _layout_kernel(Flat, Dest, RowSource, BlockExpert, Ends, pairs, rows, blocks,
                       E: tl.constexpr, E_P: tl.constexpr, BM: tl.constexpr, DIV: tl.constexpr, C: tl.constexpr):
        e = tl.arange(0, E_P)
        emask = e < E
        c = tl.arange(0, C)
        # `while`, not `range`, over the runtime sizes: Triton's interpreter cannot bound a range by them
        counts = tl.zeros([E_P], tl.int32)
        c0 = 0
        while c0 < pairs:
            f = tl.load(Flat + c0 + c, mask=c0 + c < pairs, other=-1).to(tl.int32)
            counts += tl.sum((f[:, None] == e[None, :]).to(tl.int32), axis=0)
            c0 += C
        padded = (counts + BM - 1) // BM * BM
        end = tl.cumsum(padded, axis=0)
        start = end - padded
        tl.store(Ends + e, end, mask=emask)
        if BM > 1:  # padding rows exist: fill them with -1, and give each block its expert
            r0 = 0
            while r0 < rows:
                tl.store(RowSource + r0 + c, tl.full([C], -1, tl.int32), mask=r0 + c < rows)
                r0 += C
            b0 = 0
            while b0 < blocks:
                first_row = (b0 + c) * BM  # a block's expert: the experts whose rows end at or before it, counted
                before = (end[None, :] <= first_row[:, None]) & emask[None, :]
                tl.store(BlockExpert + b0 + c, tl.sum(before.to(tl.int32), axis=1), mask=b0 + c < blocks)
                b0 += C
            tl.debug_barrier()  # the -1 fill is in memory before any pair's row overwrites it
        seen = start
        c0 = 0
        while c0 < pairs:
            p = c0 + c
            valid = p < pairs
            f = tl.load(Flat + p, mask=valid, other=-1).to(tl.int32)
            hit = (f[:, None] == e[None, :]).to(tl.int32)  # [C, E_P]
            earlier = tl.cumsum(hit, axis=0) - hit  # pairs of the same expert before this one in the chunk
            row = tl.sum(hit * (earlier + seen[None, :]), axis=1)
            tl.store(Dest + p, row.to(tl.int64), mask=valid)
            tl.store(RowSource + row, p // DIV, mask=valid)
            seen += tl.sum(hit, axis=0)
            c0 += C
