"""MLA kernels (`kernels.mla_attention`) against the portable path over the same paged latent cache.

The reference is `kv.paged.PagedBatch` on an MLA cache: one row `[latent ; rope key]` per token,
read as key and value, the output's latent columns being what the model keeps (`model.mla`). Each
case draws random caches, shuffled block tables, cached and new lengths, and mixes decode rows
with prefill spans. The CUDA cases are marked `gpu`; the same cases run on CPU through Triton's
interpreter when `TRITON_INTERPRET=1` and Triton is installed. The resolver runs on CPU always.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_rollout.kernels.layout import KernelPagedBatch, StaticDecodeLayout, build_layout
from megatron_rollout.kernels.registry import PortableAttention, resolve_mla_attention
from megatron_rollout.kv.paged import PagedBatch, PagedKVCache
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.types import SeqSpan

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None

DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda"),
    pytest.param("cpu", marks=[pytest.mark.interpret,
                               pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")],
                 id="interpret"),
]


def _cfg(heads: int, latent: int, rope: int, dtype: str) -> ModelConfig:
    return ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_attention_heads=heads,
                       num_query_groups=heads, kv_channels=16 + rope, ffn_hidden_size=48, dtype=dtype,
                       multi_latent_attention=True, kv_lora_rank=latent, qk_head_dim=16, qk_pos_emb_head_dim=rope,
                       v_head_dim=16, max_position_embeddings=4096)


def _case(device: str, spec: list[tuple[int, int]], heads: int, latent: int, rope: int, bs: int, seed: int,
          static_rows: int = 0):
    """(kernel output, reference output) over the latent columns, and both caches after the store."""
    gen = torch.Generator().manual_seed(seed)
    cfg = _cfg(heads, latent, rope, "bfloat16" if device == "cuda" else "float32")
    dt, width = cfg.torch_dtype, latent + rope
    blocks = sum(-(-(p + n) // bs) for p, n in spec) + 5
    perm = torch.randperm(blocks, generator=gen).tolist()
    spans, at = [], 0
    for past, new in spec:
        k = -(-(past + new) // bs)
        spans.append(SeqSpan(tuple(perm[at:at + k]), past, new))
        at += k
    ref_cache = PagedKVCache(cfg, blocks, bs, heads, device=device)
    ref_cache.k.copy_(torch.randn(ref_cache.k.shape, generator=gen).to(dt))
    cache = PagedKVCache(cfg, blocks, bs, heads, device=device)
    cache.k.copy_(ref_cache.k)
    n = sum(new for _, new in spec)
    q = torch.randn(n, heads, width, generator=gen).to(device, dt)
    row = torch.randn(n, 1, width, generator=gen).to(device, dt)
    ref = PagedBatch(ref_cache, spans).attend(1, q, row, row)[..., :latent]
    kernels = resolve_mla_attention("triton", latent, device)
    dev = torch.device(device)
    if static_rows:
        layout = StaticDecodeLayout(static_rows, 64, bs, kernels, heads, 1, latent, dev, num_sms=16)  # 2 splits
        layout.fill(spans, [0] * n)
        pad = static_rows - n  # padded rows: slot -1, length 0
        q = torch.cat([q, torch.randn(pad, heads, width, generator=gen).to(device, dt)])
        row = torch.cat([row, torch.randn(pad, 1, width, generator=gen).to(device, dt)])
        out = KernelPagedBatch(cache, layout.layout, kernels).attend(1, q, row, row)
        assert torch.equal(out[n:, :, :latent], torch.zeros_like(out[n:, :, :latent]))  # length 0: zeros
        out = out[:n]
    else:
        layout = build_layout(spans, [[0] * s.new for s in spans], [True] * len(spans), bs, kernels, heads, 1,
                              latent, dev, num_sms=132)
        out = KernelPagedBatch(cache, layout, kernels).attend(1, q, row, row)
    return out[..., :latent], ref, cache, ref_cache


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _tol(device: str) -> float:
    return 2e-2 if device == "cuda" else 1e-5


MIXED = [(5, 1), (0, 7), (9, 13), (30, 1), (3, 2), (0, 1), (17, 21)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,latent,rope", [(4, 32, 16), (20, 48, 8)])
def test_mixed_batch_matches_portable(device, heads, latent, rope):
    """Decode rows and prefill spans (causal with an offset); 20 heads span two head blocks, the
    second partly masked; 48 and 8 are no powers of two (masked columns)."""
    out, ref, cache, ref_cache = _case(device, MIXED, heads, latent, rope, bs=4, seed=heads)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < _tol(device)
    assert torch.equal(cache.k, ref_cache.k)  # the one stored row per token, at its slot


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
def test_decode_long_contexts_split_k(device):
    spec = [(300, 1), (1, 1), (97, 1), (520, 1)]
    out, ref, _, _ = _case(device, spec, heads=4, latent=32, rope=16, bs=16, seed=4)
    assert _rel(out, ref) < _tol(device)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
def test_static_decode_layout_with_padding(device):
    """A decode graph's layout: 3 live rows of 8, the padded ones store nothing and give zeros."""
    out, ref, cache, ref_cache = _case(device, [(12, 1), (40, 1), (3, 1)], heads=4, latent=32, rope=16, bs=4,
                                       seed=5, static_rows=8)
    assert _rel(out, ref) < _tol(device)
    assert torch.equal(cache.k, ref_cache.k)


