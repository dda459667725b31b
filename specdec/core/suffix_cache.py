"""Suffix decoding's data: frequency-counted suffix trees over text already seen.

SuffixDecoding (arXiv 2411.04975; vLLM's `method: "suffix"`) proposes what followed the
current text's longest matching suffix elsewhere: earlier in this request (its prompt and
output) or in earlier responses. A SuffixTree holds every substring of at most max_depth
tokens of the sequences it indexes, each node counting the occurrences of the path to it,
so `count(child) / sum(count(children))` is how often a continuation followed. From the
node of the longest match, `speculate` grows a token tree best first by path probability
(the product of those frequencies along the path): the nodes whose probability is at
least min_token_prob, at most max_spec_factor times the match length, at most max_tokens.
The sum of the chosen nodes' path probabilities is the tree's expected kept tokens had
the target the counted frequencies; the loop calibrates it against what the target keeps
(specdec.core.suffix_proposer).

SuffixCache is the global part: one tree per tenant over the outputs of its recent
requests, bounded by a count of requests and a memory budget, oldest evicted first, so a
tenant's outputs are proposed only to its own later requests.
"""

from __future__ import annotations

import heapq
import math
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from specdec.settings import default

DEFAULT_MAX_DEPTH: int = default("suffix-max-tree-depth")
DEFAULT_MAX_CACHED_REQUESTS: int = default("suffix-max-cached-requests")
DEFAULT_MAX_SPEC_FACTOR: float = default("suffix-max-spec-factor")
DEFAULT_MIN_TOKEN_PROB: float = default("suffix-min-token-prob")
DEFAULT_CACHE_MB: int = default("suffix-cache-mb")


# A node is an int: an index into a tree's flat arrays. The edge from node n by token t is
# the dict key n * _STRIDE + t (token ids are below 2**32), so a tree holds no Python
# object per node: the garbage collector, which visits every tracked container on each
# full collection, never walks it (a dict of ints and arrays of ints are not tracked).
_STRIDE = 1 << 32
ROOT = 0


def _node_bytes() -> int:
    """Memory of one node as CPython lays it out: four 8-byte array slots, its edge's dict
    entry (hash, key and value slots at about two-thirds load) and the key and value ints."""
    return 4 * 8 + (3 * 8 * 3) // 2 + 8 + sys.getsizeof(1 << 40) + sys.getsizeof(1 << 20)


NODE_BYTES = _node_bytes()


