"""PagedBatch: attention over block tables equals the contiguous DenseKVCache and plain causal
attention over whole sequences, whatever the tables and however the positions arrive."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rollout.kv.paged import PagedBatch, PagedKVCache
from megatron_rollout.model.attention import DenseKVCache
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.model.layers import run_to_end
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.types import Phase, SeqSpan

HQ, HKV, D, LAYERS, BS = 4, 2, 8, 2, 4


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=50, hidden_size=32, num_layers=LAYERS, num_attention_heads=HQ, num_query_groups=HKV,
                kv_channels=D, ffn_hidden_size=48, max_position_embeddings=128)
    return ModelConfig(**{**base, **kw})


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of one whole sequence written out by hand. q: [n, hq, d]; k, v: [n, hkv, d]."""
    n = q.shape[0]
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _random_tables(lengths: list[int], num_blocks: int, gen: torch.Generator) -> list[tuple[int, ...]]:
    """Disjoint, shuffled block tables covering each sequence's full length."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in lengths:
        k = -(-n // BS)
        tables.append(tuple(perm[at:at + k]))
        at += k
    return tables


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_attention_equals_dense_and_full_causal(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = [11, 1, 7, 16]
    # Per round, new positions of each sequence (0 = not in this forward): a prefill in pieces,
    # then decode steps, sequences joining and leaving batches at different times.
    rounds = [[5, 1, 0, 9], [4, 0, 3, 4], [0, 0, 2, 1], [1, 0, 1, 1], [1, 0, 1, 1]]
    assert [sum(r[i] for r in rounds) for i in range(4)] == lengths
    cache = PagedKVCache(_cfg(), num_blocks=16, block_size=BS, kv_heads=HKV)
    tables = _random_tables(lengths, 16, gen)
    q = [torch.randn(LAYERS, n, HQ, D, generator=gen) for n in lengths]
    k = [torch.randn(LAYERS, n, HKV, D, generator=gen) for n in lengths]
    v = [torch.randn(LAYERS, n, HKV, D, generator=gen) for n in lengths]
    dense = DenseKVCache(LAYERS, len(lengths))
    paged_out = [[[] for _ in lengths] for _ in range(LAYERS)]
    dense_out = [[[] for _ in lengths] for _ in range(LAYERS)]
    done = [0] * len(lengths)
    for new in rounds:
        active = [i for i, n in enumerate(new) if n]
        batch = PagedBatch(cache, [SeqSpan(tables[i], done[i], new[i]) for i in active])
        assert batch.num_tokens == sum(new)
        assert batch.positions.tolist() == [p for i in active for p in range(done[i], done[i] + new[i])]
        dense.begin(new)
        for layer in range(LAYERS):
            sl = [slice(done[i], done[i] + new[i]) for i in active]
            qs = torch.cat([q[i][layer, s] for i, s in zip(active, sl)])
            ks = torch.cat([k[i][layer, s] for i, s in zip(active, sl)])
            vs = torch.cat([v[i][layer, s] for i, s in zip(active, sl)])
            p_out = batch.attend(layer, qs, ks, vs).split([new[i] for i in active])
            d_out = dense.attend(layer, qs, ks, vs).split([new[i] for i in active])
            for i, po, do in zip(active, p_out, d_out):
                paged_out[layer][i].append(po)
                dense_out[layer][i].append(do)
        dense.end()
        done = [d + n for d, n in zip(done, new)]
    for layer in range(LAYERS):
        for i, n in enumerate(lengths):
            paged = torch.cat(paged_out[layer][i])
            torch.testing.assert_close(paged, torch.cat(dense_out[layer][i]), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(paged, _reference(q[i][layer], k[i][layer], v[i][layer]), rtol=1e-5, atol=1e-5)
            # The cache holds each position's K/V in the slot its table names.
            slots = [tables[i][p // BS] * BS + p % BS for p in range(n)]
            assert torch.equal(cache.k[layer][slots], k[i][layer])
            assert torch.equal(cache.v[layer][slots], v[i][layer])


def test_writes_stay_in_their_blocks():
    """A forward writes only the slots of its own new positions; other blocks are untouched."""
    cache = PagedKVCache(_cfg(), num_blocks=6, block_size=BS, kv_heads=HKV)
    cache.k.fill_(7.0)
    cache.v.fill_(7.0)
    batch = PagedBatch(cache, [SeqSpan((4, 1), past=3, new=2)])  # positions 3, 4 -> slots 19, 4
    assert batch.slot_mapping.tolist() == [4 * BS + 3, 1 * BS + 0]
    q = torch.randn(2, HQ, D)
    kv = torch.zeros(2, HKV, D)
    batch.attend(0, q, kv, kv)
    written = torch.zeros(6 * BS, dtype=torch.bool)
    written[[19, 4]] = True
    assert (cache.k[0][written] == 0).all() and (cache.k[0][~written] == 7).all()
    assert (cache.k[1] == 7).all()  # another layer
    empty = PagedBatch(cache, [])
    assert empty.num_tokens == 0 and empty.positions.numel() == 0


def test_model_over_paged_kv_equals_full_forward():
    """The whole model, fed incrementally through random block tables, gives the logits of its
    full-sequence forward (the path the engine uses, without the engine)."""
    torch.manual_seed(0)
    cfg = _cfg(qk_layernorm=True)
    model = MoETransformer(cfg).init_weights(seed=3, std=0.2)
    gen = torch.Generator().manual_seed(5)
    lengths = [9, 3, 13]
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
    cache = PagedKVCache(cfg, num_blocks=12, block_size=BS, kv_heads=HKV)
    tables = _random_tables(lengths, 12, gen)
    rounds = [[6, 3, 5], [2, 0, 7], [1, 0, 1]]
    done, out = [0] * 3, [[] for _ in lengths]
    with torch.no_grad():
        for new in rounds:
            active = [i for i, n in enumerate(new) if n]
            batch = PagedBatch(cache, [SeqSpan(tables[i], done[i], new[i]) for i in active])
            tokens = torch.cat([seqs[i][done[i]:done[i] + new[i]] for i in active])
            logits = run_to_end(model.step(tokens, batch.positions, batch, Phase.P))
            for i, part in zip(active, logits.split([new[i] for i in active])):
                out[i].append(part)
            done = [d + n for d, n in zip(done, new)]
        for i, s in enumerate(seqs):
            full = model(s[None])[0]
            assert full.abs().max() > 0.5  # logits large enough for the comparison to mean something
            torch.testing.assert_close(torch.cat(out[i]), full, rtol=1e-4, atol=1e-4)
