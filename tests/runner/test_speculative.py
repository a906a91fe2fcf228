"""The forwards of speculative decoding (`runner/speculative.py`, and the CUDA runner's graphs of them).

CPU: `flatten` makes one query row per new position; those rows, through the decode path of the
attention kernels (portable here), compute what the verify forward over multi-token spans
computes, for the target and for the MTP layer, on the tiny DeepSeek-V3 (MLA) with an MTP layer,
also from a padded static layout as the CUDA runner's graphs read it.
GPU: the CUDA runner's verify, draft and piecewise prefill graphs of hidden states against the
portable runner on the same model; they are let go and captured again (sleep and wake).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rollout.forward import run_to_end
from megatron_rollout.kernels.layout import KernelPagedBatch, StaticDecodeLayout, build_layout
from megatron_rollout.kernels.registry import PortableAttention
from megatron_rollout.kv.paged import PagedKVCache
from megatron_rollout.model.config import preset
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.runner.base import ModelRunner
from megatron_rollout.runner.speculative import flatten
from megatron_rollout.types import Phase, SeqSpan, SpanInput
from tests.model.test_mtp import CFG

BS = 4


def test_flatten_makes_one_query_row_per_new_position():
    rows = [SpanInput(SeqSpan((3, 1), 5, 3), [7, 8, 9], True, key=("a", 0)),
            SpanInput(SeqSpan((2,), 2, 1), [4], True)]
    assert flatten(rows) == [SpanInput(SeqSpan((3, 1), 5, 1), [7], True, ("a", 0)),
                             SpanInput(SeqSpan((3, 1), 6, 1), [8], True, ("a", 0)),
                             SpanInput(SeqSpan((3, 1), 7, 1), [9], True, ("a", 0)),
                             SpanInput(SeqSpan((2,), 2, 1), [4], True, None)]


def _one_query_batch(runner: ModelRunner, rows: list[SpanInput]):
    """The rows flattened, as the CUDA runner lays them out, over the portable kernels."""
    flat = flatten(rows)
    cfg, cache = runner.model.cfg, runner.cache
    layout = build_layout([r.span for r in flat], [r.token_ids for r in flat], [True] * len(flat), BS,
                          PortableAttention(), cfg.num_attention_heads, cache.k.shape[2], cfg.kv_lora_rank,
                          runner.device)
    assert layout.prefill is None and layout.decode.rows == len(flat)  # decode rows only: one query each
    return layout, KernelPagedBatch(cache, layout, PortableAttention())


@pytest.mark.timeout(120)
def test_one_query_rows_compute_the_verify_and_mtp_forwards():
    torch.manual_seed(0)
    model = MoETransformer(CFG).init_weights(seed=0, std=0.3)
    runner = ModelRunner(model, PagedKVCache(CFG, 16, BS, 1))
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    tables = [(0, 1, 2), (5, 4)]
    with torch.no_grad():
        run_to_end(runner.forward([SpanInput(SeqSpan(t, 0, len(p)), p, True) for t, p in zip(tables, prompts)],
                                  Phase.P))
        # a pending token and 3 drafts for the first row, 2 drafts for the second
        rows = [SpanInput(SeqSpan(tables[0], 6, 4), [10, 11, 2, 3], True, key=0),
                SpanInput(SeqSpan(tables[1], 3, 3), [6, 6, 1], True, key=1)]
        runner.cache.k[:, [10, 11, 18, 19]] = 100.0  # positions past both rows' last (stale drafts): never read
        want = run_to_end(runner.forward_hidden(rows, Phase.D))  # [7, H]
        layout, attn = _one_query_batch(runner, rows)
        got = run_to_end(model.hidden_step(layout.tokens.long(), layout.positions, attn, Phase.D))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # the MTP layer over the same positions: hidden states in, the next tokens
        nxt = torch.tensor([11, 2, 3, 5, 6, 1, 9])
        spans = [r.span for r in rows]
        want = run_to_end(runner.forward_mtp(spans, got, nxt, Phase.D))
        layout, attn = _one_query_batch(runner, [SpanInput(s, [0] * s.new, True) for s in spans])
        mtp = run_to_end(model.mtp_step(nxt, layout.positions, got, attn, Phase.D))
        torch.testing.assert_close(mtp, want, rtol=1e-4, atol=1e-4)
        # the lengths are the causal mask between a row's drafts: n + j + 1 for its row j
        assert layout.decode.host_lens.tolist() == [7, 8, 9, 10, 4, 5, 6]


class _StaticPortable(PortableAttention):
    """The portable decode over a static (CUDA-graph) layout, which keeps its indices on the device only."""

    def decode(self, q, k_cache, v_cache, meta, out):
        host = {f"host_{name}": getattr(meta, name).numpy().copy() for name in ("seq", "tables", "lens", "q_start")}
        super().decode(q, k_cache, v_cache, dataclasses.replace(meta, **host), out)


@pytest.mark.timeout(120)
def test_a_padded_static_layout_of_one_query_rows_computes_the_verify_forward():
    """As the CUDA runner fills its verify and draft graphs: the rows flattened into a bucket's
    static layout (padding rows: no KV stored, length 0), the MTP layer's input in a static buffer."""
    model = MoETransformer(CFG).init_weights(seed=1, std=0.3)
    runner = ModelRunner(model, PagedKVCache(CFG, 16, BS, 1))
    with torch.no_grad():
        run_to_end(runner.forward([SpanInput(SeqSpan((0, 1), 0, 5), [1, 2, 3, 4, 5], True)], Phase.P))
        rows = [SpanInput(SeqSpan((0, 1), 5, 3), [6, 7, 8], True, key=0)]
        before = runner.cache.k.clone()
        want = run_to_end(runner.forward_hidden(rows, Phase.D))
        static = StaticDecodeLayout(8, 4, BS, _StaticPortable(), CFG.num_attention_heads, 1, CFG.kv_lora_rank,
                                    runner.device, 8)
        flat = flatten(rows)
        static.fill([r.span for r in flat], [r.token_ids[0] for r in flat], [r.key for r in flat])
        attn = KernelPagedBatch(runner.cache, static.layout, _StaticPortable())
        runner.cache.k.copy_(before)
        got = run_to_end(model.hidden_step(static.tokens, static.positions, attn, Phase.D))  # [8, H]: 5 padding
        torch.testing.assert_close(got[:3], want, rtol=1e-4, atol=1e-4)
        others = [i for i in range(runner.cache.k.shape[1]) if i not in (5, 6, 7)]  # the rows' slots
        torch.testing.assert_close(runner.cache.k[:, others], before[:, others])  # padding rows stored nothing
        hidden = torch.zeros(8, CFG.hidden_size)  # the draft graph's static input, stale past the rows
        hidden[:3] = got[:3]
        nxt = torch.tensor([7, 8, 2])
        want = run_to_end(runner.forward_mtp([rows[0].span], got[:3], nxt, Phase.D))
        static.tokens[:3].copy_(nxt)
        mtp = run_to_end(model.mtp_step(static.tokens, static.positions, hidden, attn, Phase.D))
        torch.testing.assert_close(mtp[:3], want, rtol=1e-4, atol=1e-4)


