"""Paged K/V tensors and the attention backend that reads and writes them.

`PagedKVCache` owns one flat slot array per layer, `[num_blocks * block_size, kv_heads, head_dim]`
(the local KV heads of this rank's ATP shard); a block table maps a sequence's positions to slots.
Under multi-latent attention (`model.mla`) a slot holds one row, the latent and the RoPE key,
`[slots, 1, kv_lora_rank + qk_pos_emb_head_dim]`, read as both key and value: `v` is `k`.
`PagedBatch` is built per forward from the sequences it runs (their tables, how many positions are
already cached, how many are new) and is what the model's attention calls. This portable version
gathers each sequence's K/V and runs torch attention; fused paged kernels plug in behind the same
`AttentionBackend` interface.
"""
from __future__ import annotations

import torch

from megatron_rollout.model.attention import AttentionBackend, causal_attention
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.types import SeqSpan


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, kv_heads: int,
                 device: torch.device | str | None = None) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        heads, width = cfg.kv_cache_dims or (kv_heads, cfg.kv_channels)
        shape = (cfg.num_layers + cfg.mtp_num_layers, num_blocks * block_size, heads, width)  # MTP's attention last
        self.k = torch.zeros(shape, dtype=cfg.torch_dtype, device=device)  # [layers, slots, hkv, d]
        # MLA caches one row per token that is both key and value: `v` is the same storage
        self.v = self.k if cfg.kv_cache_dims else torch.zeros(shape, dtype=cfg.torch_dtype, device=device)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """K/V of blocks `src` into blocks `dst` (pairwise), every layer: a forked sequence's own
        copy of a shared partial block. Issued on the current stream."""
        bs = self.block_size
        offsets = torch.arange(bs)
        s = (torch.tensor(src)[:, None] * bs + offsets).flatten().to(self.k.device)  # [copies * block_size]
        d = (torch.tensor(dst)[:, None] * bs + offsets).flatten().to(self.k.device)
        self.k[:, d] = self.k[:, s]
        if self.v is not self.k:
            self.v[:, d] = self.v[:, s]

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, kv_heads: int) -> int:
        itemsize = torch.empty((), dtype=cfg.torch_dtype).element_size()
        layers = cfg.num_layers + cfg.mtp_num_layers
        if cfg.kv_cache_dims:
            heads, width = cfg.kv_cache_dims
            return layers * block_size * heads * width * itemsize
        return 2 * layers * block_size * kv_heads * cfg.kv_channels * itemsize


class PagedBatch(AttentionBackend):
    def __init__(self, cache: PagedKVCache, spans: list[SeqSpan]) -> None:
        self.cache, self.spans = cache, spans
        bs, dev = cache.block_size, cache.k.device
        slots, self.history = [], []
        for span in spans:
            table = torch.tensor(span.table, dtype=torch.long)
            pos = torch.arange(span.past + span.new)
            seq_slots = table[pos // bs] * bs + pos % bs  # every position's slot, [past+new]
            slots.append(seq_slots[span.past:])
            self.history.append(seq_slots.to(dev))
        self.slot_mapping = torch.cat(slots).to(dev) if slots else torch.zeros(0, dtype=torch.long, device=dev)
        self.positions = torch.cat([torch.arange(s.past, s.past + s.new) for s in spans]).to(dev) if spans \
            else torch.zeros(0, dtype=torch.long, device=dev)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[self.slot_mapping] = k
        if vc is not kc:
            vc[self.slot_mapping] = v
        out = torch.empty_like(q)
        start = 0
        for span, hist in zip(self.spans, self.history):
            sl = slice(start, start + span.new)
            out[sl] = causal_attention(q[sl], kc[hist], vc[hist], span.past)
            start += span.new
        return out
