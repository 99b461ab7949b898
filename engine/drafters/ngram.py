"""``ngram``: prompt lookup. No model, q is a point mass on each proposal.

The longest recent suffix (n = max..min) of prompt + generated text that occurred
before proposes what followed it; several distinct earlier continuations become
sibling branches.
"""

from __future__ import annotations

from engine.drafters.base import DraftContext, Drafter, DrafterNeeds, DraftTree
from engine.drafters.spec import Family, Serving, register

__all__ = ["FAMILY", "NgramDrafter"]


class NgramDrafter(Drafter):
    """Prompt lookup over prompt + generated text.

    For n from max_ngram down to min_ngram, take the last n tokens of the context
    and look for earlier occurrences (most recent first, within `window` tokens);
    the first n with any match wins (longest match). Each distinct continuation
    found becomes a branch (up to topk), followed for up to `steps` tokens.
    Continuations stop before any of `stop_ids` (special tokens such as chat
    template markers), which the target would almost never accept as a draft.
    min_ngram defaults to 2: single-token matches ("the", a newline) propose
    continuations the target rarely accepts, and every rejected draft widens the
    verification pass (measured: docs/bench/2026-12-07-notes-from-engine.md).

    A draft is as long as its evidence: after an n-token match it copies at most
    `per_match` * n tokens (0: no limit, up to the pass's K). A 2-token match ("= ",
    "in the") is as often a coincidence as the start of a verbatim copy, and every
    rejected token widens the verification pass; the longer the match, the more
    often it is a verbatim copy. The defaults (matches of up to 6 tokens, per_match =
    2) pay most where wide passes are dear and change nothing where they are cheap
    (docs/bench/2026-12-01-per-match.md). The limit reads the context only, like the
    lookup: the draft is still a function of the past, so verification stays exact.
    """

    name = "ngram"
    needs = DrafterNeeds(point_mass=True)

    def __init__(self, max_ngram: int = 6, min_ngram: int = 2, window: int = 1024, per_match: int = 2, stop_ids=()):
        if not (1 <= min_ngram <= max_ngram <= 16):
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max <= 16, got {min_ngram}..{max_ngram}")
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not 0 <= per_match <= 64:
            raise ValueError(f"per_match must be 0 (no limit) to 64 drafted tokens per matched token, got {per_match}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.window = window
        self.per_match = per_match
        self.stop_ids = frozenset(stop_ids)

    def find_continuations(self, context: list[int], length: int, max_branches: int) -> list[list[int]]:
        """Distinct continuations (each up to `length` tokens) of the longest matching suffix."""
        return self.match(context, length, max_branches)[0]

    def match(self, context: list[int], length: int, max_branches: int) -> tuple[list[list[int]], int]:
        """(find_continuations' branches, the length n of the suffix they continue; 0: no match)."""
        ctx = context[-self.window :]
        total = len(ctx)
        for n in range(min(self.max_ngram, total - 1), self.min_ngram - 1, -1):
            suffix = ctx[total - n :]
            found: list[list[int]] = []
            seen_first: set[int] = set()
            # Most recent occurrence first; the suffix itself (at total - n) is excluded.
            for start in range(total - n - 1, -1, -1):
                if ctx[start : start + n] != suffix:
                    continue
                follow = ctx[start + n : start + n + length]
                for cut, token in enumerate(follow):
                    if token in self.stop_ids:  # never draft template markers or EOS
                        follow = follow[:cut]
                        break
                if not follow or follow[0] in seen_first:
                    continue
                seen_first.add(follow[0])
                found.append(follow)
                if len(found) >= max_branches:
                    break
            if found:
                return found, n
        return [], 0

    def propose(self, context: DraftContext) -> DraftTree:
        shape = context.shape
        branches, n = self.match(context.tokens, shape.k, shape.topk)
        # No confidence to consult: the draft is as deep as the longest continuation found, or
        # as the match vouches for (per_match tokens per matched token), whichever is shorter.
        vouched = self.per_match * n if self.per_match else shape.k
        longest = max((len(branch) for branch in branches), default=0)
        if longest >= shape.k and vouched >= shape.k:
            stop = "depth"
        elif longest > vouched:
            stop = "short-match"
            branches = [branch[:vouched] for branch in branches]
        else:
            stop = "no-match"
        tree = DraftTree(point_mass=True, stop=stop)
        budget = shape.max_tokens
        for branch in branches:
            parent = -1
            for depth, token in enumerate(branch, start=1):
                if len(tree) >= budget:
                    tree.stop = "depth"  # the tree budget is full
                    return tree
                tree.tokens.append(int(token))
                tree.parents.append(parent)
                tree.depths.append(depth)
                tree.q_token.append(1.0)
                parent = len(tree) - 1
        return tree


def _build(spec, registry, history) -> NgramDrafter:
    numbers = list(spec.numbers)
    if len(numbers) == 1:  # ngram:1 means single-token matches only
        numbers.append(min(2, numbers[0]))
    return NgramDrafter(*numbers, stop_ids=registry.stop_ids)


FAMILY = register(
    Family(
        "ngram",
        label="ngram (prompt lookup)",
        help="copies what followed the last few tokens earlier in the prompt or the answer; runs no network",
        form="ngram[:MAX[,MIN[,WINDOW[,PER_MATCH]]]]",
        build=_build,
        kind="copying",
        numbers=4,
        serving=Serving("ngram"),
        order=10,
        about=(
            "**n-gram (prompt lookup)** reads nothing but token ids: it finds the last few tokens of the context "
            "earlier in the prompt or the answer and proposes what followed them there, more of it the longer the "
            "match (two tokens per matched token). No network runs, so a draft token costs next to nothing; it is "
            "right when the answer repeats its input (code edits, quoting, summaries) and has nothing, or the wrong "
            "thing, to propose in open chat."
        ),
    )
)
