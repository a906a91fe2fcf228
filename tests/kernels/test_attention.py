"""Paged attention kernels against the portable path (`kv.paged.PagedBatch`) on random inputs.

Every check draws fresh random caches, block tables (shuffled, so blocks are never contiguous),
cached lengths and new lengths, mixes decode rows (one new token) with prefill spans (cached
prefix + several new tokens: causal with an offset), and compares both the attention output and
the KV cache after the store. The CUDA cases are marked `gpu`; the same cases run on CPU through
Triton's interpreter when `TRITON_INTERPRET=1` and Triton is installed. The registry and the
portable backend are tested on CPU unconditionally.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_rollout.kernels.layout import KernelPagedBatch, StaticDecodeLayout, build_layout, choose_splits
from megatron_rollout.kernels.registry import PortableAttention, available_backends, resolve_attention
from megatron_rollout.kv.paged import PagedBatch, PagedKVCache
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.types import SeqSpan

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None

DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    pytest.param("cpu", marks=pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1 and triton"),
                 id="interpret"),
]


def _cfg(hq: int, hkv: int, d: int, dtype: str) -> ModelConfig:
    return ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_attention_heads=hq, num_query_groups=hkv,
                       kv_channels=d, ffn_hidden_size=48, max_position_embeddings=4096, dtype=dtype)


def _spans(spec: list[tuple[int, int]], block_size: int, num_blocks: int, gen: torch.Generator) -> list[SeqSpan]:
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spans, at = [], 0
    for past, new in spec:
        k = -(-(past + new) // block_size)
        spans.append(SeqSpan(tuple(perm[at:at + k]), past, new))
        at += k
    assert at <= num_blocks
    return spans


def _caches(cfg: ModelConfig, blocks: int, bs: int, device: str, gen: torch.Generator
            ) -> tuple[PagedKVCache, PagedKVCache]:
    """A reference cache of random K/V and a copy of it for the kernels."""
    ref = PagedKVCache(cfg, blocks, bs, cfg.num_query_groups, device=device)
    ref.k.copy_(torch.randn(ref.k.shape, generator=gen).to(cfg.torch_dtype))
    ref.v.copy_(torch.randn(ref.v.shape, generator=gen).to(cfg.torch_dtype))
    cache = PagedKVCache(cfg, blocks, bs, cfg.num_query_groups, device=device)
    cache.k.copy_(ref.k)
    cache.v.copy_(ref.v)
    return ref, cache


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _case(device: str, spec: list[tuple[int, int]], hq: int, hkv: int, d: int, bs: int, seed: int,
          backend: str = "triton", static: bool = False, kernels=None):
    gen = torch.Generator().manual_seed(seed)
    dtype = "bfloat16" if device == "cuda" else "float32"
    cfg = _cfg(hq, hkv, d, dtype)
    dt = cfg.torch_dtype
    total_blocks = sum(-(-(p + n) // bs) for p, n in spec) + 7
    spans = _spans(spec, bs, total_blocks, gen)
    ref_cache, cache = _caches(cfg, total_blocks, bs, device, gen)
    n = sum(new for _, new in spec)
    q = torch.randn(n, hq, d, generator=gen).to(device, dt)
    k = torch.randn(n, hkv, d, generator=gen).to(device, dt)
    v = torch.randn(n, hkv, d, generator=gen).to(device, dt)
    layer = 1
    ref = PagedBatch(ref_cache, spans).attend(layer, q, k, v)
    kernels = kernels or resolve_attention(backend, device)
    dev = torch.device(device)
    if static:
        rows = 8
        layout = StaticDecodeLayout(rows, 64, bs, kernels, hq, hkv, d, dev, num_sms=132)
        layout.fill(spans, [0] * len(spans))
        pad = rows - n  # a graph's batch is always `rows` long: padded rows ride along
        qp, kp, vp = (torch.cat([t, torch.randn(pad, *t.shape[1:], generator=gen).to(device, dt)]) for t in (q, k, v))
        out = KernelPagedBatch(cache, layout.layout, kernels).attend(layer, qp, kp, vp)
        assert torch.equal(out[n:], torch.zeros_like(out[n:]))  # length-0 rows give zeros
        out = out[:n]
    else:
        layout = build_layout(spans, [[0] * s.new for s in spans], [True] * len(spans), bs, kernels, hq, hkv, d,
                              dev, num_sms=132)
        out = KernelPagedBatch(cache, layout, kernels).attend(layer, q, k, v)
    return out, ref, cache, ref_cache


def _tol(device: str) -> float:
    return 2e-2 if device == "cuda" else 1e-5


MIXED = [(5, 1), (0, 7), (9, 13), (30, 1), (3, 2), (0, 1), (17, 40)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_matches_portable(device, seed):
    out, ref, cache, ref_cache = _case(device, MIXED, hq=8, hkv=2, d=32, bs=4, seed=seed)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < _tol(device)
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs", [64, 128])
def test_pages_larger_than_a_key_block_match_portable(device, bs):
    """KV blocks of 64 and 128 tokens (a page as wide as the kernels' key blocks, and wider): decode rows
    and prefill spans that start, end and cross inside a page, against the portable path."""
    spec = [(bs - 1, 1), (0, bs + 3), (bs + 5, 2 * bs - 7), (3 * bs, 1), (7, 5)]
    out, ref, cache, ref_cache = _case(device, spec, hq=8, hkv=2, d=32, bs=bs, seed=5)
    assert _rel(out, ref) < _tol(device)
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_long_causal_offset(device):
    # tiles that straddle blocks, a span longer than one tile, and GQA group 4
    spec = [(100, 37), (0, 64), (63, 65)]
    out, ref, _, _ = _case(device, spec, hq=8, hkv=2, d=32, bs=16, seed=3)
    assert _rel(out, ref) < _tol(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [48, 128])
def test_prefill_unmasked_blocks_and_head_dims(device, d):
    # spans long enough that most key blocks lie below each tile's first query (the kernel's
    # unmasked loop) plus the diagonal blocks (its masked loop); 48 is not a power of two (masked d)
    spec = [(130, 70), (0, 150), (64, 1)]
    out, ref, _, _ = _case(device, spec, hq=4, hkv=2, d=d, bs=16, seed=8)
    assert _rel(out, ref) < _tol(device)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_tile_order_changes_no_value(device):
    """Heavy-first tiles (the default) and span-order tiles give the same bits: each tile writes
    its own rows, whatever order the programs run in."""
    from megatron_rollout.kernels.triton_attention import TritonAttention

    spec = [(130, 70), (0, 150), (64, 1), (7, 33)]
    outs = []
    for heavy in (True, False):
        kernels = TritonAttention()
        kernels.prefill_heavy_first = heavy
        out, ref, _, _ = _case(device, spec, hq=8, hkv=2, d=32, bs=16, seed=5, kernels=kernels)
        assert _rel(out, ref) < _tol(device)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("device", DEVICES)
def test_decode_long_contexts_split_k(device):
    spec = [(700, 1), (1, 1), (333, 1), (1500, 1)]
    out, ref, _, _ = _case(device, spec, hq=4, hkv=4, d=64, bs=16, seed=4)
    assert _rel(out, ref) < _tol(device)


@pytest.mark.parametrize("device", DEVICES)
def test_static_decode_layout_with_padding(device):
    spec = [(12, 1), (40, 1), (3, 1)]  # 3 live rows in a layout of 8: 5 padded rows store nothing
    out, ref, cache, ref_cache = _case(device, spec, hq=8, hkv=2, d=32, bs=4, seed=5, static=True)
    assert _rel(out, ref) < _tol(device)
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_qwen3_shapes_bf16(seed):
    """Qwen3-30B-A3B attention shapes: 32 query heads, 4 kv heads, head_dim 128, blocks of 16."""
    spec = [(2000, 1)] * 5 + [(0, 300), (1200, 257), (4000, 1)]
    out, ref, _, _ = _case("cuda", spec, hq=32, hkv=4, d=128, bs=16, seed=seed)
    assert _rel(out, ref) < 2e-2


@pytest.mark.gpu
def test_varlen_backend_matches_portable():
    if "varlen" not in available_backends():
        pytest.skip("no varlen backend")
    try:
        resolve_attention("varlen", "cuda")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    out, ref, _, _ = _case("cuda", [(0, 64), (100, 37), (5, 1), (63, 65)], hq=8, hkv=2, d=64, bs=16, seed=6,
                           backend="varlen")
    assert _rel(out, ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [[(0, 64), (100, 37), (5, 1), (63, 65)], [(0, 300), (1200, 257)], [(40, 1), (7, 1)]],
                         ids=["mixed", "prefill", "decode"])
def test_flash_backend_matches_portable(spec):
    """FA3 (vLLM's build) over every span of a forward with prefill spans; decode-only forwards
    keep the Triton kernel. Skipped where vLLM's FA3 is not installed."""
    try:
        resolve_attention("flash", "cuda")
    except RuntimeError as exc:
        pytest.skip(str(exc))
    out, ref, cache, ref_cache = _case("cuda", spec, hq=32, hkv=4, d=128, bs=16, seed=9, backend="flash")
    assert _rel(out, ref) < 2e-2
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)


def _varlen_reference(q, k_pages, v_pages, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, softmax_scale,
                      causal, block_table, out, fa_version):
    """FA3's documented semantics in torch: span i owns q rows cu_seqlens_q[i]..[i+1], attends the
    first seqused_k[i] keys of its pages, causal aligned to the end of its keys; writes `out`."""
    from megatron_rollout.model.attention import causal_attention

    assert causal and fa_version == 3 and block_table.dtype == torch.int32 and cu_seqlens_q.dtype == torch.int32
    bs = k_pages.shape[1]
    cu, lens = cu_seqlens_q.tolist(), seqused_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in zip(cu, cu[1:])) and max_seqlen_k == max(lens)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        pos = torch.arange(lens[i], device=q.device)
        blocks = block_table[i].long()[pos // bs]
        keys, vals = k_pages[blocks, pos % bs], v_pages[blocks, pos % bs]
        got = causal_attention(q[a:b], keys, vals, lens[i] - (b - a))
        assert abs(softmax_scale - q.shape[-1] ** -0.5) < 1e-9
        out[a:b] = got


def _fake_fa3(monkeypatch) -> list[int]:
    """Stand `_varlen_reference` in for FA3 in the flash backend; returns the list that records each
    library call's span count."""
    from megatron_rollout.kernels import flash

    calls: list[int] = []

    def fake():
        def run(*args, **kw):
            calls.append(kw["cu_seqlens_q"].numel() - 1)
            return _varlen_reference(*args, **kw)
        return run

    monkeypatch.setattr(flash, "_fa3", fake)
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_flash_backend_hands_the_library_every_span(device, monkeypatch):
    """The flash backend's arguments, checked on any device against FA3's documented semantics
    (a torch stand-in for the library): every span in one call, decode rows included, through the
    block tables; a decode-only forward stays on Triton's kernel."""
    from megatron_rollout.kernels import flash

    calls = _fake_fa3(monkeypatch)
    kernels = flash.FlashAttention()
    spec = [(5, 1), (0, 7), (9, 13), (30, 1), (17, 40)]
    out, ref, cache, ref_cache = _case(device, spec, hq=8, hkv=2, d=32, bs=4, seed=11, kernels=kernels)
    assert calls == [len(spec)] and _rel(out, ref) < _tol(device)
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)
    out, ref, _, _ = _case(device, [(12, 1), (40, 1)], hq=8, hkv=2, d=32, bs=4, seed=12, kernels=kernels)
    assert calls == [len(spec)] and _rel(out, ref) < _tol(device)  # decode only: no library call


