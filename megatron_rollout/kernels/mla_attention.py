"""Triton kernels for multi-head latent attention (`model.mla`) over the paged latent cache.

MLA runs in the absorbed form: every query head attends over the cached rows `[c ; k_pe]`
(`kv_lora_rank` + `qk_pos_emb_head_dim` wide, one row per token shared by all heads) and its
output is the softmax-weighted sum of the latents `c` only. Through the general kernels
(`triton_attention`) that is one kv head with a group of every query head and a head dim of 576
padded to 1,024, the value read a second time from the same slot and 64 output columns computed
only to be dropped; its accumulator, every head x 1,024 columns in fp32, does not fit a program.
Here a program owns `BLOCK_H` heads (the M side of `tl.dot`), reads each key block once as its
latent part and its RoPE part, scores `q_lat c^T + q_pe k_pe^T` and accumulates `p c`
(`[BLOCK_H, kv_lora_rank]` in fp32):

- `_mla_decode_kernel`: flash-decoding, program (head block, row, split) over its share of the
  row's history; the partial results are merged by `triton_attention`'s reduce kernel, whose width
  is the latent's here. Grid and workspace are static per batch, so a decode graph captures it;
  rows of length 0 produce zeros.
- `_mla_prefill_kernel`: causal with an offset; a program owns `TOK` new tokens x `BLOCK_H` heads
  and walks the keys `[0, past + last token of the tile]`.

The output keeps the query's shape `[N, heads, kv_lora_rank + qk_pos_emb_head_dim]` (the
`AttentionKernels` contract); only the first `kv_lora_rank` columns are written, the ones the model
reads. Stores are `TritonAttention`'s (key and value are one row, one storage). The logits' scale is
the contract's 1/sqrt(query width): the model folds MLA's own scale into the query.

Left out: a decompressed (non-absorbed) prefill, cheaper in FLOPs for long prompts, and FP8 latents.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from megatron_rollout.kernels import pdl
from megatron_rollout.kernels.pdl import entry as pdl_entry
from megatron_rollout.kernels.registry import DecodeMeta, PrefillMeta
from megatron_rollout.kernels.triton_attention import (
    LOG2E,
    MAX_SPLITS,
    TritonAttention,
    _decode_reduce_kernel,
    _online_softmax,
    _pow2,
    decode_workspace,
)

_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": fully masked rows stay free of NaN


@triton.jit
def _mla_scores(q_lat, q_pe, KV, slot, kmask, c, cmask, e, emask, stride_cs, R: tl.constexpr):
    """One key block: its latents [BLOCK_N, R_P] and the scores [M, BLOCK_N] (fp32, unscaled)."""
    base = KV + slot[:, None] * stride_cs
    lat = tl.load(base + c[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
    pe = tl.load(base + R + e[None, :], mask=kmask[:, None] & emask[None, :], other=0.0)
    return lat, tl.dot(q_lat, tl.trans(lat)) + tl.dot(q_pe, tl.trans(pe))


@triton.jit(do_not_specialize=["stride_tb", "stride_mb", "stride_mh"])
def _mla_decode_kernel(Q, KV, Tables, Lens, QStart, Seq, PartO, PartM, PartL, scale_log2,
                       stride_qn, stride_qh, stride_cs, stride_tb,
                       stride_ob, stride_oh, stride_os, stride_mb, stride_mh,
                       HEADS: tl.constexpr, BLOCK_H: tl.constexpr, R: tl.constexpr, R_P: tl.constexpr,
                       DR: tl.constexpr, DR_P: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_entry(PDL)
    hb = tl.program_id(0)  # fastest: the head blocks of one row and split run together, sharing its keys in L2
    b = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    seq = tl.load(Seq + b)
    length = tl.load(Lens + seq)
    per = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
    start = split * per
    end = tl.minimum(start + per, length)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < HEADS
    c = tl.arange(0, R_P)
    cmask = c < R
    e = tl.arange(0, DR_P)
    emask = e < DR
    row = tl.load(QStart + seq).to(tl.int64)
    qbase = Q + row * stride_qn + h[:, None] * stride_qh
    q_lat = tl.load(qbase + c[None, :], mask=hmask[:, None] & cmask[None, :], other=0.0)  # [BLOCK_H, R_P]
    q_pe = tl.load(qbase + R + e[None, :], mask=hmask[:, None] & emask[None, :], other=0.0)  # [BLOCK_H, DR_P]

    m_i = tl.full([BLOCK_H], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_P], tl.float32)
    table = Tables + seq.to(tl.int64) * stride_tb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < end
        block = tl.load(table + pos // PAGE, mask=pmask, other=0).to(tl.int64)
        lat, s = _mla_scores(q_lat, q_pe, KV, block * PAGE + pos % PAGE, pmask, c, cmask, e, emask, stride_cs, R)
        m_i, l_i, acc = _online_softmax(tl.where(pmask[None, :], s * scale_log2, _NEG), lat, m_i, l_i, acc)

    obase = b.to(tl.int64) * stride_ob + split * stride_os
    tl.store(PartO + obase + h[:, None] * stride_oh + c[None, :], acc, mask=hmask[:, None] & cmask[None, :])
    mbase = b.to(tl.int64) * stride_mb + split
    tl.store(PartM + mbase + h * stride_mh, m_i, mask=hmask)
    tl.store(PartL + mbase + h * stride_mh, l_i, mask=hmask)


@triton.jit(do_not_specialize=["stride_tb"])
def _mla_prefill_kernel(Q, KV, Out, Tables, QStart, Past, New, TileSeq, TileStart, scale_log2,
                        stride_qn, stride_qh, stride_on, stride_oh, stride_cs, stride_tb,
                        HEADS: tl.constexpr, BLOCK_H: tl.constexpr, TOK: tl.constexpr, R: tl.constexpr,
                        R_P: tl.constexpr, DR: tl.constexpr, DR_P: tl.constexpr, BLOCK_N: tl.constexpr,
                        PAGE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_entry(PDL)
    hb = tl.program_id(0)  # fastest, as in decode
    tile = tl.program_id(1)
    seq = tl.load(TileSeq + tile)
    t0 = tl.load(TileStart + tile)
    qs = tl.load(QStart + seq)
    past = tl.load(Past + seq)
    new = tl.load(New + seq)

    r = tl.arange(0, TOK * BLOCK_H)  # row = (token, head), heads fastest
    tok = t0 + r // BLOCK_H
    h = hb * BLOCK_H + r % BLOCK_H
    rmask = (tok < new) & (h < HEADS)
    c = tl.arange(0, R_P)
    cmask = c < R
    e = tl.arange(0, DR_P)
    emask = e < DR
    qrow = (qs + tok).to(tl.int64)
    qbase = Q + qrow[:, None] * stride_qn + h[:, None] * stride_qh
    q_lat = tl.load(qbase + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)  # [M, R_P]
    q_pe = tl.load(qbase + R + e[None, :], mask=rmask[:, None] & emask[None, :], other=0.0)  # [M, DR_P]
    qpos = past + tok

    m_i = tl.full([TOK * BLOCK_H], _NEG, tl.float32)
    l_i = tl.zeros([TOK * BLOCK_H], tl.float32)
    acc = tl.zeros([TOK * BLOCK_H, R_P], tl.float32)
    hi = past + tl.minimum(t0 + TOK, new)  # keys [0, hi) are seen by some row of the tile
    table = Tables + seq.to(tl.int64) * stride_tb
    for n0 in range(0, hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        block = tl.load(table + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
        lat, s = _mla_scores(q_lat, q_pe, KV, block * PAGE + kpos % PAGE, kmask, c, cmask, e, emask, stride_cs, R)
        s = tl.where(kmask[None, :] & (kpos[None, :] <= qpos[:, None]), s * scale_log2, _NEG)
        m_i, l_i, acc = _online_softmax(s, lat, m_i, l_i, acc)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + qrow[:, None] * stride_on + h[:, None] * stride_oh + c[None, :],
             out.to(Out.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


JIT_KERNELS = {"decode": _mla_decode_kernel, "prefill": _mla_prefill_kernel}
"""The MLA kernels by name, for tools that compile them apart (`benchmarks.kernel_ptx`)."""


class TritonMLA(TritonAttention):
    """Paged MLA decode and prefill over the latent cache `[slots, 1, latent + rope]` (CUDA, or
    Triton's interpreter on CPU). `latent`: the model's `kv_lora_rank`; the rest of a row is RoPE."""

    name = "triton-mla"
    decode_block_h = 16  # heads per decode program: the M side of tl.dot (>= 16)
    decode_block_n = 32  # with a 512-wide latent: 32 x 512 bf16 = 32 KB of keys per stage
    decode_stages = 2
    decode_warps = 4
    decode_programs_per_sm = 1  # splits count rows x splits; each row already has heads/BLOCK_H programs
    prefill_block_h = 16
    prefill_block_m = 64  # rows of a prefill tile = tokens x heads of one head block
    prefill_block_n = 32
    prefill_stages = 2
    prefill_warps = 8  # a 64 x 512 fp32 accumulator: 128 registers a thread over 8 warps

    def __init__(self, latent: int) -> None:
        if latent <= 0:
            raise ValueError(f"the MLA latent width (kv_lora_rank) must be positive, got {latent}")
        self.latent = latent

    def tile_tokens(self, group: int) -> int:
        bh, bm = self.prefill_block_h, self.prefill_block_m
        if bh < 16 or bm % bh or bh & (bh - 1) or bm & (bm - 1) or self.decode_block_h < 16:
            raise ValueError(f"MLA tiles: block_h (decode {self.decode_block_h}, prefill {bh}) must be powers of two "
                             f">= 16 and prefill_block_m ({bm}) a power-of-two multiple of prefill_block_h")
        return bm // bh

    def _widths(self, q: torch.Tensor, cache: torch.Tensor) -> tuple[int, int]:
        if cache.shape[1] != 1 or q.shape[-1] != cache.shape[-1] or q.shape[-1] <= self.latent:
            raise ValueError(f"MLA attention needs one cached row per token as wide as the query, wider than the "
                             f"latent ({self.latent}); got cache {tuple(cache.shape)} and query {tuple(q.shape)}")
        return self.latent, q.shape[-1] - self.latent

    def decode(self, q, k_cache, v_cache, meta: DecodeMeta, out):
        rows = meta.rows
        if rows == 0:
            return
        self._check(k_cache, q, "decode")
        r, dr = self._widths(q, k_cache)
        heads, splits = q.shape[1], meta.splits
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"decode splits must be in [1, {MAX_SPLITS}], got {splits}")
        ws = meta.workspace or decode_workspace(rows, heads, splits, r, q.device)
        po, pm, pl = ws["o"], ws["m"], ws["l"]
        if po.shape[-1] < r or po.shape[1] < heads:
            raise ValueError(f"decode workspace {tuple(po.shape)} is too small for {heads} heads of width {r}")
        bh = self.decode_block_h
        _mla_decode_kernel[(triton.cdiv(heads, bh), rows, splits)](
            q, k_cache, meta.tables, meta.lens, meta.q_start, meta.seq, po, pm, pl, (1.0 / math.sqrt(r + dr)) * LOG2E,
            q.stride(0), q.stride(1), k_cache.stride(0), meta.tables.stride(0),
            po.stride(0), po.stride(1), po.stride(2), pm.stride(0), pm.stride(1),
            HEADS=heads, BLOCK_H=bh, R=r, R_P=_pow2(r, 16), DR=dr, DR_P=_pow2(dr, 16), BLOCK_N=self.decode_block_n,
            PAGE=meta.block_size, num_warps=self.decode_warps, num_stages=self.decode_stages,
            **pdl.options(q.device))
        _decode_reduce_kernel[(rows, heads)](
            po, pm, pl, out, meta.q_start, meta.seq, splits,
            po.stride(0), po.stride(1), po.stride(2), pm.stride(0), pm.stride(1), out.stride(0), out.stride(1),
            SPLITS_P=MAX_SPLITS, D=r, D_P=_pow2(r, 16), num_warps=4, **pdl.options(q.device))

    def prefill(self, q, k_cache, v_cache, meta: PrefillMeta, out):
        if meta.tiles == 0:
            return
        self._check(k_cache, q, "prefill")
        r, dr = self._widths(q, k_cache)
        heads, bh = q.shape[1], self.prefill_block_h
        _mla_prefill_kernel[(triton.cdiv(heads, bh), meta.tiles)](
            q, k_cache, out, meta.tables, meta.q_start, meta.past, meta.new, meta.tile_seq, meta.tile_start,
            (1.0 / math.sqrt(r + dr)) * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), meta.tables.stride(0),
            HEADS=heads, BLOCK_H=bh, TOK=meta.tile_tokens, R=r, R_P=_pow2(r, 16), DR=dr, DR_P=_pow2(dr, 16),
            BLOCK_N=self.prefill_block_n, PAGE=meta.block_size, num_warps=self.prefill_warps,
            num_stages=self.prefill_stages, **pdl.options(q.device))
