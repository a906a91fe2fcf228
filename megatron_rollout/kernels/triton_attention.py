"""Triton kernels for attention over the paged KV store (registered as backend "triton").

Three kernels, all reading K/V through block tables (`slot = table[pos // page] * page + pos % page`)
from one layer's cache `[slots, kv_heads, head_dim]`:

- `_store_kv_kernel`: one program per new token copies its K and V rows to their slot; a slot
  below zero is skipped (padded rows of a CUDA-graph batch).
- `_decode_partial_kernel` + `_decode_reduce_kernel`: flash-decoding. Program (row, kv head,
  split) runs an online softmax over its share of the row's history for *all* query heads of that
  kv head at once (GQA: the K/V tile is loaded once per group, and the group is the M side of the
  `tl.dot`); the reduce kernel merges the splits. The grid is static for a given batch and split
  count, so the pair is captured in CUDA graphs; rows of length 0 produce zeros. With
  `DecodeMeta.runs` (speculative decoding's verify rows: a row and its drafts over one history)
  the head of a run computes every row of it from one read of each block, the run's rows stacked
  on the M side too, each masked at its own length; the other rows' programs exit at once.
- `_prefill_kernel`: flash attention, causal with an offset. A program owns a tile of
  `TOK` new tokens x all query heads of one kv head (the rows of its `tl.dot`), walks the keys
  `[0, past + last token of the tile]`, and masks `key_pos <= past + token`.

Accumulation is fp32 (scores, softmax statistics, output); P is cast to the cache dtype for the
second product, as flash attention does. Scores use exp2 with log2(e) folded into the scale.

Specialisation: Triton compiles one variant per combination of "pointer 16-byte aligned",
"integer equals 1" and "integer divisible by 16" over the arguments. `kernels.layout` keeps the
index pointers aligned and the table stride a multiple of 16; the integers that still follow the
batch (the split count and the partial-result strides that scale with it, the table stride of
callers that do not pad) are listed in `do_not_specialize`, so a kernel compiles once per model
and never inside a timed replay (`bench.compiles` counts it).

Left out: sliding windows, ALiBi, soft-capping, FP8 KV, and the TMA / warp-specialised paths of
hand-written Hopper kernels (Triton picks wgmma for `tl.dot` on sm_90 by itself).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from megatron_rollout.kernels import pdl
from megatron_rollout.kernels.pdl import entry as pdl_entry
from megatron_rollout.kernels.registry import AttentionKernels, DecodeMeta, PrefillMeta, register

LOG2E = 1.4426950408889634
MAX_SPLITS = 32
"""Most KV splits of a decode row (`layout.choose_splits` caps at this); one compiled reduce."""
_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": keeps fully masked rows free of inf - inf = NaN


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


@triton.jit
def _store_kv_kernel(K, V, KC, VC, Slots,
                     stride_kn, stride_kh, stride_vn, stride_vh, stride_cs, stride_ch,
                     HKV: tl.constexpr, HKV_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_entry(PDL)
    n = tl.program_id(0)
    slot = tl.load(Slots + n).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, HKV_P)[:, None]
        d = tl.arange(0, D_P)[None, :]
        mask = (h < HKV) & (d < D)
        k = tl.load(K + n * stride_kn + h * stride_kh + d, mask=mask)
        v = tl.load(V + n * stride_vn + h * stride_vh + d, mask=mask)
        tl.store(KC + slot * stride_cs + h * stride_ch + d, k, mask=mask)
        tl.store(VC + slot * stride_cs + h * stride_ch + d, v, mask=mask)


@triton.jit
def _online_softmax(s, v, m_i, l_i, acc):
    """One key block of an online softmax in base 2: scores `s` [M, N] (masked keys at `_NEG`) and
    values `v` [N, D] update the running max `m_i`, denominator `l_i` and output `acc` (fp32; P is
    cast to the values' dtype for the second product, as flash attention does)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit(do_not_specialize=["stride_tb", "stride_mb", "stride_mh"])
def _decode_partial_kernel(Q, KC, VC, Tables, Lens, QStart, Seq, Runs, PartO, PartM, PartL, scale_log2,
                           stride_qn, stride_qh, stride_cs, stride_ch, stride_tb,
                           stride_ob, stride_oh, stride_os, stride_mb, stride_mh,
                           GROUP: tl.constexpr, GROUP_P: tl.constexpr, RUN: tl.constexpr, D: tl.constexpr,
                           D_P: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row b, kv head, split). RUN > 1: row b heads a run of `Runs[b]` rows over one history
    (`DecodeMeta.runs`) and computes them all from one read of each K/V block: the run's rows x the
    group's heads are the M side of the `tl.dot`, each row masked at its own length; a row inside a
    run (`Runs[b] == 0`) is left to its head. RUN == 1: every row alone (`Runs` unread)."""
    pdl_entry(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    if RUN > 1:
        run = tl.load(Runs + b)
    else:
        run = 1
    if run > 0:
        r = tl.arange(0, RUN * GROUP_P)
        qi = r // GROUP_P  # the row of the run (always 0 when RUN == 1)
        g = r % GROUP_P
        live = qi < run
        rmask = live & (g < GROUP)
        seqs = tl.load(Seq + b + qi, mask=live, other=0)
        lens = tl.load(Lens + seqs, mask=live, other=0)  # [RUN * GROUP_P]: each M row's length
        length = tl.max(lens, 0)  # the run's longest row sets the splits
        per = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
        start = split * per
        end = tl.minimum(start + per, length)

        d = tl.arange(0, D_P)
        dmask = d < D
        heads = kvh * GROUP + g
        row = tl.load(QStart + seqs, mask=live, other=0).to(tl.int64)
        q = tl.load(Q + row[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)

        m_i = tl.full([RUN * GROUP_P], _NEG, tl.float32)
        l_i = tl.zeros([RUN * GROUP_P], tl.float32)
        acc = tl.zeros([RUN * GROUP_P, D_P], tl.float32)
        table = Tables + tl.load(Seq + b).to(tl.int64) * stride_tb  # the run's rows share it
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < end
            block = tl.load(table + pos // PAGE, mask=pmask, other=0).to(tl.int64)
            slot = block * PAGE + pos % PAGE
            off = slot[:, None] * stride_cs + kvh * stride_ch + d[None, :]
            kvmask = pmask[:, None] & dmask[None, :]
            k = tl.load(KC + off, mask=kvmask, other=0.0)
            v = tl.load(VC + off, mask=kvmask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2  # [RUN * GROUP_P, BLOCK_N] fp32
            if RUN > 1:  # each row up to its own length; one that sees nothing of this split keeps
                seen = pos[None, :] < lens[:, None]  # m = -inf here, and the reduce weighs the split 0
            else:
                seen = pmask[None, :]
            m_i, l_i, acc = _online_softmax(tl.where(seen, s, _NEG), v, m_i, l_i, acc)

        obase = (b + qi).to(tl.int64) * stride_ob + split * stride_os
        tl.store(PartO + obase[:, None] + heads[:, None] * stride_oh + d[None, :], acc,
                 mask=rmask[:, None] & dmask[None, :])
        mbase = (b + qi).to(tl.int64) * stride_mb + split
        tl.store(PartM + mbase + heads * stride_mh, m_i, mask=rmask)
        tl.store(PartL + mbase + heads * stride_mh, l_i, mask=rmask)


@triton.jit(do_not_specialize=["splits", "stride_mb", "stride_mh"])
def _decode_reduce_kernel(PartO, PartM, PartL, Out, QStart, Seq, splits,
                          stride_ob, stride_oh, stride_os, stride_mb, stride_mh, stride_qn, stride_qh,
                          SPLITS_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, PDL: tl.constexpr = False):
    pdl_entry(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    d = tl.arange(0, D_P)
    smask = s < splits
    dmask = d < D
    mbase = b.to(tl.int64) * stride_mb + h * stride_mh
    m = tl.load(PartM + mbase + s, mask=smask, other=_NEG)
    lsum = tl.load(PartL + mbase + s, mask=smask, other=0.0)
    top = tl.max(m, 0)
    w = tl.where(lsum > 0, tl.exp2(m - top), 0.0)
    denom = tl.sum(w * lsum, 0)
    o = tl.load(PartO + b.to(tl.int64) * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    num = tl.sum(o * w[:, None], 0)
    out = num / tl.where(denom > 0, denom, 1.0)
    seq = tl.load(Seq + b)
    row = tl.load(QStart + seq).to(tl.int64)
    tl.store(Out + row * stride_qn + h * stride_qh + d, out.to(Out.dtype.element_ty), mask=dmask)


@triton.jit
def _prefill_block(q, KC, VC, table, n0, hi, qpos, m_i, l_i, acc, scale_log2, kvh, stride_cs, stride_ch, d, dmask,
                   BLOCK_N: tl.constexpr, PAGE: tl.constexpr, MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """One key block of `_prefill_kernel`'s online softmax. MASK: the block reaches the diagonal
    (or `hi`), so scores are masked per row; blocks wholly below the tile's first query skip it."""
    kpos = n0 + tl.arange(0, BLOCK_N)
    if MASK:
        kmask = kpos < hi
        block = tl.load(table + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
    else:
        block = tl.load(table + kpos // PAGE).to(tl.int64)
    slot = block * PAGE + kpos % PAGE
    off = slot[:, None] * stride_cs + kvh * stride_ch + d[None, :]
    if MASK:
        kvmask = kmask[:, None] & dmask[None, :]
        k = tl.load(KC + off, mask=kvmask, other=0.0)
        v = tl.load(VC + off, mask=kvmask, other=0.0)
    elif EVEN_D:  # the common case: whole blocks of a power-of-two head dim, no mask at all
        k = tl.load(KC + off)
        v = tl.load(VC + off)
    else:
        k = tl.load(KC + off, mask=dmask[None, :], other=0.0)
        v = tl.load(VC + off, mask=dmask[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASK:
        s = tl.where(kmask[None, :] & (kpos[None, :] <= qpos[:, None]), s, _NEG)
    return _online_softmax(s, v, m_i, l_i, acc)


@triton.jit(do_not_specialize=["stride_tb"])
def _prefill_kernel(Q, KC, VC, Out, Tables, QStart, Past, New, TileSeq, TileStart, scale_log2,
                    stride_qn, stride_qh, stride_on, stride_oh, stride_cs, stride_ch, stride_tb,
                    GROUP: tl.constexpr, GROUP_P: tl.constexpr, TOK: tl.constexpr, D: tl.constexpr,
                    D_P: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_entry(PDL)
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(TileSeq + tile)
    t0 = tl.load(TileStart + tile)
    qs = tl.load(QStart + seq)
    past = tl.load(Past + seq)
    new = tl.load(New + seq)

    r = tl.arange(0, TOK * GROUP_P)
    tok = t0 + r // GROUP_P
    g = r % GROUP_P
    rmask = (tok < new) & (g < GROUP)
    head = kvh * GROUP + g
    d = tl.arange(0, D_P)
    dmask = d < D
    qrow = (qs + tok).to(tl.int64)
    q = tl.load(Q + qrow[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    qpos = past + tok

    m_i = tl.full([TOK * GROUP_P], _NEG, tl.float32)
    l_i = tl.zeros([TOK * GROUP_P], tl.float32)
    acc = tl.zeros([TOK * GROUP_P, D_P], tl.float32)
    hi = past + tl.minimum(t0 + TOK, new)  # keys [0, hi) can be seen by some row of the tile
    lo = (past + t0 + 1) // BLOCK_N * BLOCK_N  # key blocks below lo are seen by every row: no mask
    table = Tables + seq.to(tl.int64) * stride_tb
    for n0 in range(0, lo, BLOCK_N):
        m_i, l_i, acc = _prefill_block(q, KC, VC, table, n0, hi, qpos, m_i, l_i, acc, scale_log2, kvh,
                                       stride_cs, stride_ch, d, dmask, BLOCK_N, PAGE, False, D == D_P)
    for n0 in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _prefill_block(q, KC, VC, table, n0, hi, qpos, m_i, l_i, acc, scale_log2, kvh,
                                       stride_cs, stride_ch, d, dmask, BLOCK_N, PAGE, True, D == D_P)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + qrow[:, None] * stride_on + head[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


JIT_KERNELS = {"decode": _decode_partial_kernel, "prefill": _prefill_kernel}
"""The attention kernels by name, for tools that compile them apart (`benchmarks.kernel_ptx`)."""


def decode_workspace(rows: int, q_heads: int, splits: int, head_dim: int, device: torch.device) -> dict:
    """Partial outputs of the split-K decode: allocate once per CUDA-graph bucket."""
    return {"o": torch.empty(rows, q_heads, splits, _pow2(head_dim, 16), dtype=torch.float32, device=device),
            "m": torch.empty(rows, q_heads, splits, dtype=torch.float32, device=device),
            "l": torch.empty(rows, q_heads, splits, dtype=torch.float32, device=device)}


@register
class TritonAttention(AttentionKernels):
    """Paged decode / prefill / KV store in Triton (CUDA devices)."""

    name = "triton"
    decode_block_n = 64  # block 64, 3 stages, 4 warps, 4 programs per SM: never slower than the
    decode_stages = 3  # previous (64, 2, 4, 8) on `bench.attention`'s graph-timed decode shapes,
    decode_warps = 4  # 5% faster in geometric mean (H200, docs/kernels.md)
    decode_programs_per_sm = 4
    decode_reads_runs = True
    verify_block_n = 32  # the verify graphs' runs (RUN > 1: M = 8 rows x the group's heads): block
    verify_stages = 2  # 32, 2 stages, 4 warps, 2 programs per SM were the fastest or within 2.5% of
    verify_warps = 4  # it on `bench.attention --verify`'s three shapes, 11-22% less time than the
    verify_programs_per_sm = 2  # decode setting (H200, docs/kernels.md)
    prefill_block_m = 128  # rows of a prefill tile = tokens x query heads of one kv head
    prefill_block_n = 128  # block 128, 3 stages, 8 warps: the fastest or within 4% of it on every prefill
    prefill_stages = 3  # shape of `bench.attention`'s grid on the H200 (docs/kernels.md)
    prefill_warps: int | None = None  # None: 8 for tiles of 128 rows or more, else 4

    @classmethod
    def missing(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            import os

            if os.environ.get("TRITON_INTERPRET") == "1":
                return None  # Triton's interpreter runs the kernels on CPU tensors (tests)
            return f"Triton kernels need a CUDA device, got {device}"
        return None

    @staticmethod
    def _check(cache: torch.Tensor, x: torch.Tensor, name: str) -> None:
        if cache.stride(-1) != 1 or x.stride(-1) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous")

    def tile_tokens(self, group: int) -> int:
        return max(1, self.prefill_block_m // _pow2(group))

    def store_kv(self, k_cache, v_cache, k, v, slots):
        n = k.shape[0]
        if n == 0:
            return
        k, v = k.contiguous() if k.stride(-1) != 1 else k, v.contiguous() if v.stride(-1) != 1 else v
        hkv, d = k.shape[1], k.shape[2]
        _store_kv_kernel[(n,)](k, v, k_cache, v_cache, slots,
                               k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
                               k_cache.stride(1), HKV=hkv, HKV_P=_pow2(hkv), D=d, D_P=_pow2(d), num_warps=1,
                               **pdl.options(k.device))

    def decode(self, q, k_cache, v_cache, meta: DecodeMeta, out):
        rows = meta.rows
        if rows == 0:
            return
        self._check(k_cache, q, "decode")
        hq, d = q.shape[1], q.shape[2]
        hkv = k_cache.shape[1]
        group = hq // hkv
        splits = meta.splits
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"decode splits must be in [1, {MAX_SPLITS}], got {splits}")
        ws = meta.workspace
        if not ws:
            ws = decode_workspace(rows, hq, splits, d, q.device)
        po, pm, pl = ws["o"], ws["m"], ws["l"]
        run = _pow2(meta.max_run) if meta.runs is not None else 1
        block_n, warps, stages = ((self.verify_block_n, self.verify_warps, self.verify_stages) if run > 1 else
                                  (self.decode_block_n, self.decode_warps, self.decode_stages))
        _decode_partial_kernel[(rows, hkv, splits)](
            q, k_cache, v_cache, meta.tables, meta.lens, meta.q_start, meta.seq,
            meta.runs if run > 1 else meta.seq, po, pm, pl,
            (1.0 / math.sqrt(d)) * LOG2E,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), meta.tables.stride(0),
            po.stride(0), po.stride(1), po.stride(2), pm.stride(0), pm.stride(1),
            GROUP=group, GROUP_P=_pow2(group, 16 // run), RUN=run, D=d, D_P=_pow2(d, 16),
            BLOCK_N=block_n, PAGE=meta.block_size, num_warps=warps, num_stages=stages, **pdl.options(q.device))
        _decode_reduce_kernel[(rows, hq)](
            po, pm, pl, out, meta.q_start, meta.seq, splits,
            po.stride(0), po.stride(1), po.stride(2), pm.stride(0), pm.stride(1), out.stride(0), out.stride(1),
            SPLITS_P=MAX_SPLITS, D=d, D_P=_pow2(d, 16), num_warps=4, **pdl.options(q.device))

    def prefill(self, q, k_cache, v_cache, meta: PrefillMeta, out):
        if meta.tiles == 0:
            return
        self._check(k_cache, q, "prefill")
        hq, d = q.shape[1], q.shape[2]
        hkv = k_cache.shape[1]
        group = hq // hkv
        tok = meta.tile_tokens
        if tok * _pow2(group) < 16:
            raise ValueError(f"prefill tile of {tok} tokens x {group} heads is below the 16 rows tl.dot needs")
        _prefill_kernel[(meta.tiles, hkv)](
            q, k_cache, v_cache, out, meta.tables, meta.q_start, meta.past, meta.new, meta.tile_seq,
            meta.tile_start, (1.0 / math.sqrt(d)) * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            meta.tables.stride(0),
            GROUP=group, GROUP_P=_pow2(group), TOK=tok, D=d, D_P=_pow2(d, 16), BLOCK_N=self.prefill_block_n,
            PAGE=meta.block_size, num_warps=self.prefill_warps or (8 if tok * _pow2(group) >= 128 else 4),
            num_stages=self.prefill_stages, **pdl.options(q.device))