@pytest.mark.parametrize("device", DEVICES)
def test_flash_backend_leaves_small_prefills_to_triton(device, monkeypatch):
    """Below `min_prefill_tokens` (auto's threshold) a forward runs Triton's kernels, not the library."""
    from megatron_rollout.kernels import flash

    calls = _fake_fa3(monkeypatch)
    spec = [(5, 1), (0, 7), (9, 13)]  # 20 prefill tokens
    for threshold, library_calls in ((21, []), (20, [len(spec)])):
        calls.clear()
        kernels = flash.FlashAttention(min_prefill_tokens=threshold)
        out, ref, cache, ref_cache = _case(device, spec, hq=8, hkv=2, d=32, bs=4, seed=13, kernels=kernels)
        assert calls == library_calls and _rel(out, ref) < _tol(device)
        assert torch.equal(cache.k, ref_cache.k)


def test_auto_takes_flash_first_as_its_auto_instance(monkeypatch):
    from megatron_rollout.kernels import registry

    class FakeFlash(PortableAttention):
        name = "flash"
        made: list[str] = []

        @classmethod
        def missing(cls, device):
            return None

        @classmethod
        def for_auto(cls):
            cls.made.append("auto")
            return cls()

    monkeypatch.setitem(registry._BACKENDS, "flash", FakeFlash)
    assert isinstance(resolve_attention("auto", "cpu"), FakeFlash) and FakeFlash.made == ["auto"]
    assert isinstance(resolve_attention("flash", "cpu"), FakeFlash) and FakeFlash.made == ["auto"]