@dataclass(frozen=True)
class SuffixDraft:
    """A token tree from a suffix tree, nodes in best-first order (so every prefix of the
    list is a tree, and each node's parent comes before it): tokens[i] follows node
    parents[i] (-1: the committed text), with path probability probs[i]."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    probs: tuple[float, ...]
    match_length: int  # tokens of the committed text's tail that matched

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def score(self) -> float:
        """Expected kept tokens had the target the counted frequencies."""
        return sum(self.probs)

    def depth(self, index: int) -> int:
        depth = 1
        while self.parents[index] >= 0:
            index, depth = self.parents[index], depth + 1
        return depth

    def cut(self, nodes: int) -> SuffixDraft:
        return SuffixDraft(self.tokens[:nodes], self.parents[:nodes], self.probs[:nodes],
                           self.match_length)

    def chain(self) -> SuffixDraft:
        """The draft's first path: from the committed text, each node's first child in
        best-first order (one verification row per token, no siblings)."""
        kept: list[int] = []
        for index, parent in enumerate(self.parents):
            if parent == (kept[-1] if kept else -1):
                kept.append(index)
        return SuffixDraft(tuple(self.tokens[i] for i in kept), tuple(range(-1, len(kept) - 1)),
                           tuple(self.probs[i] for i in kept), self.match_length)


class SuffixTree:
    """Every substring of at most max_depth tokens of the indexed sequences, counted.

    Node ids index flat arrays (count, token, first child, next sibling); ROOT is 0 and
    freed ids are reused."""

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        if max_depth < 2:
            raise ValueError(f"a suffix tree needs max_depth >= 2, got {max_depth}")
        self.max_depth = max_depth
        self._count = array("q", [0])
        self._token = array("q", [-1])
        self._first = array("q", [-1])
        self._next = array("q", [-1])
        self._edges: dict[int, int] = {}
        self._free = array("q")
        self.nodes = 0

    @property
    def bytes(self) -> int:
        return self.nodes * NODE_BYTES

    def count(self, node: int) -> int:
        return self._count[node]

    def child(self, node: int, token: int) -> int | None:
        return self._edges.get(node * _STRIDE + token)

    def children(self, node: int) -> Iterator[tuple[int, int]]:
        """(token, child) of each child of node, the most recently added first."""
        child = self._first[node]
        while child >= 0:
            yield self._token[child], child
            child = self._next[child]

    def _new_child(self, node: int, token: int) -> int:
        if self._free:
            child = self._free.pop()
            self._count[child], self._token[child] = 0, token
            self._first[child], self._next[child] = -1, self._first[node]
        else:
            child = len(self._count)
            self._count.append(0)
            self._token.append(token)
            self._first.append(-1)
            self._next.append(self._first[node])
        self._first[node] = child
        self._edges[node * _STRIDE + token] = child
        self.nodes += 1
        return child

    def append(self, open_paths: list[int], token: int) -> list[int]:
        """Count the substrings that end at a new token. open_paths: the nodes of the
        substrings ending at the previous token, shortest first (those still shorter than
        max_depth); returns the same for the new token. Start a sequence with []."""
        extended: list[int] = []
        for node in [ROOT, *open_paths[: self.max_depth - 1]]:
            child = self._edges.get(node * _STRIDE + token)
            if child is None:
                child = self._new_child(node, token)
            self._count[child] += 1
            extended.append(child)
        return extended

    def add(self, tokens: Sequence[int]) -> None:
        open_paths: list[int] = []
        for token in tokens:
            open_paths = self.append(open_paths, token)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo add(tokens): uncount its substrings and drop the nodes left at zero."""
        for start in range(len(tokens)):
            node = ROOT
            for token in tokens[start:start + self.max_depth]:
                child = self._edges.get(node * _STRIDE + token)
                assert child is not None, "removing a sequence that was not added"
                self._count[child] -= 1
                if self._count[child] == 0:
                    # Its subtree counted only substrings of this occurrence: all zero now
                    # or about to be, so it goes whole.
                    self._unlink(node, child)
                    self._free_subtree(child)
                    break
                node = child

    def _unlink(self, node: int, child: int) -> None:
        del self._edges[node * _STRIDE + self._token[child]]
        if self._first[node] == child:
            self._first[node] = self._next[child]
            return
        sibling = self._first[node]
        while self._next[sibling] != child:
            sibling = self._next[sibling]
        self._next[sibling] = self._next[child]

    def _free_subtree(self, top: int) -> None:
        stack = [top]
        while stack:
            node = stack.pop()
            for token, child in self.children(node):
                del self._edges[node * _STRIDE + token]
                stack.append(child)
            self._free.append(node)
            self.nodes -= 1

    def match(self, context: Sequence[int]) -> list[int]:
        """The nodes of the context's tail suffixes that occur, shortest first: entry
        i - 1 is the node of the last i tokens (a tree is closed under suffixes, so they
        form a prefix of the lengths)."""
        matched: list[int] = []
        tail = list(context[-(self.max_depth - 1):])
        for length in range(1, len(tail) + 1):
            node = ROOT
            for token in tail[-length:]:
                found = self._edges.get(node * _STRIDE + token)
                if found is None:
                    return matched
                node = found
            matched.append(node)
        return matched


def grow(tree: SuffixTree, node: int, match_length: int, room: int, max_tokens: int,
         min_token_prob: float) -> SuffixDraft:
    """The best-first token tree below node: at most max_tokens nodes of path probability
    >= min_token_prob, none deeper than room."""
    heap: list[tuple[float, int, int, int, int]] = []  # (-prob, order, parent, token, node)
    order = 0

    def push_children(parent_node: int, parent: int, prob: float) -> None:
        nonlocal order
        # Oldest first, so that among equally frequent continuations the first seen wins.
        children = list(tree.children(parent_node))[::-1]
        if not children:
            return
        total = sum(tree.count(child) for _, child in children)
        for token, child in children:
            child_prob = prob * tree.count(child) / total
            if child_prob >= min_token_prob:
                heapq.heappush(heap, (-child_prob, order, parent, token, child))
                order += 1

    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    depths: list[int] = []
    push_children(node, -1, 1.0)
    while heap and len(tokens) < max_tokens:
        negative, _, parent, token, child = heapq.heappop(heap)
        depth = 1 if parent < 0 else depths[parent] + 1
        if depth > room:
            continue
        tokens.append(token)
        parents.append(parent)
        probs.append(-negative)
        depths.append(depth)
        push_children(child, len(tokens) - 1, -negative)
    return SuffixDraft(tuple(tokens), tuple(parents), tuple(probs), match_length)


