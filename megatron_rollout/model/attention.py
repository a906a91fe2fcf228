"""Attention backends: how a layer's new queries meet cached and new keys.

The model computes q, k, v for the tokens it is given and hands them to a backend; the backend
owns where keys and values live. `CausalBatch` serves the full-sequence training forward (no
cache); `DenseKVCache` is a contiguous cache used as the reference for the paged store in
`megatron_rollout.kv`. All tensors are token-major: `[tokens, heads, head_dim]`.
"""
from __future__ import annotations

import abc
import math

import torch
import torch.nn.functional as F


class AttentionBackend(abc.ABC):
    @abc.abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [N, hq, d]; k, v: [N, hkv, d] for the N new tokens (RoPE applied).

        Stores k, v where the backend keeps them and returns [N, hq, d]: each new token attends
        causally to its sequence's earlier tokens (cached and new)."""


KEY_BUCKET = 64
"""On CPU a query attends over its keys padded to a multiple of this many (masked), whatever else it
is computed with; see `row_invariant_attention`."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """One sequence. q: [n, hq, d] at positions past..past+n-1; k, v: [past+n, hkv, d]."""
    if q.device.type == "cpu":
        return row_invariant_attention(q, k, v, past)
    n, hq, d = q.shape
    total, hkv, _ = k.shape
    scale = 1.0 / math.sqrt(d)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [h, len, d]
    if hq != hkv:
        kh = kh.repeat_interleave(hq // hkv, dim=0)
        vh = vh.repeat_interleave(hq // hkv, dim=0)
    if n == 1 or past == 0 and n == total:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=n > 1, scale=scale)
    else:
        rows = torch.arange(n, device=q.device)[:, None] + past
        mask = torch.arange(total, device=q.device)[None, :] <= rows  # [n, total]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def row_invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """`causal_attention` whose every query row comes out bit for bit the same however it is computed:
    alone in a decode step, inside a prefill of any length, or after a cached prefix.

    A query at position p attends over keys 0..p padded (zeros, masked) to the bucket of
    `KEY_BUCKET` that holds p, so its reductions always run over the same length; the queries of one
    bucket share one pair of matmuls, their rows padded to a multiple of `layers.ROW_MULTIPLE`
    (the CPU matmul's rounding depends on the row count otherwise). Fused attention kernels pick
    their blocking by sequence length, which is why this is written out in matmuls.
    """
    n, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty_like(q)
    i = 0
    while i < n:
        span = -(-(past + i + 1) // KEY_BUCKET) * KEY_BUCKET  # padded key count of query i's bucket
        j = min(n, span - past)  # queries i..j-1 see at most `span` keys
        rows = -(-(j - i) // 8) * 8
        keys = min(span, past + n)
        qb = q.new_zeros(rows, hq, d)
        qb[: j - i] = q[i:j]
        kb, vb = k.new_zeros(span, hkv, d), v.new_zeros(span, hkv, d)
        kb[:keys], vb[:keys] = k[:keys], v[:keys]
        qh, kh, vh = qb.transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1)  # [h, len, d]
        if hq != hkv:
            kh = kh.repeat_interleave(hq // hkv, dim=0)
            vh = vh.repeat_interleave(hq // hkv, dim=0)
        scores = torch.matmul(qh, kh.transpose(1, 2)) * (1.0 / math.sqrt(d))  # [h, rows, span]
        visible = torch.arange(span) <= (past + i + torch.arange(rows))[:, None]  # [rows, span]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[i:j] = torch.matmul(probs, vh)[:, : j - i].transpose(0, 1)
        i = j
    return out


class CausalBatch(AttentionBackend):
    """Full-sequence forward of a right-padded batch `[batch, seq]` flattened to tokens."""

    def __init__(self, batch: int, seq: int) -> None:
        self.batch, self.seq = batch, seq

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s = self.batch, self.seq
        qh = q.view(b, s, *q.shape[1:]).transpose(1, 2)  # [b, hq, s, d]
        kh = k.view(b, s, *k.shape[1:]).transpose(1, 2)
        vh = v.view(b, s, *v.shape[1:]).transpose(1, 2)
        if qh.shape[1] != kh.shape[1]:
            rep = qh.shape[1] // kh.shape[1]
            kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=1.0 / math.sqrt(q.shape[-1]))
        return out.transpose(1, 2).reshape(q.shape)


class DenseKVCache(AttentionBackend):
    """Contiguous per-sequence cache, grown by `begin(new_lens)` before each forward.

    Sequences are laid out in the order of `new_lens`; each forward's tokens are the
    concatenation of every sequence's new tokens (possibly zero for a sequence)."""

    def __init__(self, num_layers: int, num_seqs: int) -> None:
        self.k: list[list[torch.Tensor | None]] = [[None] * num_seqs for _ in range(num_layers)]
        self.v: list[list[torch.Tensor | None]] = [[None] * num_seqs for _ in range(num_layers)]
        self.lens = [0] * num_seqs
        self.new_lens = [0] * num_seqs

    def begin(self, new_lens: list[int]) -> None:
        if len(new_lens) != len(self.lens):
            raise ValueError(f"expected {len(self.lens)} lengths, got {len(new_lens)}")
        self.new_lens = list(new_lens)

    def positions(self) -> torch.Tensor:
        return torch.cat([torch.arange(p, p + n) for p, n in zip(self.lens, self.new_lens)])

    def end(self) -> None:
        self.lens = [p + n for p, n in zip(self.lens, self.new_lens)]
        self.new_lens = [0] * len(self.lens)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for s, n in enumerate(self.new_lens):
            if n == 0:
                continue
            sl = slice(start, start + n)
            old_k, old_v = self.k[layer][s], self.v[layer][s]
            ks = k[sl] if old_k is None else torch.cat([old_k, k[sl]])
            vs = v[sl] if old_v is None else torch.cat([old_v, v[sl]])
            self.k[layer][s], self.v[layer][s] = ks, vs
            out[sl] = causal_attention(q[sl], ks, vs, self.lens[s])
            start += n
        return out