def test_flash_for_auto_holds_small_prefills_back(monkeypatch):
    pytest.importorskip("triton")
    import sys

    from megatron_rollout.kernels import flash

    monkeypatch.setattr(flash.FlashAttention, "missing", classmethod(lambda cls, device: None))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    why = flash.FlashAttention.auto_missing(torch.device("cuda"))
    assert why and "auto does not import it" in why  # vLLM's import would reset NCCL settings unasked
    monkeypatch.setitem(sys.modules, "vllm", object())
    assert flash.FlashAttention.auto_missing(torch.device("cuda")) is None
    assert flash.FlashAttention.for_auto().min_prefill_tokens == flash.AUTO_MIN_PREFILL_TOKENS
    assert flash.FlashAttention().min_prefill_tokens == 0  # asked for by name: every prefill
    with pytest.raises(ValueError, match="min_prefill_tokens must be >= 0"):
        flash.FlashAttention(-1)


def test_flash_backend_says_why_it_cannot_run_here():
    from megatron_rollout.kernels.registry import _load

    cls = _load("flash")
    why = cls if isinstance(cls, str) else cls.missing(torch.device("cpu"))
    assert why and ("CUDA" in why or "triton" in why)
    with pytest.raises(RuntimeError, match="'flash' was asked for but cannot run"):
        resolve_attention("flash", "cpu")


