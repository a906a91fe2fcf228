"""The prefix cache: computed full KV blocks reused by later sequences with the same tokens.

GRPO samples of one prompt, a session evicted and resumed, and repeated system prompts all start
with blocks some earlier sequence computed. A block is keyed by the hash chain of its tokens and
by the weight version its K/V was computed under, so nothing computed with old weights is ever
reused. The block pool holds the key -> block map; this module decides when to offer and take.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rollout.engine.scheduler import Stage
from megatron_rollout.kv.block_pool import BlockPool

if TYPE_CHECKING:
    from megatron_rollout.engine.request import Request, Seq


class PrefixCache:
    def __init__(self, pool: BlockPool, enabled: bool) -> None:
        self.pool, self.enabled = pool, enabled

    def keys(self, hashes: list[int], version: int) -> list[int]:
        return [hash((version, h)) for h in hashes]

    def attach(self, req: "Request", version: int, headroom: int) -> int:
        """Give a waiting request the cached blocks of its prefix; the headroom left. Reviving a
        block from the free list takes it from the pool, so revivals stop while doing so would
        leave fewer than `headroom` free blocks (the caller's: one per decode row, which need them
        to grow). Callers go oldest first."""
        seq, pool, bs = req.seq, self.pool, self.pool.block_size
        if not self.enabled or req.stage is not Stage.WAITING or seq.computed or pool.table(seq.sid):
            return headroom
        if req.params.prompt_logprobs is not None and not req.output:  # every prompt position is scored
            return headroom
        usable = (len(seq.tokens) - 1) // bs  # always compute at least the last token
        blocks = pool.lookup(self.keys(seq.block_hashes(bs, stop=usable), version))
        revived = sum(pool.refcount[b] == 0 for b in blocks)
        if blocks and revived <= headroom:
            headroom -= revived
            pool.share(seq.sid, blocks)
            seq.computed = len(blocks) * bs
            seq.registered, seq.kv_version = len(blocks), version
        return headroom

    def offer(self, seq: "Seq", version: int) -> None:
        """Offer the sequence's newly completed full blocks, once each, and only while all its
        K/V was computed under one weight version (the current one)."""
        seq.kv_version = version if seq.kv_version in (None, version) else -1
        full = seq.computed // self.pool.block_size
        if not self.enabled or seq.kv_version != version or full <= seq.registered:
            return
        table = self.pool.table(seq.sid)
        for i, key in enumerate(self.keys(seq.block_hashes(self.pool.block_size, seq.registered, full), version),
                                start=seq.registered):
            self.pool.register(table[i], key)
        seq.registered = full
