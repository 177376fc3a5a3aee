"""A request's KV slots over its life: admission (a request row plus the longest cached prefix), the
chunks it caches, eviction under pressure, and release (docs/DESIGN.md, "KV ownership and the prefix cache").

Ownership of ``table[row, :num_cached]`` of a request: the first ``tree_len`` slots belong to the radix
cache (``ddtree_serve/model_executor/radix_cache.py``) and are locked through ``req.cache_node``; the rest belong to the
request. Release inserts the request's cached tokens into the tree, which takes the new ones over (the
request's copies of tokens another request cached meanwhile are freed), then unlocks. With the cache
disabled a request owns all of its slots and release frees them. So at any time
``free + tree.total_size + sum(private slots of rows) == num_slots``.

Only committed tokens ever reach the tree: ``num_cached`` counts target KV the scheduler keeps (prefill
chunks, decoded tokens and a speculative step's accepted path), never a step's temporary draft or tree slots.
Every decision is deterministic in the sequence of scheduler operations, so TP ranks stay identical.
"""

from __future__ import annotations

from ddtree_serve.model_executor.kv_slots import KVSlots
from ddtree_serve.model_executor.radix_cache import RadixCache
from ddtree_serve.server.scheduling.request import Req


class ReqKVManager:
    def __init__(self, slots: KVSlots, enable_cache: bool, eviction_policy: str = "lru"):
        self.slots = slots
        self.tree = RadixCache(slots, eviction_policy) if enable_cache else None
        self.hit_tokens = 0  # prompt tokens served from the cache, over admitted requests (cumulative)
        self.query_tokens = 0  # prompt tokens of admitted requests (cumulative)

    @property
    def num_free(self) -> int:
        return self.slots.num_free

    @property
    def available(self) -> int:
        """Slots a caller could get: free ones plus those eviction could free."""
        return self.slots.num_free + (self.tree.evictable_size if self.tree is not None else 0)

    def ensure_free(self, n: int) -> bool:
        """Evict unlocked cached tokens until ``n`` slots are free; False when that is not possible."""
        short = n - self.slots.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        return self.slots.num_free >= n

    def admit(self, req: Req, prefill_len: int) -> bool:
        """Give ``req`` a request row and its longest cached prefix (at most ``prefill_len - 1`` tokens, so the
        forward that completes the prefill runs at least one token). Requests that score their prompt
        (``prompt_logprobs``) match nothing: every prompt token must pass through a forward. False: no row."""
        row = self.slots.alloc_row()
        if row is None:
            return False
        req.req_pool_idx, req.num_cached, req.tree_len = row, 0, 0
        first = not req.output_ids  # a retracted request keeps the count of its first admission
        if self.tree is not None and req.params.prompt_logprobs is None and prefill_len > 1:
            value, node = self.tree.match(req.cache_key(prefill_len - 1))
            m = value.numel()
            if m:
                self.slots.write(row, 0, value)
                self.tree.lock(node)
                req.cache_node, req.num_cached, req.tree_len = node, m, m
        if first:
            req.cached_tokens = min(req.num_cached, len(req.prompt_ids))
        return True

    def count_admission(self, req: Req) -> None:
        """Count an admitted request in the hit-rate statistics (once per request, retractions aside)."""
        if not req.output_ids:
            self.hit_tokens += req.cached_tokens
            self.query_tokens += len(req.prompt_ids)

    def cache_prefix(self, req: Req) -> None:
        """Hand ``req``'s cached tokens (keyed by ``req.cache_key(num_cached)``: image spans by content hash) to
        the tree and lock them for ``req``."""
        if self.tree is None or req.req_pool_idx is None or req.num_cached <= req.tree_len:
            return
        row, n = req.req_pool_idx, req.num_cached
        key = req.cache_key(n)
        mine = self.slots.row_slots(row, n)  # [n]
        had = self.tree.insert(key, mine)
        if had > req.tree_len:  # cached meanwhile by another request: keep the tree's copy, free ours
            self.slots.free(mine[req.tree_len:had])
        value, node = self.tree.match(key)
        assert value.numel() == n
        self.slots.write(row, req.tree_len, value[req.tree_len:])
        self.tree.lock(node)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node, req.tree_len = node, n

    def release(self, req: Req) -> None:
        """Return everything ``req`` holds: its tokens go to the tree (cache on) or back to the free list."""
        if req.req_pool_idx is None:
            return
        if self.tree is None:
            self.slots.release(req.req_pool_idx, req.num_cached)
        else:
            self.cache_prefix(req)
            if req.cache_node is not None:
                self.tree.unlock(req.cache_node)
            self.slots.free_row(req.req_pool_idx)
        req.req_pool_idx, req.num_cached, req.tree_len, req.cache_node = None, 0, 0, None

    @property
    def cached_tokens(self) -> int:
        return self.tree.total_size if self.tree is not None else 0
