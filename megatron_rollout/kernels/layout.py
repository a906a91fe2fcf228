"""Index building for one forward over paged KV, and the attention backend the model calls.

`build_layout` turns the runner's spans (block table, cached positions, new positions) into the
device index tensors the kernels read: one int32 host array (numpy, vectorised: no per-token
Python), pinned and copied in one non-blocking transfer.

Every view into that array starts on a 16-byte boundary and every block-table row is a multiple
of `TABLE_ALIGN` entries wide. Triton specialises a kernel on whether each pointer argument is
16-byte aligned and on whether each integer argument is 1 or a multiple of 16; views packed back
to back at batch-dependent offsets (and a table stride equal to the longest table of the batch)
gave each batch shape its own specialisation, so the first replays of a run compiled dozens of
kernel variants inside the timed region. Aligned, the kernels see one signature per model.

`StaticDecodeLayout` is the CUDA-graph version for decode batches: fixed-size device buffers,
refilled in place before each replay, so the captured kernels see new rows without being
re-captured.

`KernelPagedBatch` implements `model.attention.AttentionBackend` on top of a layout and an
`AttentionKernels` backend: store the new K/V, then decode rows (one new token) go to the
split-K decode kernel and the other spans to the causal prefill kernel.

Left out: sequences longer than their block table (the engine grows tables before a forward) and
any bookkeeping of which blocks are free (that is `kv.block_pool`'s job).
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_rollout.kernels.registry import AttentionKernels, DecodeMeta, PrefillMeta
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model.attention import AttentionBackend
from megatron_rollout.types import SeqSpan


def choose_splits(rows: int, kv_heads: int, num_sms: int, max_len: int | None = None, cap: int = 32,
                  min_per_split: int = 256, programs_per_sm: int = 8) -> int:
    """KV splits per decode row (a power of two): about `programs_per_sm` programs per SM, so
    enough loads are in flight to stream the KV at full bandwidth, each split at least
    `min_per_split` positions long when the longest row is known."""
    want = math.ceil(programs_per_sm * num_sms / max(1, rows * kv_heads))
    splits = 1 << max(0, math.ceil(math.log2(want)))
    if max_len is not None:
        by_len = max(1, math.ceil(max_len / min_per_split))
        splits = min(splits, 1 << (by_len.bit_length() - 1))  # a power of two
    return max(1, min(cap, splits))


def decode_runs(counts: Sequence[int], max_run: int) -> np.ndarray:
    """`DecodeMeta.runs` of one-token rows made by `runner.speculative.flatten` from rows of
    `counts` new positions each: every row's positions are one run, cut every `max_run` rows."""
    c = np.asarray(counts, np.int64)
    row = np.repeat(np.arange(c.size), c)  # the row each one-token row came from
    at = np.arange(row.size) - (np.cumsum(c) - c)[row]  # its position in that row
    return np.where(at % max_run == 0, np.minimum(max_run, c[row] - at), 0).astype(np.int32)


ALIGN_ELEMS = 4
"""int32 elements per 16 bytes: every packed view starts at a multiple of this."""
TABLE_ALIGN = 16
"""Block-table rows are padded to a multiple of this many entries (the table stride is then never
1 and always a multiple of 16, whatever the batch: one Triton specialisation)."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def table_width(longest: int) -> int:
    """Block-table row width for a batch whose longest table has `longest` blocks."""
    return _round_up(max(longest, 1), TABLE_ALIGN)


def pack_aligned(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Concatenate int32 arrays so that each starts at a multiple of `ALIGN_ELEMS` elements;
    returns the packed array and each part's (offset, size)."""
    spans, at = [], 0
    for p in parts:
        spans.append((at, int(p.size)))
        at += _round_up(int(p.size), ALIGN_ELEMS)
    packed = np.zeros(max(at, ALIGN_ELEMS), np.int32)
    for p, (off, size) in zip(parts, spans):
        packed[off:off + size] = np.asarray(p).reshape(-1)
    return packed, spans


