"""The expert sort in Triton: one launch for a decode batch, three for larger ones; stable, sync-free.

Why: before its expert GEMMs every MoE layer lays its (token, expert) pairs out in expert order.
In torch that is a one-hot prefix sum and a dozen small kernels (scatter, scan, gathers, the
padding arithmetic, a fill, an index_put, a searchsorted), each 1.5-3 us inside a CUDA graph:
29 us per layer at 64 rows on the H200 (`bench.kernels`' expert sort), more than the decode
attention of the layer; past 2,048 tokens a stable argsort, 84-94 us per layer. Up to
`MAX_PAIRS` pairs one program does all of it:

1. counts per expert (a one-hot sum over chunks of pairs held in registers);
2. each expert's rows padded to a multiple of `block_m`, their end rows by a prefix sum;
3. each pair's row: its expert's first row + its rank among the expert's pairs (an exclusive
   prefix sum over the chunk, plus the counts of the chunks before it): the stable expert order
   of `comm.exchange.sorted_destinations`, bit for bit;
4. the inverse (each row's pair, or -1 on padding) and every `block_m`-row block's expert (E past
   the last expert), as `kernels.moe_triton.padded_layout` returns them.

Past `MAX_PAIRS`, where one program walking every pair is slower, three launches
split the same work over chunks of `CHUNKED` pairs: each chunk's counts per expert; one program
turning them into every chunk's first row per expert (a prefix sum over chunks, then over
experts), the ends and the padding; each chunk's pairs to their rows. Same rows, bit for bit.

`block_m` = 1 gives the unpadded layout of the grouped-GEMM path (`kernels.moe.routed_experts`):
the ends are the group offsets, and with `div` = top-k each row holds the token it reads.

Left out: ids outside [0, E) (callers pass local expert ids: the distributed exchanges, whose
foreign pairs go to a sentinel expert, keep `comm.exchange.sorted_destinations`), and CPU
without Triton's interpreter. On the H200 (`bench.kernels`, docs/kernels.md, eighth lease) the
three launches lay out 4,096 to 65,536 pairs unpadded in 10.3-41.4 us, against 44.8-147.8 us for
the one-hot sort and 51.3-94.7 us for the stable argsort (padded, for the Triton experts: 18.8-132.0).
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from megatron_rollout.comm.exchange import ONE_HOT_LIMIT, one_hot_ranks, sorted_destinations
from megatron_rollout.kernels import pdl
from megatron_rollout.kernels.fused import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers keep the torch layout
    triton = None

log = logging.getLogger(__name__)

MAX_PAIRS = 256
"""Most pairs one program lays out (32 decode rows at top-8); more take three launches. The one
program walks its pairs in series: padded, 6.7 us at 64 pairs and 14.3 at 256 against the three
launches' 12.6 and 14.1, then 22.6 at 512 against 14.1 (H200, `bench.kernels`' forced paths,
commit 77fa576)."""
CHUNKED = 128
"""Pairs per program of the three-launch path (64 past 128 experts)."""
FILL = 1024
"""Rows one store of the -1 fill covers (one program fills up to pairs + E * (block_m - 1) rows)."""
MAX_EXPERTS = 256
"""Most experts the kernels hold in registers ([chunk, experts] one-hot); more keep the torch layout."""
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


def active_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """A static bound on the blocks that hold pairs, the programs worth launching: the padded
    layout puts them first, and each of the at most min(pairs, E) experts present pads at most
    block_m - 1 rows. At 1 decode row (8 pairs) that is 8 blocks of `padded_rows`' 121; from a few
    rows on, the two bounds meet."""
    used = pairs + (block_m - 1) * min(pairs, num_experts)
    return min(-(-used // block_m), padded_rows(pairs, num_experts, block_m) // block_m)


def _device_key(device: torch.device | str) -> str:
    """One name per physical device: `cuda` and `cuda:0` (the current device) are the same key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


_REFUSED: dict[str, str] = {}
"""Devices (by `_device_key`) whose `self_check` failed, and why: the torch layout serves them."""
_CHECKED: set[tuple[str, int, int]] = set()
"""(device, experts, top-k) that `self_check` passed in this process."""


