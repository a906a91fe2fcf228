"""BlockPool: ownership, refcounts, reservations, the prefix cache, and `check_integrity` (which
must catch every kind of corruption it claims to, or the engine tests' teardown proves nothing)."""
from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from megatron_rollout.kv.block_pool import BlockPool, KVExhausted


def test_grow_allocates_only_what_is_missing():
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.grow(7, tokens=5) == [0, 1]  # 5 positions -> 2 blocks, lowest first on a fresh pool
    assert pool.table(7) == [0, 1] and pool.refcount[:3] == [1, 1, 0] and pool.num_free == 4
    assert pool.grow(7, tokens=8) == []  # still 2 blocks
    assert pool.grow(7, tokens=9) == [2]
    assert pool.table(7) == [0, 1, 2] and pool.num_free == 3
    assert pool.blocks_for(0) == 0 and pool.blocks_for(1) == 1 and pool.blocks_for(12) == 3
    assert pool.table(99) == []  # unknown owner: empty, and no entry is created
    assert 99 not in pool.tables
    pool.check_integrity()


def test_kv_exhausted_changes_nothing():
    pool = BlockPool(num_blocks=3, block_size=2)
    pool.grow(1, tokens=4)
    with pytest.raises(KVExhausted, match="owner 2 needs 2 blocks, 1 free"):
        pool.grow(2, tokens=3)
    assert pool.num_free == 1 and pool.table(2) == [] and pool.refcount == [1, 1, 0]
    with pytest.raises(KVExhausted):
        pool.reserve(1, tokens=8)  # 4 blocks, holds 2, 1 free
    assert pool.table(1) == [0, 1] and 1 not in pool.reserved
    pool.check_integrity()


def test_release_frees_a_block_only_when_its_last_owner_goes():
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.grow(1, tokens=4)  # blocks 0, 1
    pool.share(2, [0, 1])
    pool.share(3, [0])
    assert pool.refcount == [3, 2, 0, 0] and pool.num_free == 2
    pool.release(1)
    assert pool.refcount == [2, 1, 0, 0] and pool.num_free == 2 and 1 not in pool.tables
    pool.release(2)
    assert pool.refcount == [1, 0, 0, 0] and pool.num_free == 3
    pool.release(3)
    assert pool.refcount == [0] * 4 and pool.num_free == 4 and pool.tables == {}
    pool.release(3)  # releasing an owner twice is a no-op
    pool.check_integrity()


def test_share_only_into_an_empty_table():
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.grow(1, tokens=2)
    pool.grow(2, tokens=2)
    with pytest.raises(ValueError, match="owner 2 already holds 1 blocks"):
        pool.share(2, pool.table(1))
    assert pool.refcount == [1, 1, 0, 0]
    pool.check_integrity()


def test_reservation_lasts_until_promote_or_release():
    pool = BlockPool(num_blocks=8, block_size=4)
    assert pool.reserve(5, tokens=10) == [0, 1, 2]
    assert pool.reserved == {5}
    pool.promote(5)
    assert pool.reserved == set() and pool.table(5) == [0, 1, 2]  # promotion keeps the blocks
    pool.reserve(6, tokens=1)
    pool.release(6)
    assert pool.reserved == set() and pool.num_free == 5
    pool.promote(42)  # promoting an unknown owner is harmless
    pool.check_integrity()


def test_prefix_register_and_lookup_longest_run():
    pool = BlockPool(num_blocks=8, block_size=4)
    blocks = pool.grow(1, tokens=12)
    for block, h in zip(blocks, (101, 102, 103)):
        pool.register(block, h)
    assert pool.lookup([101, 102, 103]) == blocks
    assert pool.lookup([101, 102, 999, 103]) == blocks[:2]  # stops at the first miss
    assert pool.lookup([999, 101]) == []
    assert pool.lookup([]) == []
    # A hash already cached, or a block already registered, is not remapped.
    other = pool.grow(2, tokens=4)[0]
    pool.register(other, 101)
    pool.register(blocks[0], 555)
    assert pool.hash_block == {101: blocks[0], 102: blocks[1], 103: blocks[2]}
    assert other not in pool.block_hash
    pool.check_integrity()


def test_freed_block_keeps_its_prefix_until_handed_out_again():
    pool = BlockPool(num_blocks=3, block_size=2)
    a, b = pool.grow(1, tokens=4)
    pool.register(a, 11)
    pool.register(b, 12)
    pool.release(1)
    assert pool.num_free == 3 and pool.lookup([11, 12]) == [a, b]
    pool.share(2, pool.lookup([11, 12]))  # revive: out of the free list, refcount 1
    assert pool.refcount[a] == pool.refcount[b] == 1 and pool.num_free == 1
    pool.release(2)
    # Freed blocks go to the back of the free list (LRU): the untouched block 2 is handed out
    # first, then a (the older of the freed ones), whose prefix is then forgotten.
    assert pool.grow(3, tokens=4) == [2, a]
    assert pool.lookup([11, 12]) == [] and a not in pool.block_hash and 11 not in pool.hash_block
    assert pool.lookup([12]) == [b]
    pool.check_integrity()


# ---------------------------------------------------------------- check_integrity catches corruption

