"""``suffix``: suffix decoding. Drafts by matching the end of the text against the prompt, the answer so far
and the session's earlier answers, and proposes the continuations that followed, as a tree scored by how
often each one followed.

The idea is Arctic Inference's suffix decoding (vLLM's ``suffix`` speculative method): agents and chat
sessions repeat themselves across requests (the same code, the same phrasing, the same JSON), which prompt
lookup alone cannot see because it reads only the current request. Like n-gram drafting it needs no model,
and its drafts are a function of the past alone, point masses (q = 1 on each proposed token): verification
is the same exact rule, so the output is still exactly the target's.

What it does, per pass:

1. **Match.** The longest suffix of the context (up to ``max_match`` tokens, at least ``min_match``) that
   also occurs in a document: an earlier answer of the session (``remember``), or the context itself
   before its end. Every occurrence with that longest length counts.
2. **Count.** The continuations of those occurrences (up to the pass's K tokens, stopping before control
   tokens) go into a trie with counts: a continuation that followed 3 of 4 occurrences has frequency 0.75.
3. **Grow the tree.** Nodes are added best first by cumulative frequency (the product along the path),
   at most ``topk`` children per node and the tree budget in all, while that frequency stays at or above
   ``min_frequency``, and no deeper than ``spec_factor`` × the match length (a 2-token match is as often
   a coincidence as the start of a copy; a long one vouches for a long draft).

Documents are indexed once by their last ``min_match`` tokens; the context's index grows with it, so a pass
costs time in the number of occurrences, not in the length of the session.
"""

from __future__ import annotations

import heapq
import math

from engine.drafters.base import DraftContext, Drafter, DrafterNeeds, DraftTree
from engine.drafters.spec import Family, Serving, register

__all__ = ["FAMILY", "SuffixDrafter"]


class _Trie:
    """Continuations with counts: children[token] -> (_Trie, count)."""

    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Trie] = {}
        self.count = 0

    def add(self, tokens: list[int]) -> None:
        node = self
        node.count += 1
        for token in tokens:
            node = node.children.setdefault(token, _Trie())
            node.count += 1


