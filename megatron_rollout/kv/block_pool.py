"""Paged-KV bookkeeping: which block belongs to whom. Python numbers only, no tensors.

A block holds `block_size` token positions of K and V for every layer (the tensors live in
`kv.paged.PagedKVCache`). Blocks are reference counted: the samples of one GRPO group share
their prompt's full blocks through the prefix cache, and a multi-turn session keeps its blocks
between turns. A freed block keeps its prefix hash until it is handed out again, so a later
request with the same prefix can still revive it.

Owners are integers (sequence ids). `check_integrity()` proves that every reference count equals
the number of owners' tables naming the block, that no block is both free and owned, and that no
owner names a block twice; every engine test calls it at teardown.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class KVExhausted(RuntimeError):
    """Not enough free blocks; the scheduler should have planned around it."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcount = [0] * num_blocks  # = len(self._holders[block])
        self._holders: list[set[int]] = [set() for _ in range(num_blocks)]
        self._exclusive: dict[int, int] = {}  # owner -> blocks no other owner holds
        # Free blocks, least recently freed first. An OrderedDict, not a dict: popping the oldest is
        # O(1) there, while a plain dict's next(iter(...)) walks every slot deleted before it.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.tables: dict[int, list[int]] = {}  # owner -> blocks, in position order
        self.block_hash: dict[int, int] = {}  # block -> prefix hash of its (full) contents
        self.hash_block: dict[int, int] = {}  # prefix hash -> block
        self.reserved: set[int] = set()  # owners whose newest blocks are held for an admitted prefill

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def table(self, owner: int) -> list[int]:
        return self.tables.get(owner, [])

    def exclusive(self, owner: int) -> int:
        """Blocks of `owner` that no other owner holds (what releasing it would free). Kept up to
        date as blocks are held and dropped, so the planner reads it in O(1) every step."""
        return self._exclusive.get(owner, 0)

    def _hold(self, owner: int, block: int) -> None:
        holders = self._holders[block]
        if len(holders) == 1:
            self._exclusive[next(iter(holders))] -= 1  # its sole holder now shares it
        holders.add(owner)
        if len(holders) == 1:
            self._exclusive[owner] = self._exclusive.get(owner, 0) + 1
        self.refcount[block] = len(holders)

    def _drop(self, owner: int, block: int) -> None:
        holders = self._holders[block]
        holders.discard(owner)
        if len(holders) == 1:  # the last holder has it to itself again
            last = next(iter(holders))
            self._exclusive[last] = self._exclusive.get(last, 0) + 1
        self.refcount[block] = len(holders)
        if not holders:
            self._free[block] = None

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- ownership -------------------------------------------------------------------------
    def blocks_to_grow(self, owner: int, tokens: int) -> int:
        """Blocks `grow(owner, tokens)` would add."""
        return max(0, self.blocks_for(tokens) - len(self.tables.get(owner, ())))

    def grow(self, owner: int, tokens: int) -> list[int]:
        """Make `owner`'s table cover `tokens` positions; returns the blocks added."""
        table = self.tables.setdefault(owner, [])
        need = self.blocks_to_grow(owner, tokens)
        if need <= 0:
            return []
        if need > len(self._free):
            raise KVExhausted(f"owner {owner} needs {need} blocks, {len(self._free)} free")
        added = []
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            self._forget_hash(block)
            self._hold(owner, block)
            added.append(block)
        table.extend(added)
        return added

    def reserve(self, owner: int, tokens: int) -> list[int]:
        """Grow `owner` for an admitted prefill; the blocks stay reserved until `promote`."""
        added = self.grow(owner, tokens)
        self.reserved.add(owner)
        return added

    def promote(self, owner: int) -> None:
        """The prefill finished: its blocks now belong to a decoding sequence."""
        self.reserved.discard(owner)

    def share(self, owner: int, blocks: Sequence[int]) -> None:
        """Append already-computed blocks (a cached prefix) to a fresh owner's table."""
        table = self.tables.setdefault(owner, [])
        if table:
            raise ValueError(f"owner {owner} already holds {len(table)} blocks; share only into an empty table")
        for block in blocks:
            if self.refcount[block] == 0:
                del self._free[block]
            self._hold(owner, block)
            table.append(block)

    def fork(self, owner: int, new_owner: int, tokens: int) -> tuple[int, int] | None:
        """Give `new_owner` (no blocks yet) `owner`'s first `tokens` positions: the full blocks shared,
        a partial last one as a fresh block where one is free. Returns (owner's block, the fresh one)
        for the caller to copy the K/V of, or None (no partial block, or no block free for it)."""
        table, full = self.table(owner), tokens // self.block_size
        self.share(new_owner, table[:full])
        if tokens % self.block_size == 0 or not self._free:
            return None
        return table[full], self.grow(new_owner, tokens)[0]

    def release(self, owner: int) -> None:
        """Drop every block of `owner` (end of a sequence, preemption, cancellation)."""
        self.reserved.discard(owner)
        for block in self.tables.pop(owner, []):
            self._drop(owner, block)
        self._exclusive.pop(owner, None)

    def transfer(self, owner: int, new_owner: int) -> None:
        """Hand every block of `owner` to `new_owner` (which holds none), e.g. to park them."""
        if new_owner in self.tables:
            raise ValueError(f"owner {new_owner} already holds blocks")
        table = self.tables.pop(owner, [])
        for block in table:
            self._holders[block].discard(owner)
            self._holders[block].add(new_owner)
        self.tables[new_owner] = table
        self._exclusive[new_owner] = self._exclusive.pop(owner, 0)
        if owner in self.reserved:
            self.reserved.discard(owner)
            self.reserved.add(new_owner)

    # -- prefix cache ----------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached run of these full-block prefix hashes."""
        found = []
        for h in hashes:
            block = self.hash_block.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def register(self, block: int, prefix_hash: int) -> None:
        """Mark a full, computed block as reusable by requests with the same prefix."""
        if prefix_hash in self.hash_block or block in self.block_hash:
            return
        self.block_hash[block], self.hash_block[prefix_hash] = prefix_hash, block

    def uncache(self, blocks: Iterable[int]) -> None:
        """Forget the prefixes of these blocks: `lookup` no longer finds them."""
        for block in blocks:
            self._forget_hash(block)

    def _forget_hash(self, block: int) -> None:
        h = self.block_hash.pop(block, None)
        if h is not None:
            del self.hash_block[h]

    # -- checks ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        owners: list[set[int]] = [set() for _ in range(self.num_blocks)]
        for owner, table in self.tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"owner {owner} names a block twice: {table}")
            for block in table:
                owners[block].add(owner)
        counts = [len(o) for o in owners]
        for block in range(self.num_blocks):
            if counts[block] != self.refcount[block]:
                raise AssertionError(f"block {block}: refcount {self.refcount[block]} but {counts[block]} owners")
            if (block in self._free) != (counts[block] == 0):
                raise AssertionError(f"block {block}: free={block in self._free} with {counts[block]} owners")
            if self._holders[block] != owners[block]:
                raise AssertionError(f"block {block}: holders recorded {sorted(self._holders[block])}, "
                                     f"owners {sorted(owners[block])}")
        for owner, table in self.tables.items():
            exclusive = sum(self.refcount[b] == 1 for b in table)
            if exclusive != self.exclusive(owner):
                raise AssertionError(f"owner {owner}: {self.exclusive(owner)} exclusive blocks counted, "
                                     f"{exclusive} in its table {table}")
        if not self.reserved <= set(self.tables):
            raise AssertionError(f"reservations without blocks: {sorted(self.reserved - set(self.tables))}")
        for h, block in self.hash_block.items():
            if self.block_hash.get(block) != h:
                raise AssertionError(f"prefix hash {h} -> block {block} is not mirrored")
