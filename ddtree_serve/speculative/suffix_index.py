"""Suffix drafts: continuations of the text's own earlier occurrences (docs/DESIGN.md 4.13).

A request's output often repeats its context (agents re-emit files with small edits, quote tool results,
copy JSON) or what earlier requests produced. Prompt lookup decoding (Saxena, 2023) drafts the tokens that
followed the last earlier occurrence of the text's current suffix; SuffixDecoding (Oliaro et al., arXiv
2411.04975) matches the suffix against the request's own tokens and a shared index of recent outputs and
grows a tree of the continuations, each node scored by how often it followed. This module does the same
with hash tables of n-grams, so that a lookup costs a few dictionary probes, never a scan of the context:

* ``NgramIndex``: for every n in [min_match, max_match], each n-gram of a token stream -> the positions
  that followed it. Appending a token costs ``max_match - min_match + 1`` probes; the current suffix is
  never its own match (an n-gram is indexed once a token has followed it).
* ``SharedIndex``: one ``NgramIndex`` over recent requests' outputs (separated by -1, which no pattern
  holds), capped at ``cache_tokens`` tokens; the oldest outputs are evicted first.
* ``SuffixProposer``: per request (keyed by rid, released with the request), the longest suffix of the
  request's tokens (max_match down to min_match) that occurred before, in its own tokens or the shared
  index; the continuations after its most recent ``max_positions`` occurrences make a trie of at most
  ``min(max_depth, SPEC_FACTOR * n)`` levels for a match of n tokens (a short match predicts little far
  ahead; SuffixDecoding bounds its speculation by the match length the same way). A node's score is
  ``count(node) / occurrences * c ** depth`` with ``c = n / (n + 1)``: the share of occurrences that continued
  that way, discounted per level by the match's length (a long match predicts better). The adaptive budget
  calibrates these scores per match length against verification (``ddtree_serve.speculative.calibration``), separately
  from the DFlash drafter's.
* Matches longer than ``max_match``: the n-gram tables end at ``max_match``, but a request that copies (a
  repeated request whose answer the shared index holds, a file re-emitted) matches far more. When the n-gram
  match is ``max_match`` long, the proposer measures the true length once (walking back from the newest
  ``WALK_OCCURRENCES`` occurrences, at most ``RUN_WALK_CAP`` tokens) and then follows that occurrence (the
  request's *run*) step by step: the tokens a step appended either continue it (the length grows by them) or
  end it. The trie then holds the run's continuation alone, ``min(max_depth, SPEC_FACTOR * n)`` levels deep with
  ``c = n / (n + 1)`` for its true length n, so a long copy drafts as deep as the budget allows. Match lengths of
  ``MATCH_KEY_CAP`` and more share one calibration key. A text that repeats itself (its newest occurrence
  ends just before the text does) continues past its own end with the draft's own tokens.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np

from ddtree_serve.speculative.ddtree import PoppedNodes

SEPARATOR = -1  # between outputs in the shared index; never part of a pattern
SPEC_FACTOR = 2  # a match of n tokens proposes at most SPEC_FACTOR * n levels
INDEX_CHUNK = 4096  # tokens a request's index takes in per step: a long prompt is indexed over several steps
EVIDENCE_DECAY = 0.8  # per verified step with suffix nodes: a request's own acceptance record follows its phases
RUN_WALK_CAP = 256  # tokens a full-length match is extended backwards when a run starts (module docstring)
WALK_OCCURRENCES = 4  # newest occurrences whose true match length is measured when a run starts
MATCH_KEY_CAP = 64  # match lengths at or above this share one calibration key (the budget's suffix calibrator)


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 64  # levels of a suffix draft below the root (at most SPEC_FACTOR x the match length)
    min_match: int = 2  # shortest suffix that may match
    max_match: int = 8  # longest suffix tried (the index holds n-grams of min_match..max_match tokens)
    max_positions: int = 16  # most recent occurrences whose continuations make the trie
    cache_tokens: int = 65536  # shared index of recent outputs: tokens kept (0: no shared index)


class NgramIndex:
    """n-gram -> positions that followed it, over one token stream with absolute positions from ``base``."""

    def __init__(self, min_match: int, max_match: int):
        self.min_match, self.max_match = min_match, max_match
        self.tokens: list[int] = []  # tokens[i] is absolute position base + i
        self.base = 0
        self.table: dict[tuple[int, ...], list[int]] = {}  # n-gram -> ascending absolute positions

    @property
    def end(self) -> int:
        """Absolute position one past the last token."""
        return self.base + len(self.tokens)

    def extend(self, new: list[int]) -> None:
        """Append tokens; index every n-gram that one of them follows."""
        toks, table, lo, hi, base = self.tokens, self.table, self.min_match, self.max_match, self.base
        for t in new:
            j = len(toks)
            for n in range(lo, min(hi, j) + 1):
                key = tuple(toks[j - n:j])
                if SEPARATOR in key:
                    break  # longer n-grams hold it too
                hits = table.get(key)
                if hits is None:
                    table[key] = [base + j]
                else:
                    hits.append(base + j)
            toks.append(t)

    def lookup(self, pattern: tuple[int, ...]) -> list[int]:
        """Positions that followed ``pattern`` (ascending), or an empty list."""
        return self.table.get(pattern, [])

    def token(self, pos: int) -> int:
        """The token at absolute position ``pos`` (SEPARATOR past the end)."""
        i = pos - self.base
        return self.tokens[i] if 0 <= i < len(self.tokens) else SEPARATOR

    def drop_before(self, pos: int) -> None:
        """Forget every token before absolute position ``pos`` and every entry that points before it."""
        cut = pos - self.base
        if cut <= 0:
            return
        dead = self.tokens[:cut]
        for j in range(len(dead)):  # the n-grams whose continuation was one of the dropped tokens
            for n in range(self.min_match, min(self.max_match, j) + 1):
                key = tuple(dead[j - n:j])
                hits = self.table.get(key)
                if hits is not None:
                    del hits[:bisect.bisect_left(hits, pos)]
                    if not hits:
                        del self.table[key]
        # n-grams that started before pos and ended after it: their continuations lie after pos, but the
        # key's tokens are gone; drop those entries too (at most max_match - 1 positions past the cut)
        for j in range(cut, min(cut + self.max_match, len(self.tokens))):
            for n in range(j - cut + 1, min(self.max_match, j) + 1):
                if n < self.min_match:
                    continue
                key = tuple(self.tokens[j - n:j])
                hits = self.table.get(key)
                if hits is not None and self.base + j in hits:
                    hits.remove(self.base + j)
                    if not hits:
                        del self.table[key]
        del self.tokens[:cut]
        self.base = pos


class SharedIndex:
    """Recent requests' outputs, one ``NgramIndex`` over them separated by SEPARATOR, at most ``cache_tokens``
    tokens (oldest outputs evicted first)."""

    def __init__(self, config: SuffixConfig):
        self.index = NgramIndex(config.min_match, config.max_match)
        self.cap = config.cache_tokens
        self.spans: deque[int] = deque()  # end position (exclusive, separator included) of every output kept

    @property
    def num_tokens(self) -> int:
        return len(self.index.tokens)

    @property
    def num_entries(self) -> int:
        return sum(len(v) for v in self.index.table.values())

    def add(self, output: list[int]) -> None:
        """Index a finished request's output (its longest ``cap - 1`` tokens' tail if longer), then evict."""
        if self.cap <= 1 or not output:
            return
        output = output[-(self.cap - 1):]
        self.index.extend(output + [SEPARATOR])
        self.spans.append(self.index.end)
        while self.index.end - self.index.base > self.cap and self.spans:
            self.index.drop_before(self.spans.popleft())


class SuffixProposer:
    """Suffix drafts for running requests (module docstring). Host-side Python, microseconds per request."""

    def __init__(self, config: SuffixConfig):
        self.config = config
        self.shared = SharedIndex(config) if config.cache_tokens > 1 else None
        self.own: dict[str, NgramIndex] = {}  # rid -> the request's index (released with the request)
        self.evidence: dict[str, np.ndarray] = {}  # rid -> its suffix nodes' decayed (reached, offered) score sums
        self.runs: dict[str, _Run] = {}  # rid -> the occurrence its text has been following (module docstring)

    def _sync(self, rid: str, prompt: list[int], output: list[int]) -> NgramIndex:
        """The request's index, extended by at most INDEX_CHUNK of the tokens it has not indexed yet (a 100k-token
        prompt costs a few steps of ~30 ms of host time, not one long stall)."""
        idx = self.own.get(rid)
        if idx is None:
            idx = self.own[rid] = NgramIndex(self.config.min_match, self.config.max_match)
        n, p, room = len(idx.tokens), len(prompt), INDEX_CHUNK
        if n < p:
            take = prompt[n:n + room]
            idx.extend(take)
            n, room = n + len(take), room - len(take)
        if room > 0 and p <= n < p + len(output):
            idx.extend(output[n - p:n - p + room])
        return idx

    def release(self, rid: str, output: list[int] | None = None) -> None:
        """Free a request's index; ``output``: its generated tokens, added to the shared index (a finished
        request; None for an abort or a retraction)."""
        self.own.pop(rid, None)
        self.evidence.pop(rid, None)
        self.runs.pop(rid, None)
        if output and self.shared is not None:
            self.shared.add(output)

    def propose(self, rids: list[str], prompts: list[list[int]], outputs: list[list[int]],
                max_depths: list[int]) -> PoppedNodes:
        """Each request's suffix-draft trie in pop order (descending score; parents first), as ``PoppedNodes``
        whose ``logws`` are log scores; ``max_depths[b]``: deepest level of use to request b."""
        tries = [self._trie(rid, self._sync(rid, p, o), p, o, min(d, self.config.max_depth))
                 for rid, p, o, d in zip(rids, prompts, outputs, max_depths, strict=True)]
        width = max((len(t[0]) for t in tries), default=0)
        bs = len(tries)
        out = PoppedNodes(tokens=np.zeros((bs, width), dtype=np.int64),
                          parents=np.full((bs, width), -1, dtype=np.int64),
                          depths=np.zeros((bs, width), dtype=np.int64),
                          logws=np.full((bs, width), -np.inf), counts=np.zeros(bs, dtype=np.int64),
                          match_lens=np.zeros((bs, width), dtype=np.int64),
                          evidence=np.array([self.evidence.get(rid, (0.0, 0.0)) for rid in rids]).reshape(bs, 2))
        for b, (toks, pars, deps, logw, match) in enumerate(tries):
            n = len(toks)
            out.counts[b] = n
            out.tokens[b, :n], out.parents[b, :n], out.depths[b, :n], out.logws[b, :n] = toks, pars, deps, logw
            out.match_lens[b, :n] = match
        return out

    def observe(self, rids: list[str], reached: np.ndarray, offered: np.ndarray) -> None:
        """A verified step: per request, the reach (expected accepted nodes) and the summed scores of the suffix
        nodes its tree held; the adaptive budget calibrates each request's suffix drafts by its own record
        (``BudgetController.suffix_ratios``): a request that copies accepts them, a chat request seldom does."""
        for rid, hit, q in zip(rids, reached.tolist(), offered.tolist(), strict=True):
            if q > 0:
                ev = self.evidence.setdefault(rid, np.zeros(2))
                ev *= EVIDENCE_DECAY
                ev += (hit, q)

    def _match(self, idx: NgramIndex, tail: list[int]) -> tuple[int, list[tuple[NgramIndex, int]]]:
        """The longest suffix of ``tail`` (the request's last tokens) that occurred before (in ``idx``, the
        request's indexed tokens, or the shared index): its length and its most recent occurrences'
        continuation positions (own first, newest first)."""
        cfg = self.config
        for n in range(min(cfg.max_match, len(tail)), cfg.min_match - 1, -1):
            key = tuple(tail[-n:])
            found = [(idx, p) for p in reversed(idx.lookup(key)[-cfg.max_positions:])]
            if self.shared is not None and len(found) < cfg.max_positions:
                shared = self.shared.index.lookup(key)[-(cfg.max_positions - len(found)):]
                found += [(self.shared.index, p) for p in reversed(shared)]
            if found:
                return n, found
        return 0, []

    def _longest(self, rid: str, n: int, found: list[tuple[NgramIndex, int]], prompt: list[int],
                 output: list[int]) -> tuple[int, list[tuple[NgramIndex, int]]]:
        """The true longest match when the n-gram match is full length (module docstring): the request's run,
        continued by the tokens appended since the last step or measured anew; else ``(n, found)`` unchanged."""
        size = len(prompt) + len(output)
        run = self.runs.pop(rid, None)
        if n < self.config.max_match:
            return n, found  # a longer match would have matched a longer n-gram
        if run is not None and 0 <= size - run.size <= len(output):
            k = size - run.size
            if all(run.src.token(run.next_pos + i) == output[len(output) - k + i] for i in range(k)):
                run = _Run(run.src, run.next_pos + k, run.length + k, size)
                self.runs[rid] = run
                if run.length > n:
                    return run.length, [(run.src, run.next_pos)]
                return n, found  # no longer than the n-gram match: every occurrence counts, as below
        best = max(((src, p, n + _agree_before(src, p - n, prompt, output, n)) for src, p in found[:WALK_OCCURRENCES]),
                   key=lambda x: x[2])
        self.runs[rid] = _Run(best[0], best[1], best[2], size)
        return (best[2], [best[:2]]) if best[2] > n else (n, found)

    def _trie(self, rid: str, idx: NgramIndex, prompt: list[int], output: list[int], depth: int
              ) -> tuple[list[int], list[int], list[int], list[float], int]:
        """Pop-ordered trie of the continuations of the longest match (tokens, parent slots, depths, log
        scores) and the match's length (capped at MATCH_KEY_CAP); empty without a match."""
        n, found = self._match(idx, _tail(prompt, output, self.config.max_match)) if depth > 0 else (0, [])
        if not found:
            self.runs.pop(rid, None)
            return [], [], [], [], 0
        n, found = self._longest(rid, n, found, prompt, output)
        depth = min(depth, SPEC_FACTOR * n)
        nodes: dict[tuple[int, int], int] = {}  # (parent slot, token) -> slot (1-based)
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        counts: list[int] = []
        whole = idx.end == len(prompt) + len(output)  # the request's index holds its whole text
        for src, p in found:
            parent = 0
            path: list[int] = []  # this occurrence's continuation so far
            for d in range(depth):
                t = src.token(p + d)
                if t == SEPARATOR and src is idx and whole and p + d >= idx.end:
                    t = path[d - (idx.end - p)]  # the text copies itself: the copy goes on with its own drafts
                if t == SEPARATOR:
                    break
                path.append(t)
                slot = nodes.get((parent, t))
                if slot is None:
                    tokens.append(t)
                    parents.append(parent)
                    depths.append(d + 1)
                    counts.append(0)
                    slot = nodes[(parent, t)] = len(tokens)
                counts[slot - 1] += 1
                parent = slot
        total = len(found)
        log_c = float(np.log(n / (n + 1.0)))
        logw = [float(np.log(c / total)) + d * log_c for c, d in zip(counts, depths, strict=True)]
        order = sorted(range(len(tokens)), key=lambda i: (-logw[i], depths[i], i))  # parents first
        new_slot = [0] * (len(tokens) + 1)
        for rank, i in enumerate(order):
            new_slot[i + 1] = rank + 1
        return ([tokens[i] for i in order], [new_slot[parents[i]] for i in order], [depths[i] for i in order],
                [logw[i] for i in order], min(n, MATCH_KEY_CAP))


@dataclass(frozen=True)
class _Run:
    """The occurrence a request's text has been following: the text's last ``length`` tokens (of ``size``)
    equal ``src``'s tokens before absolute position ``next_pos``."""
    src: NgramIndex
    next_pos: int
    length: int
    size: int


def _agree_before(src: NgramIndex, pos: int, prompt: list[int], output: list[int], skip: int) -> int:
    """How many tokens before ``src`` position ``pos`` equal the text's tokens before its last ``skip`` (at most
    RUN_WALK_CAP): the extension of a match of ``skip`` tokens backwards."""
    n_out = len(output)
    for j in range(RUN_WALK_CAP):
        back = skip + j + 1  # 1-based offset from the text's end
        if back <= n_out:
            t = output[n_out - back]
        elif back - n_out <= len(prompt):
            t = prompt[len(prompt) - (back - n_out)]
        else:
            return j
        if src.token(pos - 1 - j) != t:
            return j
    return RUN_WALK_CAP


def _tail(prompt: list[int], output: list[int], m: int) -> list[int]:
    """The last ``m`` tokens of prompt + output (without concatenating the whole text)."""
    if len(output) >= m:
        return output[-m:]
    return prompt[max(len(prompt) - (m - len(output)), 0):] + output
