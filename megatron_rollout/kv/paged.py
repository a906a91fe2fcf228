"""Paged K/V tensors and the attention backend that reads and writes them.

`PagedKVCache` owns one flat slot array per layer, `[num_blocks * block_size, kv_heads, head_dim]`
(the local KV heads of this rank's ATP shard); a block table maps a sequence's positions to slots.
Under multi-latent attention (`model.mla`) a slot holds one row, the latent and the RoPE key,
`[slots, 1, kv_lora_rank + qk_pos_emb_head_dim]`, read as both key and value: `v` is `k`.
`PagedBatch` is built per forward from the sequences it runs (their tables, how many positions are
already cached, how many are new) and is what the model's attention calls. This portable version
gathers each sequence's K/V and runs torch attention; fused paged kernels plug in behind the same
`AttentionBackend` interface.

On CUDA the engine builds the cache address-stable where the driver allows (`stable`,
`KVConfig.stable_memory`): `release` hands its memory back between rollouts and `restore` takes it
again at the same addresses, so captured graphs over it stay valid (`engine.memory`).
"""
from __future__ import annotations

import torch

from megatron_rollout.model.attention import AttentionBackend, causal_attention
from megatron_rollout.model.config import ModelConfig
from megatron_rollout.types import SeqSpan
from megatron_rollout.vmm import StableBuffer


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, kv_heads: int,
                 device: torch.device | str | None = None, stable: bool = False) -> None:
        """`stable`: K and V live in one `vmm.StableBuffer` (CUDA), so `release` and `restore` keep
        their addresses and the graphs captured over them; else plain torch tensors."""
        self.num_blocks, self.block_size = num_blocks, block_size
        heads, width = cfg.kv_cache_dims or (kv_heads, cfg.kv_channels)
        shape = (cfg.num_layers + cfg.mtp_num_layers, num_blocks * block_size, heads, width)  # MTP's attention last
        self.memory: StableBuffer | None = None
        """The address-stable memory under K and V, or None (plain tensors)."""
        if stable:
            one = torch.empty(shape, dtype=cfg.torch_dtype, device="meta").nbytes
            self.memory = StableBuffer(one if cfg.kv_cache_dims else 2 * one, device)
            self.k = self.memory.view(cfg.torch_dtype, shape)  # [layers, slots, hkv, d], zeros
            self.v = self.k if cfg.kv_cache_dims else self.memory.view(cfg.torch_dtype, shape, offset=one)
            return
        self.k = torch.zeros(shape, dtype=cfg.torch_dtype, device=device)  # [layers, slots, hkv, d]
        # MLA caches one row per token that is both key and value: `v` is the same storage
        self.v = self.k if cfg.kv_cache_dims else torch.zeros(shape, dtype=cfg.torch_dtype, device=device)

    @property
    def released(self) -> bool:
        """The physical memory under an address-stable cache is back with the driver (`release`)."""
        return self.memory is not None and not self.memory.mapped

    def release(self) -> int:
        """Give an address-stable cache's memory back to the driver, keeping K's and V's addresses;
        the bytes released. Until `restore` nothing may read or write K or V."""
        if self.memory is None:
            raise RuntimeError("this KV cache is not address-stable (PagedKVCache(stable=False)): drop it and "
                               "build a new one instead")
        return self.memory.release()

    def restore(self) -> int:
        """Map new memory under K and V at their addresses, zero-filled (as when built); the bytes mapped."""
        if self.memory is None:
            raise RuntimeError("this KV cache is not address-stable (PagedKVCache(stable=False)): it was never "
                               "released")
        return self.memory.restore()

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