# -- CPU, unconditional --------------------------------------------------------------------

def test_portable_backend_matches_paged_batch_on_cpu():
    out, ref, cache, ref_cache = _case("cpu", MIXED, hq=8, hkv=2, d=16, bs=4, seed=7, backend="portable")
    assert _rel(out, ref) < 1e-6
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)


def test_registry_auto_falls_back_to_portable_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert isinstance(resolve_attention("auto", "cpu"), PortableAttention)


def test_registry_explicit_backend_that_cannot_run_names_the_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="'triton' was asked for but cannot run on cpu"):
        resolve_attention("triton", "cpu")


def test_registry_unknown_backend():
    with pytest.raises(ValueError, match="unknown attention backend 'flash9'"):
        resolve_attention("flash9", "cpu")


def test_choose_splits_covers_sms_and_respects_length():
    assert choose_splits(rows=1, kv_heads=4, num_sms=132) == 32  # capped
    assert choose_splits(rows=64, kv_heads=4, num_sms=132) == 8
    assert choose_splits(rows=1, kv_heads=4, num_sms=132, max_len=300) == 2  # >= 256 positions a split
    assert choose_splits(rows=512, kv_heads=8, num_sms=132) == 1


def test_attend_into_a_given_output_writes_every_row_and_checks_it():
    """`KernelPagedBatch.attend(..., out=)` (a piecewise graph's static buffer): the same values as
    a fresh output, every row written (the buffer starts as NaN), and a wrong buffer named."""
    gen = torch.Generator().manual_seed(5)
    cfg = _cfg(8, 2, 16, "float32")
    spans = _spans(MIXED, 4, 64, gen)
    n = sum(new for _, new in MIXED)
    q = torch.randn(n, 8, 16, generator=gen)
    k, v = torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)
    kernels = PortableAttention()
    results = []
    for out in (None, torch.full((n, 8, 16), float("nan"))):
        cache = PagedKVCache(cfg, 64, 4, 2, device="cpu")
        cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(6)))
        cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(7)))
        layout = build_layout(spans, [[0] * s.new for s in spans], [True] * len(spans), 4, kernels, 8, 2, 16,
                              torch.device("cpu"), num_sms=132)
        batch = KernelPagedBatch(cache, layout, kernels)
        got = batch.attend(1, q, k, v, out=out)
        assert out is None or got is out
        results.append(got)
    assert torch.equal(results[0], results[1])
    with pytest.raises(ValueError, match="attention out must be"):
        batch.attend(1, q, k, v, out=torch.empty(n, 8, 8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_run, verify", [(4, {}), (8, {}),
                                             (8, {"verify_block_n": 64, "verify_programs_per_sm": 8})])
