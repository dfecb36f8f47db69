"""SnapshotPool and its place in the prefix cache (plain Python, no device): slots are free,
held or registered and always partition the pool; acquire takes a free slot, then evicts
the least recently used registered one that is not pinned; a snapshot is dropped with its
page and never outlives it; ``restore_point`` is the longest matched run that ends at a
snapshot."""

import random

import pytest

from jfp8kv.kvcache.allocator import PageAllocator
from jfp8kv.kvcache.prefix_cache import PrefixCache
from jfp8kv.kvcache.snapshots import SnapshotPool

PS = 4


def test_acquire_register_evict_in_lru_order():
    pool = SnapshotPool(5, 3)
    slots = [pool.acquire() for _ in range(3)]
    assert sorted(slots) == [5, 6, 7] and pool.acquire() is None and pool.num_held == 3
    for i, s in enumerate(slots):
        assert pool.register(bytes([i]), s)
    assert pool.num_registered == 3 and pool.num_held == 0
    pool.use(pool.lookup(bytes([0])))  # key 0 becomes the most recently used
    assert pool.acquire(pinned={slots[1]}) == slots[2]  # slot 1 pinned: 2 is the oldest left
    assert pool.lookup(bytes([2])) is None and pool.evictions == 1
    assert pool.acquire() == slots[1]  # then 1, then 0
    assert pool.register(bytes([0]), slots[1]) is False  # a duplicate state is released
    assert pool.num_free == 1 and pool.stats().saves == 3 and pool.stats().hits == 1
    with pytest.raises(ValueError):
        pool.release(slots[0])  # registered, not held
    pool.drop(bytes([0]))
    assert pool.num_registered == 0 and pool.num_held == 1 and pool.evictions == 3
    pool.release(slots[2])
    assert pool.num_free == 3
    pool.drop(bytes([9]))  # nothing under that key: nothing happens
    assert pool.evictions == 3


def test_demoted_and_used_snapshots():
    pool = SnapshotPool(1, 3)
    for i in range(3):
        pool.register(bytes([i]), pool.acquire())
    assert pool.uses(bytes([1])) == 0
    pool.use(pool.lookup(bytes([1])))
    pool.use(pool.lookup(bytes([1])))
    assert pool.uses(bytes([1])) == 2 and pool.uses(bytes([7])) == 0
    pool.demote(bytes([2]))  # the newest becomes the next to go
    pool.demote(bytes([7]))  # no snapshot there: nothing happens
    assert pool.acquire() == 3 and pool.lookup(bytes([2])) is None
    assert pool.acquire() == 1 and pool.key_of(2) == bytes([1])


def test_snapshot_is_dropped_with_its_page_and_restore_point_is_the_longest():
    alloc = PageAllocator(9)
    pool = SnapshotPool(3, 4)
    cache = PrefixCache(alloc, PS, "ns", pool)
    tokens = list(range(100, 117))  # 4 full pages + 1 token
    pages = alloc.allocate(5)
    keys: list[bytes] = []
    cache.register(tokens, keys, pages, 0, 17)
    for j in (2, 3):  # states after 2 and 3 pages
        assert pool.register(keys[j - 1], pool.acquire())
    hit = cache.match(tokens, [])
    assert hit == pages[:4]
    assert cache.restore_point(keys, len(hit)) == (3, pool.lookup(keys[2]))
    assert cache.restore_point(keys, 2) == (2, pool.lookup(keys[1]))
    assert cache.restore_point(keys, 1) == (0, 0)
    alloc.free(reversed(pages))  # the tail is evicted first
    alloc.allocate(6)  # 4 clean (pages[4] was not cached), then the tail pages[3], pages[2]
    assert pool.lookup(keys[2]) is None and pool.lookup(keys[1]) is not None
    assert cache.restore_point(keys, 3) == (2, pool.lookup(keys[1]))
    cache.reset()
    assert pool.num_registered == 0 and pool.num_free == 4


def test_random_traffic_keeps_the_pool_partitioned():
    """Random acquire / register / release / use / drop against a model of the three sets."""
    rnd = random.Random()
    pool = SnapshotPool(10, 6)
    held: set[int] = set()
    registered: dict[bytes, int] = {}
    order: list[int] = []  # registered slots, least recently used first
    for _ in range(2000):
        op = rnd.choice("aaruld")
        if op == "a":
            pinned = set(rnd.sample(order, min(len(order), rnd.randint(0, 2))))
            slot = pool.acquire(pinned)
            victims = [s for s in order if s not in pinned]
            if len(held) + len(registered) == 6 and not victims:
                assert slot is None
                continue
            if len(held) + len(registered) == 6:
                assert slot == victims[0]
                order.remove(slot)
                registered = {k: v for k, v in registered.items() if v != slot}
            held.add(slot)
        elif op == "r" and held:
            slot = rnd.choice(sorted(held))
            key = bytes([rnd.randrange(8)])
            kept = pool.register(key, slot)
            held.discard(slot)
            assert kept == (key not in registered)
            if kept:
                registered[key] = slot
                order.append(slot)
        elif op == "u" and held:
            slot = rnd.choice(sorted(held))
            pool.release(slot)
            held.discard(slot)
        elif op == "l" and order:
            slot = rnd.choice(order)
            pool.use(slot)
            order.remove(slot)
            order.append(slot)
        elif op == "d":
            key = bytes([rnd.randrange(8)])
            pool.drop(key)
            if key in registered:
                order.remove(registered.pop(key))
        assert {k: pool.lookup(k) for k in registered} == registered
        assert pool.num_held == len(held) and pool.num_registered == len(registered)
        assert pool.num_free + len(held) + len(registered) == 6