# -- GPU -----------------------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_the_cuda_runner_replays_verify_and_draft_graphs_like_the_portable_runner():
    """The graphed verify, draft and piecewise hidden-state forwards stay as near an fp32 forward of
    the same weights as the same runner eagerly (its own kernels, no graphs) does: bf16 GEMMs of
    other (bucket) shapes round differently, by about as much as bf16 is from fp32. The portable
    runner is no reference here: its bf16 kernels differ from the CUDA runner's by 3-5% normwise in
    hidden states on the H200, as much as either differs from fp32; a graph that read wrong rows,
    positions or cache slots is off by ~100%."""
    from megatron_rollout.runner.config import RunnerConfig
    from megatron_rollout.runner.cuda import CudaRunner, make_runner

    cfg = preset("tiny-deepseek").replace(dtype="bfloat16", max_position_embeddings=1024, mtp_num_layers=1)
    cfg32 = cfg.replace(dtype="float32")
    exact = ModelRunner(MoETransformer(cfg32, device="cuda").init_weights(0, std=0.1),
                        PagedKVCache(cfg32, 64, 16, 1, device="cuda"))
    ref = make_runner(MoETransformer(cfg, device="cuda").init_weights(0, std=0.1),
                      PagedKVCache(cfg, 64, 16, 1, device="cuda"), RunnerConfig(use_graphs=False))
    fast = make_runner(MoETransformer(cfg, device="cuda").init_weights(0, std=0.1),
                       PagedKVCache(cfg, 64, 16, 1, device="cuda"),
                       RunnerConfig(graph_batch_sizes=(1, 2, 4, 8, 16), prefill_graph_tokens=(64, 256)))
    assert isinstance(fast, CudaRunner)

    def as_close(b: torch.Tensor, a: torch.Tensor, want: torch.Tensor) -> None:
        # the graph is as far from fp32 as bf16 rounding puts the eager forward, give or take half
        assert b.shape == a.shape == want.shape
        rels = _rel(b, a), _rel(b, want), _rel(a, want)
        print(f"graph-eager {rels[0]:.4f} graph-fp32 {rels[1]:.4f} eager-fp32 {rels[2]:.4f}")
        assert rels[1] <= 1.5 * rels[2] + 0.01 and rels[0] <= 0.1, rels

    gen = torch.Generator().manual_seed(0)
    tables = [tuple(range(i * 16, (i + 1) * 16)) for i in range(3)]
    lens = [37, 120, 5]
    with torch.no_grad():
        prompts = [SpanInput(SeqSpan(t, 0, n), torch.randint(0, 256, (n,), generator=gen).tolist(), True)
                   for t, n in zip(tables, lens)]
        w = run_to_end(exact.forward_hidden(prompts, Phase.P))
        a = run_to_end(ref.forward_hidden(prompts, Phase.P))
        b = run_to_end(fast.forward_hidden(prompts, Phase.P))  # 162 tokens: a piecewise graph of hidden states
        assert b.shape == (162, cfg.hidden_size)
        as_close(b, a, w)
        assert fast.stats["piecewise_forwards"] == 1 and fast.captured.speculative == (("prefill-hidden", 256),)
        for step in range(3):  # 3 rows with 2, 0 and 4 drafts: 9 one-query rows in the bucket of 16
            rows = [SpanInput(SeqSpan(t, n, d + 1), torch.randint(0, 256, (d + 1,), generator=gen).tolist(), True,
                              key=i) for i, (t, n, d) in enumerate(zip(tables, lens, (2, 0, 4)))]
            w = run_to_end(exact.forward_hidden(rows, Phase.D))
            a = run_to_end(ref.forward_hidden(rows, Phase.D))
            b = run_to_end(fast.forward_hidden(rows, Phase.D))
            assert b.shape == (9, cfg.hidden_size)
            as_close(b, a, w)
            nxt = torch.randint(0, 256, (9,), generator=gen).cuda()
            spans = [r.span for r in rows]
            z = run_to_end(exact.forward_mtp(spans, w, nxt, Phase.D))
            x = run_to_end(ref.forward_mtp(spans, a, nxt, Phase.D))
            y = run_to_end(fast.forward_mtp(spans, a, nxt, Phase.D))
            as_close(y, x, z)
            lens = [n + 1 + step for n in lens]  # some drafts accepted: the next rows start further on
    assert fast.stats["verify_replays"] == 3 and fast.stats["draft_replays"] == 3, fast.stats
    assert fast.spec_capture_error is None
    held = fast.release_graphs()  # sleep and wake: the same verify, draft and prefill graphs again
    assert held.speculative == (("hidden", 16), ("mtp", 16), ("prefill-hidden", 256))
    assert fast.captured.speculative == ()
    assert "3 of 3 verify/draft" in fast.restore_graphs(held) and fast.captured == held