def to_device(host: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host array on `device` without a host wait (through pinned memory on CUDA)."""
    t = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(frozen=True)
class ForwardLayout:
    """Everything one forward needs on the device, as int32 views of one buffer."""

    tokens: torch.Tensor
    """[N] token ids of the new positions, span by span."""
    positions: torch.Tensor
    """[N] position of each new token."""
    slots: torch.Tensor
    """[N] KV slot of each new token (< 0: padded row, not stored)."""
    logits_rows: torch.Tensor
    """[R] int64 rows of the sampled spans' last tokens."""
    decode: DecodeMeta | None
    prefill: PrefillMeta | None


class TableCache:
    """Block tables converted from Python ints, kept by `SpanInput.key` between forwards: a keyed
    table only grows by appending, so a forward converts only its new entries and copies the rest.
    An eager or piecewise forward rebuilds its layout every time (`build_layout`), over rows whose
    tables reach thousands of entries at long contexts: a mixed `chunked` step holds every decoding
    row, and a session's next turn prefills over its whole context's table. The least recently used
    tables go once more than `budget` entries are held (4 bytes each)."""

    def __init__(self, budget: int = 1 << 22) -> None:
        self.budget = budget
        self._held: OrderedDict[Hashable, tuple[np.ndarray, int]] = OrderedDict()
        self._size = 0
        """Entries the held arrays have room for."""

    def entries(self, key: Hashable, table: Sequence[int]) -> np.ndarray:
        """`table` as int32, converting only what `key` did not hold yet."""
        size = len(table)
        held, done = self._held.pop(key, None) or (None, 0)
        if held is not None:
            self._size -= len(held)
        if held is None or done > size:  # not the table the key held: start again
            held, done = np.empty(max(size, 16), np.int32), 0
        elif size > len(held):
            grown = np.empty(max(size, 2 * len(held)), np.int32)
            grown[:done] = held[:done]
            held = grown
        held[done:size] = table[done:size]
        self._held[key] = (held, size)
        self._size += len(held)
        while self._size > self.budget and len(self._held) > 1:
            self._size -= len(self._held.popitem(last=False)[1][0])
        return held[:size]


def build_layout(spans: Sequence[SeqSpan], token_ids: Sequence[Sequence[int]], sample: Sequence[bool],
                 block_size: int, kernels: AttentionKernels, q_heads: int, kv_heads: int, head_dim: int,
                 device: torch.device, num_sms: int = 132, keys: Sequence[Hashable | None] | None = None,
                 cache: TableCache | None = None) -> ForwardLayout:
    """Device indices for the spans of one forward (new tokens laid out span after span); with
    `keys` (see `SpanInput.key`) and a `cache`, the tables come through it."""
    s_count = len(spans)
    news = np.fromiter((s.new for s in spans), np.int64, s_count)
    pasts = np.fromiter((s.past for s in spans), np.int64, s_count)
    width = table_width(max([len(s.table) for s in spans] + [1]))
    tables = np.zeros((s_count, width), np.int32)
    for i, s in enumerate(spans):
        key = keys[i] if keys is not None and cache is not None else None
        tables[i, :len(s.table)] = s.table if key is None else cache.entries(key, s.table)
    q_start = np.cumsum(news) - news
    n = int(news.sum())
    seg = np.repeat(np.arange(s_count), news)
    pos = np.arange(n) - q_start[seg] + pasts[seg]
    slots = tables[seg, pos // block_size].astype(np.int64) * block_size + pos % block_size
    tokens = np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, n)
    lens = pasts + news
    dec = np.nonzero(news == 1)[0]
    multi = np.nonzero(news > 1)[0]
    tok = kernels.tile_tokens(q_heads // kv_heads)
    ntiles = (news[multi] + tok - 1) // tok
    t_count = int(ntiles.sum())
    tile_seq = np.repeat(multi, ntiles)
    tile_start = (np.arange(t_count) - np.repeat(np.cumsum(ntiles) - ntiles, ntiles)) * tok
    if kernels.prefill_heavy_first:  # the tiles that see the most keys launch first
        order = np.argsort(-(pasts[tile_seq] + tile_start), kind="stable")
        tile_seq, tile_start = tile_seq[order], tile_start[order]
    rows = (q_start + news - 1)[np.asarray(sample, dtype=bool)] if s_count else np.zeros(0, np.int64)

    cu_q = np.append(q_start, n)
    parts = [tokens, pos, slots, q_start, pasts, news, lens, dec, tile_seq, tile_start, rows, cu_q,
             tables.reshape(-1)]
    packed, offsets = pack_aligned(parts)
    dev = to_device(packed, device)  # a fresh allocation: its start is aligned far beyond 16 bytes
    views = [dev[off:off + size] for off, size in offsets]
    t_tok, t_pos, t_slot, t_qs, t_past, t_new, t_len, t_dec, t_tseq, t_tstart, t_rows, t_cu, t_tab = views
    t_tab = t_tab.view(s_count, width)

    decode = None
    if dec.size:
        splits = choose_splits(int(dec.size), kv_heads, num_sms, int(lens[dec].max()),
                               programs_per_sm=kernels.decode_programs_per_sm)
        decode = DecodeMeta(t_dec, t_tab, t_len, t_qs, splits, block_size, host_seq=dec, host_tables=tables,
                            host_lens=lens, host_q_start=q_start)
    prefill = None
    if multi.size:
        prefill = PrefillMeta(t_tab, t_qs, t_past, t_new, t_tseq, t_tstart, tok, tuple(multi.tolist()),
                              int(news[multi].max()), int(lens[multi].max()), block_size, host_tables=tables,
                              host_q_start=q_start, host_past=pasts, host_new=news, cu_q=t_cu, lens=t_len,
                              max_len=int(lens.max()), tokens=int(news[multi].sum()))
    return ForwardLayout(t_tok, t_pos, t_slot, t_rows.long(), decode, prefill)


class KernelPagedBatch(AttentionBackend):
    """`AttentionBackend` over a `PagedKVCache` through an `AttentionKernels` backend."""

    def __init__(self, cache: PagedKVCache, layout: ForwardLayout, kernels: AttentionKernels) -> None:
        self.cache, self.layout, self.kernels = cache, layout, kernels

    @property
    def positions(self) -> torch.Tensor:
        return self.layout.positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """As `AttentionBackend.attend`; `out` (optional, q's shape and dtype, last dim contiguous):
        where the result goes (a piecewise graph's static buffer, so nothing is copied after)."""
        kc, vc = self.cache.k[layer], self.cache.v[layer]  # [slots, hkv, d]
        self.kernels.store_kv(kc, vc, k, v, self.layout.slots)
        if out is None:
            out = torch.empty_like(q)
        elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
            raise ValueError(f"attention out must be a {q.dtype} tensor of shape {tuple(q.shape)} with a contiguous "
                             f"last dim, got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
        self.kernels.attend(q, kc, vc, self.layout.decode, self.layout.prefill, out)
        return out


def _moving_down(keys: Sequence[Hashable | None], before: dict[Hashable, tuple[int, int]], tables: np.ndarray
                 ) -> dict[Hashable, np.ndarray]:
    """The entries of each key whose first row in this fill lies below its old row: that old row is
    overwritten before the key is reached, so they are copied aside first."""
    saved, seen = {}, set()
    for i, key in enumerate(keys):
        if key is not None and key not in seen:
            seen.add(key)
            row, done = before.get(key, (i, 0))
            if row < i:
                saved[key] = tables[row, :done].copy()
    return saved


class StaticDecodeLayout:
    """Fixed-size decode indices for one CUDA-graph batch size, refilled in place.

    Rows past the live batch are padding: token 0 at position 0, slot -1 (nothing stored) and
    length 0 (attention writes zeros), so a graph captured for `rows` serves any batch up to it.
    The five per-row sections are `stride` (rows rounded up to 16 bytes) apart and the tables
    start after them, so every view is 16-byte aligned (see the module docstring).

    `max_run` > 1 (the verify and draft graphs of speculative decoding), for a backend that reads a
    run's history once (`AttentionKernels.decode_reads_runs`; any other takes 1): `fill` also marks
    the runs of rows over one history its caller names (`decode_runs`), and the KV splits are sized
    for the runs' heads, the rows that read the cache."""

    SECTIONS = 5
    """tokens, positions, slots, lengths, runs."""

    def __init__(self, rows: int, table_width: int, block_size: int, kernels: AttentionKernels, q_heads: int,
                 kv_heads: int, head_dim: int, device: torch.device, num_sms: int, max_run: int = 1) -> None:
        if max_run < 1:
            raise ValueError(f"max_run must be at least 1, got {max_run}")
        if not kernels.decode_reads_runs:
            max_run = 1  # it computes every row alone: no runs to mark, the splits of plain rows
        width = _round_up(table_width, TABLE_ALIGN)
        self.rows, self.width, self.block_size, self.max_run = rows, width, block_size, max_run
        self.stride = st = _round_up(rows, ALIGN_ELEMS)
        size = self.SECTIONS * st + rows * width
        self.device_buf = torch.zeros(size, dtype=torch.int32, device=device)
        self.host_buf = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host = self.host_buf.numpy()
        self._copied: torch.cuda.Event | None = None
        b = rows
        d = self.device_buf
        self.tokens, self.positions = d[:b], d[st:st + b]
        self.slots, self.lens = d[2 * st:2 * st + b], d[3 * st:3 * st + b]
        self.runs = d[4 * st:4 * st + b]
        self.tables = d[self.SECTIONS * st:].view(rows, width)
        self.arange = torch.arange(rows, dtype=torch.int32, device=device)
        self.logits_rows = torch.arange(rows, dtype=torch.int64, device=device)
        per_sm = (kernels.verify_programs_per_sm if max_run > 1 else None) or kernels.decode_programs_per_sm
        splits = choose_splits(-(-rows // max_run), kv_heads, num_sms, programs_per_sm=per_sm)  # runs' heads read
        workspace = {}
        if hasattr(kernels, "decode_block_n"):
            from megatron_rollout.kernels.triton_attention import decode_workspace

            workspace = decode_workspace(rows, q_heads, splits, head_dim, device)
        self.decode = DecodeMeta(self.arange, self.tables, self.lens, self.arange, splits, block_size,
                                 workspace=workspace, runs=self.runs if max_run > 1 else None, max_run=max_run)
        self.layout = ForwardLayout(self.tokens, self.positions, self.slots, self.logits_rows, self.decode, None)
        self.fill_padding()

    def fill_padding(self) -> None:
        """Every row padding (used while capturing)."""
        self._wait_copy()
        self._written: list[tuple[Hashable, int] | None] = [None] * self.rows
        h, st = self.host, self.stride
        h[:self.SECTIONS * st] = 0
        h[2 * st:3 * st] = -1
        h[4 * st:5 * st] = 1
        self._upload(0)

    def fill(self, spans: Sequence[SeqSpan], tokens: Sequence[int], keys: Sequence[Hashable | None] | None = None,
             runs: Sequence[int] | None = None) -> None:
        """Load one decode batch (`len(spans)` <= rows; one new token per span). `runs`: the spans
        are `runner.speculative.flatten`'s rows of rows with these new-position counts (marked as
        runs where `max_run` > 1; None: each span alone). `keys` (see
        `SpanInput.key`): a key filled last time has its table's earlier entries in the host buffer
        already, in its old row: they are reused (in place, or by one row copy where the batch
        shifted) and only the new entries are converted from Python ints. Rows move up as older
        ones finish. A verify forward's (`runs` given) also move down, whenever a row before them
        drafts more than last time: those keys' entries are copied aside before their old rows are
        overwritten (elsewhere a row that moved down is converted whole), and its consecutive rows
        share a key (a drafting row's positions): the first is filled so, the others copy it. A long
        context's table is thousands of entries, converted every step otherwise."""
        n, b, bs, st = len(spans), self.rows, self.block_size, self.stride
        if n > b:
            raise ValueError(f"decode batch of {n} rows exceeds this graph's {b}")
        self._wait_copy()
        h = self.host
        tables = h[self.SECTIONS * st:].reshape(b, self.width)
        pasts = np.fromiter((s.past for s in spans), np.int64, n)
        before = {entry[0]: (row, entry[1]) for row, entry in enumerate(self._written) if entry is not None}
        shared = runs is not None and keys is not None  # a verify forward's rows: they move down too
        saved = _moving_down(keys, before, tables) if shared else {}
        written: list[tuple[Hashable, int] | None] = [None] * b
        placed: dict[Hashable, tuple[int, int]] = {}
        for i, s in enumerate(spans):
            size, key = len(s.table), keys[i] if keys is not None else None
            if size > self.width:
                raise ValueError(f"block table of {size} blocks exceeds the graph's width {self.width}")
            first = placed.get(key) if shared and key is not None else None
            if first is not None and first[1] == size:  # another position of the row just written
                tables[i, :size] = tables[first[0], :size]
                written[i] = (key, size)
                continue
            row, done = before.get(key, (None, 0)) if key is not None else (None, 0)
            if row is None or done > size or (row < i and key not in saved):
                done = 0
            elif row < i:
                tables[i, :done] = saved[key]
            elif row > i:
                tables[i, :done] = tables[row, :done]
            tables[i, done:size] = s.table[done:]
            written[i] = (key, size) if key is not None else None
            if shared and key is not None:
                placed[key] = (i, size)
        self._written = written
        h[:n] = tokens
        h[n:b] = 0
        h[st:st + n] = pasts
        h[st + n:st + b] = 0
        rows = np.arange(n)
        h[2 * st:2 * st + n] = tables[rows, pasts // bs].astype(np.int64) * bs + pasts % bs
        h[2 * st + n:2 * st + b] = -1
        h[3 * st:3 * st + n] = pasts + 1
        h[3 * st + n:3 * st + b] = 0
        h[4 * st:4 * st + n] = decode_runs(runs, self.max_run) if runs is not None and self.max_run > 1 else 1
        h[4 * st + n:4 * st + b] = 1
        self._upload(n)

    def _upload(self, n: int) -> None:
        end = self.SECTIONS * self.stride + n * self.width
        self.device_buf[:end].copy_(self.host_buf[:end], non_blocking=True)
        if self.device_buf.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _wait_copy(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffer is about to be rewritten
            self._copied = None