def runnable(flat: torch.Tensor, num_experts: int) -> bool:
    """The kernels can lay out these pairs: Triton present, on CUDA (or interpreting), some pairs,
    at most `MAX_EXPERTS` experts, a device whose `self_check` did not fail."""
    return (triton is not None and (flat.is_cuda or interpreting()) and flat.numel() > 0
            and 0 < num_experts <= MAX_EXPERTS and _device_key(flat.device) not in _REFUSED)


def layout(flat: torch.Tensor, num_experts: int, block_m: int, div: int = 1) -> ExpertLayout:
    """The expert layout of `expert_layout`, by the Triton kernels where they run, else in torch."""
    if runnable(flat, num_experts):
        return expert_layout(flat, num_experts, block_m, div)
    return torch_layout(flat, num_experts, block_m, div)


def torch_layout(flat: torch.Tensor, num_experts: int, block_m: int, div: int = 1) -> ExpertLayout:
    """The same layout from torch ops (sync-free, capturable): a one-hot prefix sum up to
    `comm.exchange.ONE_HOT_LIMIT` pairs x experts, the stable argsort past it. The reference of the
    kernels, and the path of CPU-only installs."""
    pairs, dev = flat.numel(), flat.device
    if pairs * num_experts <= ONE_HOT_LIMIT:
        counts, rank = one_hot_ranks(flat, num_experts)
    else:
        dest, end = sorted_destinations(flat, num_experts, 0)
        counts = torch.diff(end, prepend=end.new_zeros(1))
        rank = dest - (end - counts)[flat]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0, dtype=torch.int32)
    dest = ((ends - padded)[flat] + rank).long()
    rows = padded_rows(pairs, num_experts, block_m)
    row_source = (torch.full((rows,), -1, dtype=torch.int32, device=dev) if block_m > 1  # padding rows
                  else torch.empty(rows, dtype=torch.int32, device=dev))  # every row holds a pair
    row_source[dest] = torch.arange(pairs, dtype=torch.int32, device=dev) // div
    if block_m > 1:
        starts = torch.arange(0, rows, block_m, dtype=torch.int32, device=dev)
        block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    else:
        block_expert = torch.empty(0, dtype=torch.int32, device=dev)
    return ExpertLayout(dest, row_source, block_expert, ends)


def self_check(device: torch.device, num_experts: int, topk: int = 8) -> str | None:
    """Lay out random pairs both ways on `device` (one launch and three; padded and not) and
    compare bit for bit. On a mismatch or a kernel that does not build, the device is refused
    (`runnable` is False there: the torch layout serves it) and the reason returned; else None."""
    name = _device_key(device)
    key = (name, num_experts, topk)
    if triton is None or not 0 < num_experts <= MAX_EXPERTS or key in _CHECKED:
        return _REFUSED.get(name)
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        for pairs in (MAX_PAIRS, 8 * MAX_PAIRS + 3):
            flat = torch.randint(0, num_experts, (pairs,), device=device, generator=gen)
            for block_m, div in ((1, topk), (16, 1)):
                got, ref = expert_layout(flat, num_experts, block_m, div), torch_layout(flat, num_experts, block_m, div)
                for field, a, b in zip(ExpertLayout._fields, got, ref):
                    if not torch.equal(a, b):
                        raise ValueError(f"{field} differs from the torch layout at {pairs} pairs, block_m {block_m}")
    except Exception as exc:  # any failure means: do not use the kernels on this device
        _REFUSED[name] = f"{type(exc).__name__}: {exc}"
        log.warning("expert sort kernels refused on %s: %s", name, _REFUSED[name])
        return _REFUSED[name]
    _CHECKED.add(key)
    return None