def speculate(tree: SuffixTree, context: Sequence[int], max_tokens: int, depth_limit: int,
              max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR,
              min_token_prob: float = DEFAULT_MIN_TOKEN_PROB) -> SuffixDraft | None:
    """The best-scoring draft over the matched suffixes of context, or None.

    A match of m tokens may propose at most ceil(max_spec_factor * m) tokens, and its
    continuations lie at most max_depth - m deep in the tree, so longer matches are more
    specific and shorter ones see further; each is tried, longest first, until no shorter
    one could score more (a draft scores at most its node count)."""
    matched = tree.match(context)
    best: SuffixDraft | None = None
    for length in range(len(matched), 0, -1):
        budget = min(max_tokens, math.ceil(max_spec_factor * length))
        if budget <= 0 or (best is not None and best.score >= budget):
            break
        room = min(depth_limit, tree.max_depth - length)
        if room <= 0:
            continue
        draft = grow(tree, matched[length - 1], length, room, budget, min_token_prob)
        if draft.tokens and (best is None or draft.score > best.score):
            best = draft
    return best


@dataclass(frozen=True)
class CacheUsage:
    requests: int
    nodes: int
    bytes: int
    tenants: int


class SuffixCache:
    """One suffix tree per tenant over its recent responses; thread-safe.

    At most max_requests responses are held, and at most max_bytes of tree nodes, over
    all tenants; beyond either the oldest response goes first. max_requests = 0 holds
    nothing (the global part is off)."""

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH,
                 max_requests: int = DEFAULT_MAX_CACHED_REQUESTS,
                 max_bytes: int = DEFAULT_CACHE_MB << 20) -> None:
        if max_requests < 0 or max_bytes < 0:
            raise ValueError(f"suffix cache limits must be >= 0, got {max_requests} "
                             f"requests and {max_bytes} bytes")
        self.max_depth = max_depth
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._trees: dict[str, SuffixTree] = {}
        self._responses: OrderedDict[int, tuple[str, tuple[int, ...]]] = OrderedDict()
        self._next_id = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_requests > 0 and self.max_bytes > 0

    def add(self, tenant: str, tokens: Sequence[int]) -> None:
        """Index a finished response of tenant's, evicting the oldest beyond the bounds."""
        if not self.enabled or len(tokens) < 2:
            return
        response = tuple(tokens)
        with self._lock:
            tree = self._trees.get(tenant)
            if tree is None:
                tree = self._trees[tenant] = SuffixTree(self.max_depth)
            tree.add(response)
            self._responses[self._next_id] = (tenant, response)
            self._next_id += 1
            while self._responses and (len(self._responses) > self.max_requests
                                       or self._bytes() > self.max_bytes):
                self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, (tenant, response) = self._responses.popitem(last=False)
        tree = self._trees[tenant]
        tree.remove(response)
        if tree.nodes == 0:
            del self._trees[tenant]

    def _bytes(self) -> int:
        return sum(tree.bytes for tree in self._trees.values())

    def speculate(self, tenant: str, context: Sequence[int], max_tokens: int,
                  depth_limit: int, max_spec_factor: float,
                  min_token_prob: float) -> SuffixDraft | None:
        with self._lock:
            tree = self._trees.get(tenant)
            if tree is None:
                return None
            return speculate(tree, context, max_tokens, depth_limit, max_spec_factor,
                             min_token_prob)

    def usage(self) -> CacheUsage:
        with self._lock:
            nodes = sum(tree.nodes for tree in self._trees.values())
            return CacheUsage(len(self._responses), nodes, nodes * NODE_BYTES,
                              len(self._trees))