def _healthy() -> BlockPool:
    pool = BlockPool(num_blocks=6, block_size=2)
    pool.grow(1, tokens=4)  # 0, 1
    pool.share(2, [0])
    pool.reserve(3, tokens=2)  # 2
    pool.register(0, 77)
    pool.check_integrity()
    return pool


def _leak(pool):  # a block leaves the free list without an owner
    del pool._free[5]


def _double_owned(pool):  # a second owner names block 1 but its refcount was not raised
    pool.tables[2].append(1)


def _dangling(pool):  # an owner names a block that is also free
    pool.tables[4] = [4]
    pool.refcount[4] = 1


def _named_twice(pool):
    pool.tables[3].append(2)
    pool.refcount[2] += 1


def _refcount_too_high(pool):
    pool.refcount[0] += 1


def _orphan_reservation(pool):
    pool.reserved.add(9)


def _unmirrored_hash(pool):
    pool.hash_block[88] = 1


@pytest.mark.parametrize("corrupt, message", [
    (_leak, r"block 5: free=False with 0 owners"),
    (_double_owned, r"block 1: refcount 1 but 2 owners"),
    (_dangling, r"block 4: free=True with 1 owners"),
    (_named_twice, r"owner 3 names a block twice"),
    (_refcount_too_high, r"block 0: refcount 3 but 2 owners"),
    (_orphan_reservation, r"reservations without blocks: \[9\]"),
    (_unmirrored_hash, r"prefix hash 88 -> block 1 is not mirrored"),
])
def test_check_integrity_catches_planted_corruption(corrupt, message):
    pool = _healthy()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


def test_constructor_rejects_empty_pools():
    with pytest.raises(ValueError, match="positive num_blocks and block_size, got 0, 4"):
        BlockPool(0, 4)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


# ---------------------------------------------------------------- random operations keep integrity

class PoolMachine(RuleBasedStateMachine):
    """Random grow/reserve/promote/share/release/register; a shadow model of who owns what must
    agree with the pool after every step, and `check_integrity` must always pass."""

    @initialize(num_blocks=st.integers(1, 12), block_size=st.integers(1, 4))
    def setup(self, num_blocks, block_size):
        self.pool = BlockPool(num_blocks, block_size)
        self.model: dict[int, list[int]] = {}  # owner -> blocks, as the caller saw them
        self.next_owner = 0
        self.next_hash = 1000

    def _owners(self):
        return sorted(self.model)

    @rule(tokens=st.integers(0, 20), new=st.booleans(), pick=st.integers(0, 100), reserve=st.booleans())
    def grow(self, tokens, new, pick, reserve):
        if new or not self.model:
            owner, self.next_owner = self.next_owner, self.next_owner + 1
        else:
            owner = self._owners()[pick % len(self.model)]
        held = self.model.get(owner, [])
        need = self.pool.blocks_for(tokens) - len(held)
        free = self.pool.num_free
        try:
            added = (self.pool.reserve if reserve else self.pool.grow)(owner, tokens)
        except KVExhausted:
            assert need > free
            assert self.pool.table(owner) == held
            return
        assert len(added) == max(0, need) and not set(added) & set(held)
        self.model[owner] = held + added
        if reserve:
            assert owner in self.pool.reserved

    @precondition(lambda self: self.model)
    @rule(pick=st.integers(0, 100), upto=st.integers(0, 5))
    def share_prefix(self, pick, upto):
        source = self.model[self._owners()[pick % len(self.model)]][:upto]
        owner, self.next_owner = self.next_owner, self.next_owner + 1
        hashes = []
        for block in source:  # register the source's blocks, then find them through the cache
            h = self.pool.block_hash.get(block)
            if h is None:
                h, self.next_hash = self.next_hash, self.next_hash + 1
                self.pool.register(block, h)
            hashes.append(h)
        found = self.pool.lookup(hashes)
        assert found == source
        self.pool.share(owner, found)
        self.model[owner] = list(found)

    @precondition(lambda self: self.pool.block_hash)
    @rule(pick=st.integers(0, 100))
    def revive_freed_prefix(self, pick):
        hashes = sorted(self.pool.hash_block)
        h = hashes[pick % len(hashes)]
        block = self.pool.hash_block[h]
        owner, self.next_owner = self.next_owner, self.next_owner + 1
        before = self.pool.refcount[block]
        self.pool.share(owner, [block])
        assert self.pool.refcount[block] == before + 1
        self.model[owner] = [block]

    @precondition(lambda self: self.model)
    @rule(pick=st.integers(0, 100))
    def release(self, pick):
        owner = self._owners()[pick % len(self.model)]
        self.pool.release(owner)
        del self.model[owner]
        assert owner not in self.pool.reserved

    @precondition(lambda self: self.model)
    @rule(pick=st.integers(0, 100))
    def promote(self, pick):
        owner = self._owners()[pick % len(self.model)]
        self.pool.promote(owner)
        assert owner not in self.pool.reserved

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_integrity()
        assert {o: t for o, t in self.pool.tables.items() if t or o in self.model} == \
            {o: t for o, t in self.model.items() if t or o in self.pool.tables}
        owned = {b for t in self.model.values() for b in t}
        assert self.pool.num_free == self.pool.num_blocks - len(owned)
        for block in range(self.pool.num_blocks):
            assert self.pool.refcount[block] == sum(t.count(block) for t in self.model.values())


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