class SuffixDrafter(Drafter):
    """Suffix decoding over the context and the session's earlier answers (point-mass drafts)."""

    name = "suffix"
    needs = DrafterNeeds(point_mass=True)

    def __init__(
        self,
        max_match: int = 32,
        min_match: int = 2,
        spec_factor: float = 2.0,
        min_frequency: float = 0.1,
        stop_ids=(),
    ):
        if not 1 <= min_match <= max_match <= 256:
            raise ValueError(f"suffix match lengths must satisfy 1 <= min <= max <= 256, got {min_match}..{max_match}")
        if not 0 < spec_factor <= 64:
            raise ValueError(f"spec_factor must be in (0, 64], got {spec_factor}")
        if not 0 <= min_frequency <= 1:
            raise ValueError(f"min_frequency must be in [0, 1], got {min_frequency}")
        self.max_match, self.min_match = max_match, min_match
        self.spec_factor, self.min_frequency = spec_factor, min_frequency
        self.stop_ids = frozenset(stop_ids)
        self.docs: list[list[int]] = []  # earlier answers; the context is matched apart
        self._doc_index: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # key -> [(doc, end)]
        self._ctx_index: dict[tuple[int, ...], list[int]] = {}  # key -> [end] in the context
        self._ctx_indexed = 0  # context positions indexed so far (ends < this)

    # ------------------------------------------------------------------ documents
    def remember(self, docs: list[list[int]]) -> None:
        """Earlier answers this run may draft from (token ids, the newest last)."""
        for doc in docs:
            number = len(self.docs)
            self.docs.append([int(t) for t in doc])
            for end in range(self.min_match, len(doc) + 1):
                self._doc_index.setdefault(tuple(doc[end - self.min_match : end]), []).append((number, end))

    def _forget_context(self) -> None:
        self._ctx_index, self._ctx_indexed = {}, 0

    def start(self, prompt_ids, capacity, runner=None, features=None, target_cache=None) -> None:
        self._forget_context()

    def rewind(self, length: int) -> None:
        self._forget_context()

    def _index_context(self, context: list[int]) -> None:
        """Index every end position of the context but its last (the suffix being matched)."""
        n = self.min_match
        if len(context) < self._ctx_indexed:  # a shorter context: a new sequence
            self._forget_context()
        for end in range(max(n, self._ctx_indexed), len(context)):
            self._ctx_index.setdefault(tuple(context[end - n : end]), []).append(end)
        self._ctx_indexed = max(self._ctx_indexed, len(context))

    # -------------------------------------------------------------------- matching
    def _match_length(self, doc: list[int], end: int, context: list[int]) -> int:
        """How many tokens before `end` in `doc` equal the context's last ones (at most max_match)."""
        limit = min(self.max_match, end, len(context))
        length = 0
        while length < limit and doc[end - 1 - length] == context[-1 - length]:
            length += 1
        return length

    def occurrences(self, context: list[int]) -> tuple[list[tuple[list[int], int]], int]:
        """([(document, end) of every occurrence of the longest matching suffix], its length; 0: none)."""
        if len(context) < self.min_match:
            return [], 0
        self._index_context(context)
        key = tuple(context[-self.min_match :])
        found = [(self.docs[d], end) for d, end in self._doc_index.get(key, ())]
        found += [(context, end) for end in self._ctx_index.get(key, ()) if end < len(context)]
        best, matched = 0, []
        for doc, end in found:
            length = self._match_length(doc, end, context)
            if length > best:
                best, matched = length, [(doc, end)]
            elif length == best:
                matched.append((doc, end))
        return (matched, best) if best >= self.min_match else ([], 0)

    def propose(self, context: DraftContext) -> DraftTree:
        shape = context.shape
        matched, length = self.occurrences(context.tokens)
        depth_limit = min(shape.k, max(1, math.floor(self.spec_factor * length))) if length else 0
        trie = _Trie()
        longest = 0
        for doc, end in matched:
            follow = doc[end : end + shape.k]
            for cut, token in enumerate(follow):
                if token in self.stop_ids:  # never draft template markers or EOS
                    follow = follow[:cut]
                    break
            if follow:
                trie.add(follow[:depth_limit])
                longest = max(longest, len(follow))
        tree = DraftTree(point_mass=True, stop="no-match")
        if not trie.children:
            return tree
        tree.stop = "short-match" if longest > depth_limit else "depth"
        # Best first by cumulative frequency; ties by order of discovery (deterministic).
        heap: list[tuple[float, int, _Trie, int, int, int]] = []
        order = 0

        def push(node: _Trie, parent: int, depth: int, prob: float) -> None:
            """Queue node's `topk` most frequent children, each with its path's cumulative frequency."""
            nonlocal order
            ranked = sorted(node.children.items(), key=lambda item: -item[1].count)[: shape.topk]
            for token, child in ranked:
                heapq.heappush(heap, (-prob * child.count / node.count, order, child, token, parent, depth))
                order += 1

        push(trie, -1, 1, 1.0)
        while heap and len(tree) < shape.max_tokens:
            neg, _, node, token, parent, depth = heapq.heappop(heap)
            if -neg < self.min_frequency:
                tree.stop = "confidence"  # the best remaining path followed too rarely
                break
            tree.tokens.append(int(token))
            tree.parents.append(parent)
            tree.depths.append(depth)
            tree.q_token.append(1.0)
            if depth < depth_limit:
                push(node, len(tree) - 1, depth + 1, -neg)
        return tree


def _build(spec, registry, history) -> SuffixDrafter:
    drafter = SuffixDrafter(*spec.numbers, stop_ids=registry.stop_ids)
    drafter.remember(history)
    return drafter


FAMILY = register(
    Family(
        "suffix",
        label="suffix (suffix decoding: the prompt and this session's earlier answers)",
        help="copies from the prompt and the session's earlier answers, a tree ranked by how often each followed",
        form="suffix[:MAX[,MIN]]",
        build=_build,
        kind="copying",
        numbers=2,
        serving=Serving(
            "suffix",
            note="vLLM's suffix method needs the arctic-inference package (pip install arctic-inference); it caches "
            "earlier outputs across all requests of the server, where SpecLens keeps one session's answers",
        ),
        unserved="suffix decoding is vLLM's (method suffix, with arctic-inference); this engine has no such method",
        order=20,
        about=(
            "**suffix decoding** is n-gram's lookup with a memory: it also searches the session's earlier answers "
            "(here: none, one prompt) and ranks what followed every occurrence of the longest match by how often it "
            "followed, as a tree. Like n-gram it runs no network, so c is next to nothing; it pays when answers "
            "repeat each other."
        ),
    )
)