def _graphed_runner(mtp_layers: int):
    """A CUDA runner of tiny-deepseek with decode buckets 1-16 and P graphs of 64 and 256 tokens."""
    from megatron_rollout.runner.config import RunnerConfig
    from megatron_rollout.runner.cuda import make_runner

    cfg = preset("tiny-deepseek").replace(dtype="bfloat16", max_position_embeddings=1024, mtp_num_layers=mtp_layers)
    return make_runner(MoETransformer(cfg, device="cuda").init_weights(0, std=0.1),
                       PagedKVCache(cfg, 64, 16, 1, device="cuda"),
                       RunnerConfig(graph_batch_sizes=(1, 2, 4, 8, 16), prefill_graph_tokens=(64, 256)))


def _prefilled(fast, rows: int) -> list[tuple[int, ...]]:
    """`rows` 40-token prompts run through `fast`'s hidden-state P forward; their block tables."""
    gen = torch.Generator().manual_seed(0)
    tables = [tuple(range(i * 16, (i + 1) * 16)) for i in range(rows)]
    prompts = [SpanInput(SeqSpan(t, 0, 40), torch.randint(0, 256, (40,), generator=gen).tolist(), True)
               for t in tables]
    with torch.no_grad():
        run_to_end(fast.forward_hidden(prompts, Phase.P))
    return tables


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_capture_takes_the_drafting_graphs_ahead_so_a_rollout_captures_none():
    """`capture(sizes, speculative=..., plain=False)` captures the verify and draft graphs of every
    bucket and the hidden-state P graphs before the first forward, and no plain graph: the forwards
    that follow capture nothing."""
    fast = _graphed_runner(mtp_layers=1)
    with pytest.raises(ValueError, match="plain=False"):
        fast.capture((2, 8), plain=False)
    assert fast.capture((2, 8), speculative=("hidden", "mtp"), plain=False)  # a drafting engine's capture
    assert fast.captured.speculative == (("hidden", 2), ("hidden", 8), ("mtp", 2), ("mtp", 8),
                                         ("prefill-hidden", 64), ("prefill-hidden", 256))
    assert fast.captured.decode == () and fast.captured.prefill == ()  # no plain graph it would never replay
    before = fast.stats["graph_captures"]
    tables = _prefilled(fast, 3)
    with torch.no_grad():
        rows = [SpanInput(SeqSpan(t, 40, 2), [1, 2], True, key=i) for i, t in enumerate(tables)]
        h = run_to_end(fast.forward_hidden(rows, Phase.D))
        run_to_end(fast.forward_mtp([r.span for r in rows], h, torch.arange(6, device="cuda"), Phase.D))
    assert fast.stats["graph_captures"] == before and fast.stats["verify_replays"] == 1
    assert fast.stats["draft_replays"] == 1


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_capture_of_plain_decode_buckets_beside_the_drafting_graphs():
    """`plain_decode` (n-gram drafting that decodes its undrafted steps ahead): those plain decode
    buckets are captured with the verify graphs, no plain P graph, and a plain decode forward
    replays one without capturing."""
    fast = _graphed_runner(mtp_layers=0)
    assert fast.capture((2, 8), speculative=("hidden",), plain=False, plain_decode=(2,))
    assert fast.captured.decode == (2,) and fast.captured.prefill == ()
    assert ("hidden", 8) in fast.captured.speculative
    before = fast.stats["graph_captures"]
    tables = _prefilled(fast, 2)
    replays = fast.stats["graph_replays"]
    with torch.no_grad():
        rows = [SpanInput(SeqSpan(t, 40, 1), [1], True, key=i) for i, t in enumerate(tables)]
        logits = run_to_end(fast.forward(rows, Phase.D))
    assert logits.shape[0] == 2
    assert fast.stats["graph_captures"] == before and fast.stats["graph_replays"] == replays + 1
