"""Prefill through `torch.nn.attention.varlen.varlen_attn` (backend "varlen"); decode and KV
stores stay the Triton kernels.

`varlen_attn` in torch 2.11 takes contiguous variable-length K/V and no block table, so this
backend gathers each prefill span's history (cached prefix + the new tokens just stored) into one
contiguous `[total_k, hkv, d]` buffer first: a copy of ~2 x total_k x hkv x d elements per layer,
small next to the attention itself for long prefills. The mask is causal aligned to the *end* of
each key sequence (the flash-attention convention when queries are fewer than keys), which is
exactly "cached prefix + new tokens". The GPU tests compare it with the portable path; the
benchmark times it against the Triton prefill kernel and says which it used.

Left out: `varlen_attn`'s own paged mode (newer torch builds take a block table; 2.11 does not).
"""
from __future__ import annotations

import inspect
import math

import numpy as np
import torch

from megatron_rollout.kernels.layout import to_device
from megatron_rollout.kernels.registry import PrefillMeta, history_slots, register
from megatron_rollout.kernels.triton_attention import TritonAttention


def _varlen():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


@register
class VarlenAttention(TritonAttention):
    name = "varlen"

    @classmethod
    def missing(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"varlen_attn needs a CUDA device, got {device}"
        try:
            _varlen()
        except ImportError as exc:
            return f"torch.nn.attention.varlen is unavailable ({exc}); it needs torch >= 2.10"
        return None

    def __init__(self) -> None:
        params = inspect.signature(_varlen()).parameters
        self._causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        self._gqa = "enable_gqa" in params

    def prefill(self, q, k_cache, v_cache, meta: PrefillMeta, out):
        if not meta.spans:
            return
        bs, dev = meta.block_size, q.device
        spans = list(meta.spans)
        news = meta.host_new[spans]
        totals = meta.host_past[spans] + news
        hist = np.concatenate([history_slots(meta.host_tables[s], int(t), bs) for s, t in zip(spans, totals)])
        rows = np.concatenate([np.arange(meta.host_q_start[s], meta.host_q_start[s] + n) for s, n in zip(spans, news)])
        cu_q = np.concatenate([[0], np.cumsum(news)])
        cu_k = np.concatenate([[0], np.cumsum(totals)])
        host = np.concatenate([hist, rows, cu_q, cu_k]).astype(np.int64)
        idx = to_device(host, dev)
        a, b = len(hist), len(hist) + len(rows)
        hist_t, rows_t = idx[:a], idx[a:b]
        cu_q_t, cu_k_t = idx[b:b + len(cu_q)].int(), idx[b + len(cu_q):].int()
        k = k_cache.index_select(0, hist_t)  # [total_k, hkv, d]
        v = v_cache.index_select(0, hist_t)
        qq = q.index_select(0, rows_t)
        extra = dict(self._causal)
        group = q.shape[1] // k.shape[1]
        if group > 1:
            if self._gqa:
                extra["enable_gqa"] = True
            else:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        o = _varlen()(qq, k, v, cu_q_t, cu_k_t, int(news.max()), int(totals.max()),
                      scale=1.0 / math.sqrt(q.shape[-1]), **extra)
        out.index_copy_(0, rows_t, o.to(out.dtype))
