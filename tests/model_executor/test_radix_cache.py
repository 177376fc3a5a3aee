"""The radix prefix cache on its own: match / insert / split / lock / evict and slot accounting."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree_serve.model_executor.kv_slots import KVSlots
from ddtree_serve.model_executor.radix_cache import RadixCache


def _setup(n: int = 64) -> tuple[KVSlots, RadixCache]:
    slots = KVSlots(n, 4, 32)
    return slots, RadixCache(slots)


def _accounted(slots: KVSlots, cache: RadixCache, private: int = 0) -> None:
    cache.check()
    assert slots.num_free + cache.total_size + private == slots.num_slots


def test_insert_match_split():
    slots, cache = _setup()
    a = slots.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], a) == 0
    v, node = cache.match([1, 2, 3, 9])  # splits the edge after 3 tokens
    assert v.tolist() == a[:3].tolist() and node.key == [1, 2, 3]
    assert len(cache.root.children[1].children) == 1
    b = slots.alloc(4)
    assert cache.insert([1, 2, 7, 8], b) == 2  # the first two tokens were cached: the caller keeps b[:2]
    slots.free(b[:2])
    v, _ = cache.match([1, 2, 7, 8, 9])
    assert v.tolist() == a[:2].tolist() + b[2:].tolist()
    v, _ = cache.match([1, 2, 3, 4, 5, 6])
    assert v.tolist() == a.tolist()
    assert cache.match([5])[0].numel() == 0
    assert cache.total_size == 7
    _accounted(slots, cache)


def test_lock_protects_and_evict_is_lru():
    slots, cache = _setup()
    for key in ([1, 2, 3], [1, 2, 4], [5, 6]):
        val = slots.alloc(len(key))
        slots.free(val[:cache.insert(key, val)])  # the already cached part stays the caller's
    _, n124 = cache.match([1, 2, 4])
    cache.lock(n124)
    assert cache.protected_size == 3 and cache.evictable_size == 3  # [1,2] and [4] locked; [3], [5,6] not
    cache.match([1, 2, 3])  # [1,2,3] used more recently than [5,6]
    assert cache.evict(1) == 2  # the least recently used leaf, [5,6], goes first
    assert cache.match([5, 6])[0].numel() == 0
    assert cache.evict(100) == 1  # only [3] left to evict: the locked path stays
    assert cache.match([1, 2, 4])[0].numel() == 3
    _accounted(slots, cache)
    cache.unlock(n124)
    assert cache.evictable_size == 3 and cache.protected_size == 0
    assert cache.evict(100) == 3 and cache.total_size == 0
    _accounted(slots, cache)
    with pytest.raises(RuntimeError, match="unlock"):
        cache.unlock(n124)


def test_split_keeps_locks_of_the_locked_path():
    slots, cache = _setup()
    cache.insert([1, 2, 3, 4], slots.alloc(4))
    _, node = cache.match([1, 2, 3, 4])
    cache.lock(node)
    _, mid = cache.match([1, 2, 9])  # splits the locked edge
    assert mid.lock_ref == 1 and cache.protected_size == 4
    cache.check()
    assert cache.evict(10) == 0
    cache.unlock(node)
    cache.check()
    assert cache.evict(10) == 4


def test_random_workload_accounting():
    """Random inserts (with the duplicate-prefix hand-back), locks, unlocks and evictions over a small alphabet
    keep the tree consistent and account for every slot."""
    rng = random.Random(0)
    slots, cache = _setup(400)
    locked = []
    for _ in range(300):
        op = rng.random()
        if op < 0.5:
            key = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
            if slots.num_free < len(key):
                cache.evict(len(key))
            if slots.num_free < len(key):
                continue
            val = slots.alloc(len(key))
            have = cache.insert(key, val)
            slots.free(val[:have])
            got, _ = cache.match(key)
            assert got[have:].tolist() == val[have:].tolist()
        elif op < 0.7:
            key = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
            _, node = cache.match(key)
            cache.lock(node)
            locked.append(node)
        elif op < 0.85 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randrange(1, 6))
        _accounted(slots, cache)
    for node in locked:
        cache.unlock(node)
    cache.reset()
    assert cache.total_size == 0 and slots.num_free == slots.num_slots


def test_held_slots_are_the_inserted_ones():
    slots, cache = _setup()
    a = slots.alloc(6)
    cache.insert([4, 4, 4, 5, 5, 5], a)
    assert sorted(cache.held_slots().tolist()) == sorted(a.tolist())
    assert torch.equal(cache.match([4, 4, 4, 5, 5, 5, 6])[0], a)
