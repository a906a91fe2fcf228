"""Index layouts keep one Triton specialisation per model: every view 16-byte aligned and the block
table stride a multiple of 16, whatever the batch (CPU), and a CUDA run of many batch shapes
compiles each attention kernel once (GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rollout.kernels.layout import (
    ALIGN_ELEMS,
    TABLE_ALIGN,
    StaticDecodeLayout,
    TableCache,
    build_layout,
    decode_runs,
    pack_aligned,
    table_width,
)
from megatron_rollout.kernels.registry import PortableAttention
from megatron_rollout.types import SeqSpan


def _spans(rng: np.random.Generator, count: int, bs: int) -> list[SeqSpan]:
    spans, at = [], 0
    for _ in range(count):
        past = int(rng.integers(0, 90))
        new = 1 if rng.random() < 0.5 else int(rng.integers(2, 40))
        k = -(-(past + new) // bs)
        spans.append(SeqSpan(tuple(range(at, at + k)), past, new))
        at += k
    return spans


def _tensors(layout) -> dict[str, torch.Tensor]:
    out = {"tokens": layout.tokens, "positions": layout.positions, "slots": layout.slots}
    if layout.decode is not None:
        d = layout.decode
        out.update(seq=d.seq, tables=d.tables, lens=d.lens, q_start=d.q_start)
    if layout.prefill is not None:
        p = layout.prefill
        out.update(past=p.past, new=p.new, tile_seq=p.tile_seq, tile_start=p.tile_start, ptables=p.tables,
                   cu_q=p.cu_q, plens=p.lens)
    return out


def test_pack_aligned_offsets_and_values():
    parts = [np.arange(3), np.arange(5) + 10, np.zeros(0, np.int32), np.arange(4) + 20]
    packed, spans = pack_aligned(parts)
    assert spans == [(0, 3), (4, 5), (12, 0), (12, 4)]
    assert packed.dtype == np.int32
    for p, (off, size) in zip(parts, spans):
        assert off % ALIGN_ELEMS == 0
        assert packed[off:off + size].tolist() == list(p)


def test_table_width_is_a_multiple_of_16_and_never_1():
    assert [table_width(n) for n in (0, 1, 15, 16, 17, 2560)] == [16, 16, 16, 16, 32, 2560]


@pytest.mark.parametrize("seed", range(6))
def test_build_layout_views_are_aligned_for_any_batch(seed):
    rng = np.random.default_rng(seed)
    bs = 16
    spans = _spans(rng, int(rng.integers(1, 9)), bs)
    tokens = [rng.integers(0, 50, s.new).tolist() for s in spans]
    layout = build_layout(spans, tokens, [True] * len(spans), bs, PortableAttention(), 8, 4, 8, torch.device("cpu"))
    tensors = _tensors(layout)
    base = layout.tokens.data_ptr()
    for name, t in tensors.items():
        assert (t.data_ptr() - base) % 16 == 0, (name, t.data_ptr() - base)
    table = tensors.get("tables", tensors.get("ptables"))
    assert table.stride(0) % TABLE_ALIGN == 0 and table.stride(0) >= TABLE_ALIGN
    # values unchanged by the padding: positions and slots of every new token
    pos = np.concatenate([np.arange(s.past, s.past + s.new) for s in spans])
    assert layout.positions.tolist() == pos.tolist()
    slots = np.concatenate([[s.table[p // bs] * bs + p % bs for p in range(s.past, s.past + s.new)] for s in spans])
    assert layout.slots.tolist() == slots.tolist()
    assert layout.tokens.tolist() == [t for ts in tokens for t in ts]


def test_prefill_meta_describes_every_span_for_varlen_libraries():
    """cu_q / lens / max_len cover every span of the forward, decode rows included (what a varlen
    kernel like FA3 takes for one call over the whole forward)."""
    spans = [SeqSpan(tuple(range(0, 3)), 40, 1), SeqSpan(tuple(range(3, 5)), 5, 20), SeqSpan(tuple(range(5, 8)), 33, 1)]
    tokens = [[1] * s.new for s in spans]
    layout = build_layout(spans, tokens, [True] * 3, 16, PortableAttention(), 8, 4, 8, torch.device("cpu"))
    meta = layout.prefill
    assert meta.cu_q.tolist() == [0, 1, 21, 22]
    assert meta.lens.tolist() == [41, 25, 34]
    assert meta.max_len == 41 and meta.max_total == 25  # max_total: the prefill spans only
    assert meta.spans == (1,) and meta.max_new == 20


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
def test_static_decode_layout_views_are_aligned(rows):
    layout = StaticDecodeLayout(rows, 37, 16, PortableAttention(), 8, 4, 8, torch.device("cpu"), num_sms=4)
    base = layout.device_buf.data_ptr()
    for t in (layout.tokens, layout.positions, layout.slots, layout.lens, layout.tables):
        assert (t.data_ptr() - base) % 16 == 0
    assert layout.tables.shape == (rows, 48) and layout.tables.stride(0) == 48
    spans = [SeqSpan((3, 1, 4), 40, 1)] * min(rows, 2)
    layout.fill(spans, [7] * len(spans))
    n = len(spans)
    assert layout.tokens.tolist() == [7] * n + [0] * (rows - n)
    assert layout.positions.tolist() == [40] * n + [0] * (rows - n)
    assert layout.slots.tolist() == [4 * 16 + 8] * n + [-1] * (rows - n)
    assert layout.lens.tolist() == [41] * n + [0] * (rows - n)
    assert layout.tables[0, :3].tolist() == [3, 1, 4]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("drafts", [0, 3])
def test_keyed_fills_give_the_tables_of_full_fills(seed, drafts):
    """Decode batches over many steps: rows grow by appending, finish (later rows move up), join
    at the end, and are preempted (a new lifetime: a new key, a new table). With `drafts`, each row
    is a verify forward's: 1 to 1 + drafts one-query rows under its key, a new count every step, so
    the rows after it move up or down; some rows have no key. The keyed fill, which converts only
    new entries, must leave in the device buffer what a full fill leaves."""
    rng = np.random.default_rng(seed)
    rows = 8 * (1 + drafts)
    keyed = StaticDecodeLayout(rows, 64, 4, PortableAttention(), 8, 4, 8, torch.device("cpu"), num_sms=4)
    full = StaticDecodeLayout(rows, 64, 4, PortableAttention(), 8, 4, 8, torch.device("cpu"), num_sms=4)
    live: dict[tuple[int, int], list[int]] = {}
    next_rid, next_block = 0, 0
    for _step in range(60):
        for key in list(live):
            roll = rng.random()
            if roll < 0.1:
                del live[key]  # finished
            elif roll < 0.15:
                del live[key]  # preempted: the same request comes back under a new lifetime
                live[(key[0], key[1] + 1)] = [int(b) for b in rng.integers(0, 1000, int(rng.integers(1, 5)))]
            elif rng.random() < 0.3:
                live[key].append(next_block)  # the row crossed into a new block
                next_block += 1
        while len(live) < 8 and rng.random() < 0.5:
            live[(next_rid, 0)] = [int(b) for b in rng.integers(0, 1000, int(rng.integers(1, 20)))]
            next_rid += 1
        runs = [1 + int(rng.integers(0, drafts + 1)) for _ in sorted(live)[:8]]
        keys = [k for k, run in zip(sorted(live)[:8], runs) for _ in range(run)]  # oldest first
        spans = [SeqSpan(tuple(live[k]), 4 * len(live[k]) - 1, 1) for k in keys]
        unkeyed = {k for k in live if rng.random() < 0.2}  # rows that promise nothing (an MTP draft's)
        keyed.fill(spans, [1] * len(spans), [None if k in unkeyed else k for k in keys], runs if drafts else None)
        full.fill(spans, [1] * len(spans), None, runs if drafts else None)
        for i, k in enumerate(keys):  # entries past a row's length are never read (its length bounds attention)
            assert keyed.tables[i, :len(live[k])].tolist() == full.tables[i, :len(live[k])].tolist() == live[k]
        assert torch.equal(keyed.device_buf[:4 * keyed.stride], full.device_buf[:4 * full.stride])


def test_keyed_fill_of_a_row_that_moved_down_rewrites_it():
    """Its old row was already overwritten by this fill: its table comes from the key's own copy."""
    layout = StaticDecodeLayout(4, 16, 4, PortableAttention(), 8, 4, 8, torch.device("cpu"), num_sms=4)
    a, b, c = (1, 2, 3), (7, 8), (9, 9, 9, 9)
    layout.fill([SeqSpan(a, 10, 1), SeqSpan(b, 6, 1)], [1, 1], ["a", "b"])
    layout.fill([SeqSpan(c, 14, 1), SeqSpan(a + (5,), 12, 1)], [1, 1], ["c", "a"])
    assert layout.tables[0, :4].tolist() == list(c) and layout.tables[1, :4].tolist() == [1, 2, 3, 5]


