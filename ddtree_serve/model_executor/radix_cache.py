"""Prefix cache: a radix tree over token ids whose edges carry the KV slot ids of their tokens (page size 1).

The design follows SGLang's RadixAttention (Zheng et al., "SGLang: Efficient Execution of Structured Language
Model Programs", arXiv 2312.07104, section 3): a compressed trie keyed by token ids; a request matches its
longest cached prefix at admission and locks that path (reference counts on every node from the match
point up to the root), and its committed tokens are inserted when it finishes. Unlocked leaves are
evicted least recently used first, and their slots go back to the free list.

Invariants (``check`` asserts them):
- every node but the root has a non-empty key and ``len(value) == len(key)``; children are keyed by the
  first token of their edge, so siblings never share a first token;
- the tree holds every slot at most once; ``evictable_size + protected_size`` = slots held;
- ``lock_ref`` of a node = the number of locks taken at it or below it; ``protected_size`` = tokens on
  nodes with ``lock_ref > 0``.

Recency is a logical clock (one tick per match / insert), not wall time, so that every TP rank, which
runs the same sequence of operations, evicts the same nodes.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from ddtree_serve.model_executor.kv_slots import KVSlots

EVICTION_POLICIES = ("lru",)  # least recently used first (ties: older node first)


class RadixNode:
    __slots__ = ("children", "id", "key", "last_access", "lock_ref", "parent", "value")

    def __init__(self, node_id: int, key: list[int], value: torch.Tensor, parent: RadixNode | None):
        self.id = node_id
        self.key = key  # tokens on the edge from the parent
        self.value = value  # [len(key)] int64 KV slots of those tokens
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0


class RadixCache:
    def __init__(self, slots: KVSlots, eviction_policy: str = "lru"):
        """``eviction_policy``: which unlocked leaves go first (``EVICTION_POLICIES``; only "lru" today)."""
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction policy must be one of {', '.join(EVICTION_POLICIES)}; got {eviction_policy!r}")
        self.slots = slots
        self.eviction_policy = eviction_policy
        self._ids = itertools.count()
        self._clock = 0
        self.root = RadixNode(next(self._ids), [], torch.empty(0, dtype=torch.int64, device=slots.device), None)
        self.root.lock_ref = 1  # never evicted
        self.evictable_size = 0
        self.protected_size = 0
        self.evicted_tokens = 0  # cumulative

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---------------------------------------------------------------- match / insert
    def match(self, tokens: list[int]) -> tuple[torch.Tensor, RadixNode]:
        """The slots ``[m]`` of the longest cached prefix of ``tokens`` and the node where it ends (the root
        when nothing matches). An edge matched part-way is split so the returned node ends exactly at ``m``."""
        now = self._tick()
        node, i, parts = self.root, 0, []
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = _common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.value)
            node, i = child, i + n
        value = torch.cat(parts) if parts else self.root.value
        return value, node

    def insert(self, tokens: list[int], value: torch.Tensor) -> int:
        """Insert ``tokens`` with their slots ``value`` ``[len(tokens)]``. Returns how many leading tokens
        were cached already: the tree keeps its own slots for those (the caller still owns ``value[:that]``)
        and takes ``value[that:]`` over."""
        now = self._tick()
        node, i = self.root, 0
        while i < len(tokens):
            node.last_access = now
            child = node.children.get(tokens[i])
            if child is None:
                leaf = RadixNode(next(self._ids), list(tokens[i:]), value[i:].clone(), node)
                leaf.last_access = now
                node.children[tokens[i]] = leaf
                self.evictable_size += len(leaf.key)
                return i
            n = _common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            node, i = child, i + n
        node.last_access = now
        return i

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Split ``child``'s edge after ``n`` tokens; returns the new upper node (same locks as ``child``)."""
        parent = child.parent
        assert parent is not None and 0 < n < len(child.key)
        upper = RadixNode(next(self._ids), child.key[:n], child.value[:n], parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.children[child.key[n]] = child
        parent.children[child.key[0]] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        return upper

    # ---------------------------------------------------------------- locks
    def lock(self, node: RadixNode) -> None:
        """Protect the path root..node from eviction (one reference)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent
        self.root.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("radix cache: unlock without a matching lock")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent
        self.root.lock_ref -= 1

    # ---------------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots (fewer when not enough are evictable) from unlocked leaves,
        least recently used first (ties: older node first). Returns the number freed."""
        heap = [(n.last_access, n.id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            self.slots.free(leaf.value)
            freed += len(leaf.key)
            self.evicted_tokens += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def reset(self) -> None:
        """Drop every unlocked node (slots back to the free list)."""
        self.evict(self.evictable_size)

    # ---------------------------------------------------------------- inspection (tests, metrics)
    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def held_slots(self) -> torch.Tensor:
        """Every slot the tree holds ``[total_size]``."""
        vals = [n.value for n in self._nodes()]
        return torch.cat(vals) if vals else self.root.value

    def check(self) -> None:
        """Assert the invariants in the module docstring (O(size); tests and debugging)."""
        ev = pr = 0
        locks_below: dict[int, int] = {}
        for n in self._nodes():
            assert n.key and len(n.key) == n.value.numel(), "empty edge or key/value length mismatch"
            assert n.parent.children.get(n.key[0]) is n, "child keyed by a token other than its first"
            if n.lock_ref:
                pr += len(n.key)
            else:
                ev += len(n.key)
            assert n.lock_ref >= 0
            for c in n.children.values():
                locks_below[n.id] = max(locks_below.get(n.id, 0), c.lock_ref)
        for n in self._nodes():
            assert n.lock_ref >= locks_below.get(n.id, 0), "a node is locked less than its descendants"
        assert (ev, pr) == (self.evictable_size, self.protected_size), "size accounting drifted"
        held = self.held_slots()
        assert held.unique().numel() == held.numel(), "a slot is held twice"
        assert not bool((held <= 0).any()), "the padding slot is held"


def _common_len(key: list[int], tokens: list[int], start: int) -> int:
    n = min(len(key), len(tokens) - start)
    if key[:n] == tokens[start:start + n]:  # the common case, compared at C speed
        return n
    i = 0
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i