def expert_layout(flat: torch.Tensor, num_experts: int, block_m: int, div: int = 1,
                  max_pairs: int = MAX_PAIRS) -> ExpertLayout:
    """flat: [P] expert of each pair, in [0, num_experts). One launch up to `max_pairs` pairs, three
    past it (see the module docstring; `bench.kernels` forces each path). `div`: rows hold
    pair // div (top-k: the token a row reads). Callers check `runnable` first (or call `layout`)."""
    if block_m < 1 or div < 1:
        raise ValueError(f"block_m and div must be positive, got {block_m} and {div}")
    pairs = flat.numel()
    rows = padded_rows(pairs, num_experts, block_m)
    blocks = rows // block_m if block_m > 1 else 0
    dev = flat.device
    flat = flat.contiguous()
    dest = torch.empty(pairs, dtype=torch.int64, device=dev)
    row_source = torch.empty(rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    ends = torch.empty(num_experts, dtype=torch.int32, device=dev)
    e_p = max(16, triton.next_power_of_2(num_experts))
    shape = dict(E=num_experts, E_P=e_p, BM=block_m, FILL=FILL)
    launch = pdl.options(dev)
    if pairs <= max_pairs:
        _layout_kernel[(1,)](flat, dest, row_source, block_expert, ends, pairs, rows, blocks, **shape, DIV=div,
                             C=CHUNK, num_warps=4, **launch)
    else:
        chunk = CHUNKED if e_p <= 128 else CHUNKED // 2  # [chunk, E_P] int32 in registers
        chunks = triton.cdiv(pairs, chunk)
        base = torch.empty(chunks, e_p, dtype=torch.int32, device=dev)  # counts, then each chunk's first rows
        _count_kernel[(chunks,)](flat, base, pairs, E_P=e_p, C=chunk, num_warps=4, **launch)
        _scan_kernel[(1,)](base, ends, row_source, block_expert, chunks, rows, blocks, **shape, C=CHUNK,
                           num_warps=4, **launch)
        _rank_kernel[(chunks,)](flat, base, dest, row_source, pairs, E_P=e_p, DIV=div, C=chunk, num_warps=4,
                                **launch)
    return ExpertLayout(dest, row_source, block_expert, ends)


if triton is not None:
    from megatron_rollout.kernels.pdl import entry as pdl_entry

    # `while`, not `range`, over runtime sizes: Triton's interpreter cannot bound a range by them.

    @triton.jit
    def _hits(Flat, p, valid, e):
        """[C, E_P] int32 one-hot of the pairs p (0 rows where not valid)."""
        f = tl.load(Flat + p, mask=valid, other=-1).to(tl.int32)
        return (f[:, None] == e[None, :]).to(tl.int32)

    @triton.jit
    def _place(hit, first, p, valid, Dest, RowSource, DIV: tl.constexpr):
        """Each pair's row: `first` (its expert's next row for this chunk) + the pairs of its expert
        before it in the chunk (an exclusive prefix sum: the stable order)."""
        earlier = tl.cumsum(hit, axis=0) - hit
        row = tl.sum(hit * (earlier + first[None, :]), axis=1)
        tl.store(Dest + p, row.to(tl.int64), mask=valid)
        tl.store(RowSource + row, p // DIV, mask=valid)

    @triton.jit
    def _ends(counts, e, emask, Ends, BM: tl.constexpr):
        """Padded end row of every expert (stored), and its first row."""
        padded = (counts + BM - 1) // BM * BM
        end = tl.cumsum(padded, axis=0)
        tl.store(Ends + e, end, mask=emask)
        return end, end - padded

    @triton.jit
    def _pad(end, emask, RowSource, BlockExpert, rows, blocks, BM: tl.constexpr, C: tl.constexpr,
             FILL: tl.constexpr):
        """Padding rows -1, and each block's expert: the experts whose rows end at or before its first
        row, counted (E past the last expert)."""
        r = tl.arange(0, FILL)
        r0 = 0
        while r0 < rows:
            tl.store(RowSource + r0 + r, tl.full([FILL], -1, tl.int32), mask=r0 + r < rows)
            r0 += FILL
        c = tl.arange(0, C)
        b0 = 0
        while b0 < blocks:
            first_row = (b0 + c) * BM
            before = (end[None, :] <= first_row[:, None]) & emask[None, :]
            tl.store(BlockExpert + b0 + c, tl.sum(before.to(tl.int32), axis=1), mask=b0 + c < blocks)
            b0 += C

    @triton.jit(do_not_specialize=["pairs", "rows", "blocks"])
    def _layout_kernel(Flat, Dest, RowSource, BlockExpert, Ends, pairs, rows, blocks,
                       E: tl.constexpr, E_P: tl.constexpr, BM: tl.constexpr, DIV: tl.constexpr, C: tl.constexpr,
                       FILL: tl.constexpr, PDL: tl.constexpr = False):
        """Everything in one program: counts, ends, padding, then every chunk's rows in order."""
        pdl_entry(PDL)
        e = tl.arange(0, E_P)
        emask = e < E
        c = tl.arange(0, C)
        counts = tl.zeros([E_P], tl.int32)
        c0 = 0
        while c0 < pairs:
            counts += tl.sum(_hits(Flat, c0 + c, c0 + c < pairs, e), axis=0)
            c0 += C
        end, start = _ends(counts, e, emask, Ends, BM)
        if BM > 1:
            _pad(end, emask, RowSource, BlockExpert, rows, blocks, BM, C, FILL)
            tl.debug_barrier()  # the -1 fill is in memory before any pair's row overwrites it
        first = start
        c0 = 0
        while c0 < pairs:
            p = c0 + c
            hit = _hits(Flat, p, p < pairs, e)
            _place(hit, first, p, p < pairs, Dest, RowSource, DIV)
            first += tl.sum(hit, axis=0)
            c0 += C

    @triton.jit(do_not_specialize=["pairs"])
    def _count_kernel(Flat, Counts, pairs, E_P: tl.constexpr, C: tl.constexpr, PDL: tl.constexpr = False):
        """Chunk i's pairs per expert -> Counts[i]."""
        pdl_entry(PDL)
        i = tl.program_id(0)
        p = i * C + tl.arange(0, C)
        tl.store(Counts + i * E_P + tl.arange(0, E_P), tl.sum(_hits(Flat, p, p < pairs, tl.arange(0, E_P)), axis=0))

    @triton.jit(do_not_specialize=["chunks", "rows", "blocks"])
    def _scan_kernel(Base, Ends, RowSource, BlockExpert, chunks, rows, blocks,
                     E: tl.constexpr, E_P: tl.constexpr, BM: tl.constexpr, C: tl.constexpr, FILL: tl.constexpr,
                     PDL: tl.constexpr = False):
        """Counts [chunks, E_P] -> each chunk's first row per expert, in place; the ends; the padding."""
        pdl_entry(PDL)
        e = tl.arange(0, E_P)
        emask = e < E
        c = tl.arange(0, C)
        counts = tl.zeros([E_P], tl.int32)
        c0 = 0
        while c0 < chunks:
            at = Base + (c0 + c)[:, None] * E_P + e[None, :]
            counts += tl.sum(tl.load(at, mask=(c0 + c < chunks)[:, None], other=0), axis=0)
            c0 += C
        end, first = _ends(counts, e, emask, Ends, BM)
        if BM > 1:
            _pad(end, emask, RowSource, BlockExpert, rows, blocks, BM, C, FILL)
        c0 = 0
        while c0 < chunks:
            at = Base + (c0 + c)[:, None] * E_P + e[None, :]
            live = (c0 + c < chunks)[:, None]
            n = tl.load(at, mask=live, other=0)
            tl.store(at, tl.cumsum(n, axis=0) - n + first[None, :], mask=live)
            first += tl.sum(n, axis=0)
            c0 += C

    @triton.jit(do_not_specialize=["pairs"])
    def _rank_kernel(Flat, Base, Dest, RowSource, pairs, E_P: tl.constexpr, DIV: tl.constexpr, C: tl.constexpr,
                     PDL: tl.constexpr = False):
        """Chunk i's pairs to their rows, from the chunk's first rows per expert."""
        pdl_entry(PDL)
        i = tl.program_id(0)
        p = i * C + tl.arange(0, C)
        e = tl.arange(0, E_P)
        _place(_hits(Flat, p, p < pairs, e), tl.load(Base + i * E_P + e), p, p < pairs, Dest, RowSource, DIV)
