"""The native model's two forward paths agree, its log-probabilities are what they claim, and it trains."""
from __future__ import annotations

import torch

from megatron_rollout.model.attention import DenseKVCache
from megatron_rollout.model.config import PRESETS
from megatron_rollout.model.layers import run_to_end
from megatron_rollout.model.transformer import MoETransformer
from megatron_rollout.types import Phase

CFG = PRESETS["tiny-moe"]


def _model(seed: int = 0, std: float = 0.2) -> MoETransformer:
    return MoETransformer(CFG).init_weights(seed=seed, std=std)


def _seqs(lens, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=gen) for n in lens]


def _padded(seqs: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


def test_incremental_equals_full_forward():
    model = _model()
    lens = (13, 6, 9)
    rounds = [[5, 1, 0], [1, 2, 4], [4, 0, 3], [1, 1, 1], [2, 2, 1]]  # uneven chunks, idle sequences
    assert [sum(c) for c in zip(*rounds)] == list(lens)
    seqs = _seqs(lens)
    with torch.no_grad():
        full = model(_padded(seqs))  # [B, T, V]
        cache = DenseKVCache(CFG.num_layers, len(seqs))
        done, got = [0] * len(seqs), [[] for _ in seqs]
        for new in rounds:
            cache.begin(new)
            tokens = torch.cat([s[d:d + n] for s, d, n in zip(seqs, done, new)])
            logits = run_to_end(model.step(tokens, cache.positions(), cache, Phase.D))  # [sum(new), V]
            cache.end()
            for i, part in enumerate(logits.split(new)):
                got[i].append(part)
                done[i] += new[i]
    assert full.abs().max() > 1.0
    for i, s in enumerate(seqs):
        torch.testing.assert_close(torch.cat(got[i]), full[i, : len(s)], atol=1e-5, rtol=0)
    assert cache.lens == list(lens)


def test_logits_index_selects_rows():
    model = _model()
    seq = _seqs((7,))[0]
    with torch.no_grad():
        cache = DenseKVCache(CFG.num_layers, 1)
        cache.begin([7])
        last = run_to_end(model.step(seq, cache.positions(), cache, Phase.P, logits_index=torch.tensor([6])))
        full = model(seq[None])[0]
    torch.testing.assert_close(last[0], full[6], atol=1e-5, rtol=0)


def test_right_padding_does_not_change_real_positions():
    model = _model()
    seq = _seqs((5,))[0]
    with torch.no_grad():
        alone = model(seq[None])[0]
        padded = model(torch.cat([seq, torch.full((4,), 7)])[None])[0, :5]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)


def test_token_logprobs_is_a_log_softmax_gather():
    model = _model()
    ids = _padded(_seqs((8, 8), seed=2))
    with torch.no_grad():
        got = model.token_logprobs(ids)  # [B, T-1]
        logits = model(ids).double()
    want = torch.stack([torch.stack([logits[b, t].log_softmax(-1)[ids[b, t + 1]] for t in range(ids.shape[1] - 1)])
                        for b in range(ids.shape[0])])
    assert got.shape == (2, 7) and got.dtype == torch.float32
    assert (got < 0).all()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def test_backward_reaches_experts_that_received_tokens():
    model = _model(std=0.2)
    ids = _seqs((3,), seed=4)[0][None]  # 3 tokens x top-2: at most 6 of the 8 experts get tokens
    layer = 1  # an MoE layer of tiny-moe
    moe = model.decoder.layers[layer].mlp
    routed = set()

    def record(module, args, output):
        routed.update(output[1].reshape(-1).tolist())  # expert ids the router chose

    handle = moe.router.register_forward_hook(record)
    loss = model(ids).float().logsumexp(-1).mean()  # every position contributes
    handle.remove()
    loss.backward()
    assert 0 < len(routed) < CFG.num_moe_experts
    for e, expert in enumerate(moe.experts.local_experts):
        grad = expert.linear_fc1.weight.grad
        if e in routed:
            assert grad is not None and grad.abs().sum() > 0, f"expert {e} got tokens but no gradient"
        else:
            assert grad is None or grad.abs().sum() == 0, f"expert {e} got no tokens but a gradient"
    assert moe.router.weight.grad.abs().sum() > 0  # routing weights are differentiable
    assert model.embedding.word_embeddings.weight.grad.abs().sum() > 0
    assert model.decoder.layers[0].self_attention.linear_qkv.weight.grad.abs().sum() > 0