@pytest.mark.gpu
def test_deepseek_v3_widths_bf16():
    """DeepSeek-V3's widths: 128 heads (ATP1), latent 512, RoPE key 64, blocks of 16."""
    spec = [(1000, 1), (37, 1), (0, 300), (250, 90), (4000, 1)]
    out, ref, _, _ = _case("cuda", spec, heads=128, latent=512, rope=64, bs=16, seed=9)
    assert _rel(out, ref) < 2e-2


def test_resolver_falls_back_to_portable_and_refuses_per_group_backends(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert isinstance(resolve_mla_attention("auto", 512, "cpu"), PortableAttention)
    assert isinstance(resolve_mla_attention("portable", 512, "cpu"), PortableAttention)
    with pytest.raises(RuntimeError, match="'triton' was asked for but cannot run on cpu"):
        resolve_mla_attention("triton", 512, "cpu")
    with pytest.raises(ValueError, match="'flash' has no multi-latent attention kernels"):
        resolve_mla_attention("flash", 512, "cpu")


@pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
def test_kernels_refuse_a_cache_that_is_not_one_latent_row():
    kernels = resolve_mla_attention("triton", 32, "cpu")
    q = torch.zeros(1, 4, 48)
    with pytest.raises(ValueError, match="one cached row per token as wide as the query"):
        kernels._widths(q, torch.zeros(8, 2, 48))
    with pytest.raises(ValueError, match="positive"):
        type(kernels)(0)
    kernels.prefill_block_m = 24  # not a power-of-two multiple of prefill_block_h
    with pytest.raises(ValueError, match="MLA tiles"):
        kernels.tile_tokens(4)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not _INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
def test_tiny_deepseek_decodes_through_a_static_layout_like_the_portable_runner():
    """What the CUDA runner does for an MLA model, on CPU: prefill through `build_layout`, then
    greedy decode steps through a decode graph's padded static layout, both with the Triton MLA
    kernels; the portable runner on its own copy of the model and cache is the reference."""
    from megatron_rollout.model.config import preset
    from megatron_rollout.model.layers import run_to_end
    from megatron_rollout.model.transformer import MoETransformer
    from megatron_rollout.runner.base import ModelRunner
    from megatron_rollout.types import Phase, SpanInput

    cfg = preset("tiny-deepseek")
    model = MoETransformer(cfg).init_weights(3)
    bs, blocks = 4, 32
    ref = ModelRunner(model, PagedKVCache(cfg, blocks, bs, 1))
    cache = PagedKVCache(cfg, blocks, bs, 1)
    kernels = resolve_mla_attention("auto", cfg.kv_lora_rank, "cpu")
    assert type(kernels).__name__ == "TritonMLA"
    heads, dev = cfg.num_attention_heads, torch.device("cpu")
    tables = [tuple(range(0, 12)), tuple(range(12, 24))]
    prompts = [[5, 70, 101, 33, 9, 250, 17], [44, 2, 199]]
    with torch.no_grad():
        inputs = [SpanInput(SeqSpan(t, 0, len(p)), p, True) for t, p in zip(tables, prompts)]
        want = run_to_end(ref.forward(inputs, Phase.P))
        layout = build_layout([i.span for i in inputs], prompts, [True, True], bs, kernels, heads, 1,
                              cfg.kv_lora_rank, dev, num_sms=132)
        got = run_to_end(model.step(layout.tokens, layout.positions, KernelPagedBatch(cache, layout, kernels),
                                    Phase.P, logits_index=layout.logits_rows))
        assert _rel(got, want) < 1e-4
        static = StaticDecodeLayout(4, 12, bs, kernels, heads, 1, cfg.kv_lora_rank, dev, num_sms=4)  # 1 split
        attn = KernelPagedBatch(cache, static.layout, kernels)
        tokens, lens = want.argmax(-1).tolist(), [len(p) for p in prompts]
        for _ in range(3):
            step = [SpanInput(SeqSpan(t, n, 1), [tok], True) for t, n, tok in zip(tables, lens, tokens)]
            want = run_to_end(ref.forward(step, Phase.D))
            static.fill([s.span for s in step], tokens)
            got = run_to_end(model.step(static.tokens, static.positions, attn, Phase.D,
                                        logits_index=static.logits_rows))[:2]
            assert _rel(got, want) < 1e-4
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
            tokens, lens = want.argmax(-1).tolist(), [n + 1 for n in lens]
    used = [s for t in tables for s in t]
    assert torch.allclose(cache.k[:, used], ref.cache.k[:, used], atol=1e-5)