def test_verify_runs_read_once_and_match_portable(device, max_run, verify):
    """Speculative decoding's verify rows in a decode graph's layout: each row's pending token and
    drafts are one-query rows over one table (`runner.speculative.flatten`), marked as runs. The
    head of a run computes all of them, each at its own length: a split that holds positions of the
    run's later rows only (125 + 1..5 crosses the 128 boundary of the 64-position splits) leaves
    the earlier rows nothing there; a row of 6 positions is cut into two runs at `max_run` 4.
    `verify`: the runs' own launch settings (`TritonAttention.verify_*`), plain decode's otherwise."""
    from megatron_rollout.kernels.layout import decode_runs
    from megatron_rollout.kernels.triton_attention import TritonAttention

    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, bs = 8, 2, 32, 4
    dtype = "bfloat16" if device == "cuda" else "float32"
    cfg = _cfg(hq, hkv, d, dtype)
    dt = cfg.torch_dtype
    rows = [(125, 5), (300, 1), (17, 6), (64, 3)]  # (cached positions, one-query rows)
    total_blocks = sum(-(-(p + n) // bs) for p, n in rows) + 3
    spans = [SeqSpan(s.table, s.past + j, 1) for s in _spans(rows, bs, total_blocks, gen) for j in range(s.new)]
    counts = [n for _, n in rows]
    assert decode_runs(counts, max_run).tolist()[:5] == ([4, 0, 0, 0, 1] if max_run == 4 else [5, 0, 0, 0, 0])
    ref_cache, cache = _caches(cfg, total_blocks, bs, device, gen)
    n, graph_rows = len(spans), 20
    q, k, v = (torch.randn(graph_rows, h, d, generator=gen).to(device, dt) for h in (hq, hkv, hkv))
    ref = PagedBatch(ref_cache, spans).attend(1, q[:n], k[:n], v[:n])
    kernels = TritonAttention()
    for name, value in verify.items():
        setattr(kernels, name, value)
    layout = StaticDecodeLayout(graph_rows, 80, bs, kernels, hq, hkv, d, torch.device(device), num_sms=132,
                                max_run=max_run)
    assert layout.decode.splits > 1
    layout.fill(spans, [0] * n, runs=counts)
    out = KernelPagedBatch(cache, layout.layout, kernels).attend(1, q, k, v)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))  # padding rows
    assert _rel(out[:n], ref) < _tol(device)
    for i in range(n):  # every row, not only on the whole
        assert _rel(out[i], ref[i]) < 2 * _tol(device), i
    assert torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)
