"""Comparing what two paged KV caches hold (the GPU runner tests compare a runner against a reference)."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_rollout.kv.paged import PagedKVCache


def kv_rel(cache: PagedKVCache, ref: PagedKVCache, blocks: Iterable[int]) -> float:
    """The largest relative difference, over layers and K / V, of the two caches' `blocks`."""
    idx = torch.as_tensor(list(blocks), device=cache.k.device)
    worst = 0.0
    for name in ("k", "v"):
        a, b = getattr(cache, name), getattr(ref, name)
        for layer in range(a.shape[0]):
            x = a[layer].view(cache.num_blocks, cache.block_size, *a.shape[2:])[idx].double()
            y = b[layer].view(ref.num_blocks, ref.block_size, *b.shape[2:])[idx].double()
            worst = max(worst, float((x - y).norm() / y.norm().clamp_min(1e-12)))
    return worst
