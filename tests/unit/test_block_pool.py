import pytest

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import KVCacheManager


def test_allocate_release_round_trip():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5 and pool.num_free_blocks == 3
    pool.check_invariants()
    pool.release(blocks)
    assert pool.num_free_blocks == 8
    pool.check_invariants()


def test_shared_block_is_freed_by_its_last_holder():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.share(blocks[:1])
    pool.release(blocks)
    assert pool.num_free_blocks == 3 and pool.ref_counts[blocks[0]] == 1
    pool.release(blocks[:1])
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_over_allocation_and_double_free_are_refused():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    blocks = pool.allocate(1)
    pool.release(blocks)
    with pytest.raises(AssertionError):
        pool.release(blocks)


def test_kv_manager_grows_tables_block_by_block():
    kv = KVCacheManager(num_blocks=4, block_size=4, watermark=0)
    assert kv.allocate_slots("a", 5)
    assert len(kv.block_tables("a")[0]) == 2
    assert kv.allocate_slots("a", 8) and len(kv.block_tables("a")[0]) == 2
    assert kv.allocate_slots("a", 9) and len(kv.block_tables("a")[0]) == 3
    assert not kv.allocate_slots("b", 8), "only one block is left"
    assert kv.block_tables("b")[0] == [], "a failed allocation changes nothing"
    kv.free("a")
    assert kv.pool.num_free_blocks == 4


def test_fork_shares_only_whole_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4, watermark=0)
    kv.allocate_slots("p", 10)  # 3 blocks, the last one partly filled
    shared_tokens = kv.fork("p", "c", 9)
    assert shared_tokens == 8
    assert kv.block_tables("c")[0] == kv.block_tables("p")[0][:2]
    assert [kv.pool.ref_counts[b] for b in kv.block_tables("p")[0]] == [2, 2, 1]
    kv.free("p")
    kv.free("c")
    assert kv.pool.num_free_blocks == 8
    kv.pool.check_invariants()