@pytest.mark.gpu
def test_attention_kernels_compile_once_over_many_batch_shapes():
    """Mixed batches of varying shapes (odd and even counts, decode-only, prefill-only, several
    split counts) through the Triton backend: after a first pass over every path, no compilation."""
    from benchmarks.compiles import CompileCounter
    from megatron_rollout.kernels.layout import KernelPagedBatch
    from megatron_rollout.kernels.triton_attention import TritonAttention
    from megatron_rollout.kv.paged import PagedKVCache
    from megatron_rollout.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=50, hidden_size=32, num_layers=1, num_attention_heads=32, num_query_groups=4,
                      kv_channels=128, ffn_hidden_size=48, max_position_embeddings=8192, dtype="bfloat16")
    dev = torch.device("cuda")
    blocks = 16384
    cache = PagedKVCache(cfg, blocks, 16, 4, device=dev)
    kernels = TritonAttention()
    rng = np.random.default_rng(0)

    def run(spec):
        spans, at = [], 0
        for past, new in spec:
            k = -(-(past + new) // 16)
            spans.append(SeqSpan(tuple(range(at, at + k)), past, new))
            at += k
        assert at <= blocks, at
        layout = build_layout(spans, [[0] * s.new for s in spans], [True] * len(spans), 16, kernels, 32, 4, 128, dev)
        n = int(layout.tokens.numel())
        q, k, v = (torch.randn(n, h, 128, device=dev, dtype=torch.bfloat16) for h in (32, 4, 4))
        KernelPagedBatch(cache, layout, kernels).attend(0, q, k, v)

    def shapes():
        for rows in (1, 2, 3, 7, 16, 33):
            for ctx in (5, 300, 2000, 7000):
                yield [(ctx, 1)] * rows
                yield [(ctx, 1)] * rows + [(int(rng.integers(0, 500)), int(rng.integers(2, 300)))]
        for count in (1, 2, 5):
            yield [(int(rng.integers(0, 900)), int(rng.integers(2, 700))) for _ in range(count)]

    for spec in shapes():  # first pass: whatever compiles, compiles here
        run(spec)
    torch.cuda.synchronize()
    with CompileCounter() as counter:
        for spec in shapes():
            run(spec)
        torch.cuda.synchronize()
    assert counter.counts.triton == 0, counter.counts


@pytest.mark.parametrize("heavy_first", [True, False])
def test_prefill_tiles_cover_every_query_once_in_the_chosen_order(heavy_first):
    """Heavy first: tiles in decreasing causal work (past + first token), each query token in
    exactly one tile either way; off: span by span, ascending (the order before)."""
    spans = [SeqSpan(tuple(range(0, 4)), 10, 40), SeqSpan(tuple(range(4, 6)), 3, 1),
             SeqSpan(tuple(range(6, 14)), 60, 65), SeqSpan(tuple(range(14, 15)), 0, 9)]
    kernels = PortableAttention()
    kernels.prefill_heavy_first = heavy_first
    layout = build_layout(spans, [[1] * s.new for s in spans], [True] * 4, 16, kernels, 8, 4, 8, torch.device("cpu"))
    meta = layout.prefill
    seq, start = meta.tile_seq.tolist(), meta.tile_start.tolist()
    tok = meta.tile_tokens
    covered = sorted((s, t) for s, t0 in zip(seq, start) for t in range(t0, min(t0 + tok, spans[s].new)))
    assert covered == [(s, t) for s in (0, 2, 3) for t in range(spans[s].new)]
    work = [spans[s].past + t0 for s, t0 in zip(seq, start)]
    if heavy_first:
        assert work == sorted(work, reverse=True)
    else:
        assert list(zip(seq, start)) == sorted(zip(seq, start))


def test_decode_runs_mark_each_rows_positions_cut_at_max_run():
    """A verify forward's rows of 5, 1 and 3 new positions, flattened to one-query rows: each row's
    positions are one run, cut every `max_run` rows."""
    assert decode_runs([5, 1, 3], 8).tolist() == [5, 0, 0, 0, 0, 1, 3, 0, 0]
    assert decode_runs([5, 1, 3], 2).tolist() == [2, 0, 2, 0, 1, 1, 2, 0, 1]
    assert decode_runs([5, 1, 3], 1).tolist() == [1] * 9
    assert decode_runs([], 8).tolist() == []


class ReadsRuns(PortableAttention):
    """A backend that computes a run's rows from one read of their history (as the Triton GQA one)."""

    decode_reads_runs = True
    verify_programs_per_sm = 2


def test_static_layout_marks_runs_only_where_asked():
    a = (3, 1, 4)
    spans = [SeqSpan(a, 40 + j, 1) for j in range(3)]
    plain = StaticDecodeLayout(8, 16, 16, ReadsRuns(), 8, 4, 8, torch.device("cpu"), num_sms=4)
    plain.fill(spans, [7] * 3, runs=[3])
    assert plain.decode.runs is None and plain.runs.tolist() == [1] * 8
    alone = StaticDecodeLayout(8, 16, 16, PortableAttention(), 8, 4, 8, torch.device("cpu"), num_sms=4, max_run=4)
    alone.fill(spans, [7] * 3, runs=[3])  # a backend that computes every row alone: nothing to mark
    assert alone.max_run == 1 and alone.decode.runs is None and alone.runs.tolist() == [1] * 8
    runs = StaticDecodeLayout(8, 16, 16, ReadsRuns(), 8, 4, 8, torch.device("cpu"), num_sms=4, max_run=4)
    runs.fill(spans, [7] * 3)
    assert runs.runs.tolist() == [1] * 8  # no runs named: every row alone
    runs.fill(spans, [7] * 3, runs=[3])
    assert runs.decode.runs is not None and runs.decode.max_run == 4
    assert runs.runs.tolist() == [3, 0, 0, 1, 1, 1, 1, 1]  # padding rows stand alone (length 0)
    assert runs.lens.tolist()[:3] == [41, 42, 43]
    runs.fill_padding()
    assert runs.runs.tolist() == [1] * 8
    with pytest.raises(ValueError, match="max_run"):
        StaticDecodeLayout(8, 16, 16, PortableAttention(), 8, 4, 8, torch.device("cpu"), num_sms=4, max_run=0)


def test_kv_splits_count_runs_only_for_a_backend_that_reads_them():
    """A backend that computes every row alone (portable, MLA) keeps the splits of plain rows under
    `max_run`; one that reads a run's history once gets the splits of the runs' heads, at its own
    programs per SM."""

    def splits(kernels, max_run):
        return StaticDecodeLayout(40, 16, 16, kernels, 8, 2, 8, torch.device("cpu"), num_sms=132,
                                  max_run=max_run).decode.splits

    alone = splits(PortableAttention(), 1)
    assert splits(PortableAttention(), 8) == alone == 16  # 8 programs a SM over 40 rows x 2 kv heads
    assert splits(ReadsRuns(), 1) == alone
    assert splits(ReadsRuns(), 8) == 32  # 2 programs a SM over 5 runs x 2 kv heads: 27, rounded up to 32


def counted_tuple() -> type:
    """A tuple type that counts the entries read from its instances (`reads`): a block table whose
    conversion from Python ints is counted."""

    class Counted(tuple):
        reads = 0

        def __getitem__(self, item):
            got = super().__getitem__(item)
            Counted.reads += len(got) if isinstance(item, slice) else 1
            return got

    return Counted


def test_a_key_converts_only_its_new_entries_wherever_its_rows_land():
    """A verify forward's rows: a row with more drafts moves the next one down. Every entry is
    converted from Python ints once, at the step it first appears (a table that counts its reads)."""

    Counted = counted_tuple()
    layout = StaticDecodeLayout(8, 16, 4, PortableAttention(), 8, 4, 8, torch.device("cpu"), num_sms=4, max_run=4)
    a, b = Counted(range(10)), Counted(range(20, 26))
    layout.fill([SeqSpan(a, 39, 1), SeqSpan(b, 23, 1)], [1, 1], ["a", "b"], [1, 1])
    assert Counted.reads == 16
    b2 = Counted((*b, 99))
    layout.fill([SeqSpan(a, 39, 1)] * 3 + [SeqSpan(b2, 24, 1)] * 2, [1] * 5, ["a"] * 3 + ["b"] * 2, [3, 2])
    assert Counted.reads == 16 + 1  # b's one new entry; a's three rows and b's moved ones copy
    assert layout.tables[:5, :10].tolist()[:3] == [list(range(10))] * 3
    assert layout.tables[3:5, :7].tolist() == [[20, 21, 22, 23, 24, 25, 99]] * 2


@pytest.mark.parametrize("seed", range(3))
def test_a_table_cache_gives_the_layouts_of_full_conversions(seed):
    """Eager forwards over many steps (a `chunked` run's mixed steps): keyed rows grow, finish, are
    preempted (a new key), sit forwards out and come back; a request's prefill rows and decode rows
    share its key. Every layout equals the one built without the cache."""
    rng = np.random.default_rng(seed)
    cache, live, next_rid = TableCache(), {}, 0
    for _step in range(50):
        for key in list(live):
            roll = rng.random()
            if roll < 0.1:
                del live[key]
            elif roll < 0.15:
                del live[key]
                live[(key[0], key[1] + 1)] = [int(b) for b in rng.integers(0, 1000, int(rng.integers(1, 5)))]
            else:
                live[key] += [int(b) for b in rng.integers(0, 1000, int(rng.integers(0, 3)))]
        while len(live) < 6 and rng.random() < 0.5:
            live[(next_rid, 0)] = [int(b) for b in rng.integers(0, 1000, int(rng.integers(1, 20)))]
            next_rid += 1
        keys = [k for k in sorted(live) if rng.random() < 0.8]  # some sit a forward out
        keys += keys[:1]  # a prompt-logprobs row beside its chunk: the same key twice
        if not keys:
            continue
        spans = [SeqSpan(tuple(live[k]), 16 * len(live[k]) - 1, 1) for k in keys]
        args = (spans, [[1]] * len(spans), [True] * len(spans), 16, PortableAttention(), 8, 4, 8, torch.device("cpu"))
        cached, full = build_layout(*args, keys=keys, cache=cache), build_layout(*args)
        assert torch.equal(cached.decode.tables, full.decode.tables) and torch.equal(cached.slots, full.slots)


def test_a_table_cache_converts_each_entry_once_and_forgets_the_least_recently_used():
    Counted = counted_tuple()
    cache = TableCache(budget=250)
    assert cache.entries("a", Counted(range(100))).tolist() == list(range(100)) and Counted.reads == 100
    assert cache.entries("a", Counted(range(103))).tolist() == list(range(103)) and Counted.reads == 103
    cache.entries("b", Counted(range(40)))  # a's 200 entries of room (grown by doubling) and b's 40: 240
    assert Counted.reads == 143
    cache.entries("a", Counted(range(103)))  # a used again: b is now the oldest
    cache.entries("c", Counted(range(20)))  # 260 > 250: b goes
    assert Counted.reads == 163
    cache.entries("a", Counted(range(104)))
    cache.entries("b", Counted(range(40)))
    assert Counted.reads == 163 + 1 + 40  # a kept (one new entry), b converted again
    assert cache.entries("a", Counted(range(5))).tolist() == list(range(5))  # shorter: not its table, again
