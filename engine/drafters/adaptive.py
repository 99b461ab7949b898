"""Drafting that adapts: how deep each pass drafts, from measured costs, recent acceptance and the drafter's confidence.

Three decisions, all made before the target pass that verifies the draft:

* **K per pass** (``AdaptiveDepth``), chosen for speed. The engine measures once per loaded model what a target
  pass of w tokens costs here (``pass_ms``: not linear; on a CPU a pass is memory bound up to a few tokens, then
  compute bound); the run measures its drafter's cost by depth and its acceptance rate alpha (each drafted token's
  chance of surviving given its parent did, recency-weighted by ``RECENCY`` per pass, so a code edit's copy phases
  and its novel lines each get their own K). Then K = argmax over k of (1 + alpha + ... + alpha^k) /
  (draft_ms(k) + pass_cost(width(k))): expected tokens per pass over the time a step of depth k takes. pass_cost(w)
  is what the run's own verifications of w-token passes took, and for a width it has not run the calibrated
  pass_ms[w] plus the step's overhead, bounded by the widths around it (``AdaptiveDepth.pass_cost``), so that one
  slow moment in the calibration does not steer every run. draft_ms(k) = first + (k - 1) * deeper (a model
  drafter's first level also feeds it the last pass's committed tokens), fitted by recency-weighted least squares
  over the depths drafted; with one depth only, proportional to k. Without pass costs (a policy built by hand) K
  follows transformers' "heuristic" schedule: K += 2 after a fully accepted pass, K -= 1 after a rejection. K
  stays in [1, settings.k] while it drafts, so the pass width and cache sizes fixed at the start still bound it.
  Where no depth is expected to beat a plain pass, K = 0: the drafter is not asked (``Drafter.skipped``; a model
  drafter catches up at its next draft, EAGLE keeps the plain passes' features). After PROBE_EVERY plain passes in
  a row the run drafts again, a probe with its timing record started afresh (``AdaptiveDepth._probe``), so that a
  text that starts to copy, or a machine that frees up, is noticed.
* **Depth within a pass** (``TreeShape.min_confidence``, applied in ``ModelDrafter.propose``): a model drafter
  stops expanding when the best node it would expand next has a cumulative confidence (the product along its
  path) below the threshold, EAGLE-2's and llama.cpp's ``--draft-p-min`` rule: that product is the path's chance
  of surviving verification. An n-gram draft (a point mass) stops where its lookup finds no longer continuation.
* **Calibrated confidence** (``AdaptiveDepth.calibration``): a token's confidence is the acceptance rate measured
  in this run for drafts of similar q (per tenth of q), pulled towards the run's overall acceptance where a tenth
  has few (a prior worth CALIBRATION_PRIOR drafts), and that towards 1 before anything is verified. q alone
  misjudges some drafters: under greedy verification the int8 self-drafter's argmax is usually the target's even
  where its q is low. Figures behind these choices: docs/bench/2026-12-07-notes-from-engine.md.

Why the output is still exactly the target's distribution: a plain pass is the baseline's step. Every decision
reads only the drafter's side (its q of tokens already drafted), outcomes of passes already verified and timings;
none looks at the target's p for the draft being built. Each sibling list is still a complete draw from q (the
confidence stop decides whether a whole level gets children, never which siblings survive), and every drafted
token is verified by the one rule of ``engine.acceptance``, which emits each token with probability
p(token | prefix) whatever the tree is. So the chosen depth changes how many tokens a pass yields, not which
tokens are likely; greedy decoding emits the target's argmax path for any tree: the output ids are identical.
"""

from __future__ import annotations

import dataclasses
import math

from engine.drafters.base import DraftTree, TreeShape

__all__ = ["AdaptiveDepth", "GROW", "SHRINK", "STOP_REASONS", "check_min_confidence", "verified_outcomes"]

GROW = 2  # K += GROW after a pass that accepted everything drafted (transformers' heuristic)
SHRINK = 1  # K -= SHRINK after any other pass that drafted something
# The cost-aware K: earlier passes' evidence is weighted by RECENCY per pass (0.9: the last ~10 passes count);
# lower values let one rejection pull a drafter whose depths are close in expected speed down for a few passes.
RECENCY = 0.9  # chosen by measurement: docs/bench/2026-12-07-notes-from-engine.md
# A timing record (a drafted depth's draft ms, a pass width's verify ms) weighs RECENCY less each pass; one not
# renewed for STALE_AFTER passes is forgotten: a slow moment of the machine early in a run (whose depth or width the
# run then avoided, and so never measured again) does not price that depth or width for the rest of the run.
STALE_AFTER = 24
# A cost-aware run whose drafts are expected to cost more than they save makes plain passes (K = 0: nothing
# drafted, the target's one-token pass), and after PROBE_EVERY of them in a row drafts again, its timing record
# started afresh, so that acceptance and drafting costs are measured again (a text that starts copying its
# prompt, a machine that frees up: AdaptiveDepth._probe).
PROBE_EVERY = 8
ALPHA_MAX = 0.999  # a run that never failed still has a finite expected depth
CALIBRATION_BINS = 10  # acceptance is measured per tenth of q
CALIBRATION_PRIOR = 2.0  # the run's overall acceptance counts as this many drafts in each tenth of q
# Why a pass stopped drafting where it did (the step event's draft.stop):
#   depth      it drafted the pass's K levels (or filled the tree budget)
#   confidence a model drafter's best path fell below the confidence threshold (adaptive only)
#   no-match   an n-gram lookup found no (longer) continuation
#   short-match an n-gram draft ended where its match stopped vouching for it (NgramDrafter.per_match)
#   none       nothing was drafted by design (the baseline; an EAGLE head before any target feature)
STOP_REASONS = ("depth", "confidence", "no-match", "short-match", "none")


def check_min_confidence(value) -> float:
    """The confidence threshold as a float in [0, 1], or ValueError saying what is wrong."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"adaptive_min_confidence must be a number between 0 and 1, got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"adaptive_min_confidence must be between 0 and 1 (a cumulative probability), got {value}")
    return float(value)


class AdaptiveDepth:
    """The current K of one run, in [1, k_max], or 0 for a plain pass: with measured pass costs the depth
    with the most expected tokens per ms, 0 where a plain pass beats them all (and a probe after PROBE_EVERY
    of them; module docstring), else grown and shrunk by the heuristic schedule, never below 1.

    >>> policy = AdaptiveDepth(k_max=6, min_confidence=0.3)
    >>> policy.shape_for_step(TreeShape(6)).k          # starts at the maximum
    6
    >>> policy.update(accepted_len=2, drafted_depth=6)  # a rejection: K - 1
    >>> policy.k
    5
    """

    def __init__(
        self,
        k_max: int,
        min_confidence: float = 0.0,
        k_start: int | None = None,
        pass_ms=None,
        branching: int = 1,
        budget: int | None = None,
        level_nodes: int | None = None,
    ):
        """pass_ms: measured ms of a target pass of w tokens at index w - 1 (w = 1 .. at least the
        widest pass of this shape), or None for the heuristic schedule. branching, budget: the
        shape's topk and draft-token budget; level_nodes: the nodes each level past the first adds
        (topk for n-gram branches, topk^2 for a model drafter's EAGLE-2 expansion; default topk):
        together, the pass width a depth implies."""
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"k_max must be a positive integer, got {k_max!r}")
        self.k_max = k_max
        self.min_confidence = check_min_confidence(min_confidence)
        self.k = self._bounded(k_max if k_start is None else k_start)
        self.tried = [0] * CALIBRATION_BINS  # verified drafts per tenth of q
        self.accepted = [0] * CALIBRATION_BINS  # of those, accepted
        self.branching = max(1, int(branching))
        self.level_nodes = self.branching if level_nodes is None else max(1, int(level_nodes))
        self.budget = budget if budget is not None else self.branching + (k_max - 1) * self.level_nodes
        self.pass_ms = None
        if pass_ms is not None:
            costs = [float(c) for c in pass_ms]
            if len(costs) < self._width(k_max) or not all(math.isfinite(c) and c > 0 for c in costs):
                raise ValueError(f"pass_ms needs a positive time for every width up to {self._width(k_max)}")
            # A wider pass never costs less: a dip is measurement noise.
            self.pass_ms = [max(costs[: i + 1]) for i in range(len(costs))]
        # Recency-weighted evidence (prior: one token tested and accepted, so a run starts deep):
        self.alpha_accepted, self.alpha_tested = 1.0, 1.0
        # Per drafted depth d: [recency weight, recency-weighted mean draft ms, the pass it was last renewed at]
        # (draft_ms(k) fits them)
        self.draft_by_depth: dict[int, list[float]] = {}
        self.passes = 0  # passes the cost-aware policy has seen (the timing records' clock)
        self._draft_line = (0.0, 0.0)  # (first, deeper) ms, refitted after each timed draft
        # What the run's own verifications cost (``pass_cost``): per pass width w, [recency weight, recency-weighted
        # mean verify_ms, last renewed] of the passes of that width it ran (a plain pass is width 1), and, for the
        # widths it did not run, the recency-weighted ms a step spent beyond the calibrated pass (verification,
        # cache bookkeeping, events; never below 0).
        self.verify_by_width: dict[int, list[float]] = {}
        self.step_overhead_ms = 0.0
        self.overheads_seen = 0
        self.plain_in_a_row = 0
        # Whether the next drafting pass's draft_ms is a level's cost: not the run's first draft, nor a probe's (both
        # also catch a model drafter up: on the prompt, on the plain passes' tokens).
        self._timed_draft = False
        self._because = "the run starts at its maximum K"  # why self.k is what it is (``why``)
        self._speeds: list[float] | None = None  # expected tokens per ms of K = 1..k_max at the last update

    def _width(self, k: int) -> int:
        """Tokens in the target pass of a depth-k draft: the pending token plus the drafted nodes."""
        return 1 + min(self.budget, self.branching + (k - 1) * self.level_nodes)

    @property
    def alpha(self) -> float:
        """The run's recent acceptance rate per drafted token (given its parent was accepted)."""
        return min(ALPHA_MAX, self.alpha_accepted / self.alpha_tested)

    def draft_ms(self, k: int) -> float:
        """What drafting k levels costs: first + (k - 1) * deeper (``_fit_draft_costs``)."""
        first, deeper = self._draft_line
        return first + (k - 1) * deeper

    def _fit_draft_costs(self) -> tuple[float, float]:
        """(first, deeper): the line through the mean draft time of each depth drafted (least
        squares, weighted by recency); proportional to k while a single depth was seen (first =
        deeper = the per-level mean); (0, 0) before any draft was timed. Fitted once per update,
        read for every candidate k."""
        seen = self.draft_by_depth
        total = sum(w for w, *_ in seen.values())
        if total <= 0:
            return 0.0, 0.0
        x_mean = sum(w * (d - 1) for d, (w, *_) in seen.items()) / total
        y_mean = sum(w * m for w, m, _ in seen.values()) / total
        sxx = sum(w * (d - 1 - x_mean) ** 2 for d, (w, *_) in seen.items())
        if sxx <= 1e-9 * total:  # one depth: no slope to fit
            per_level = y_mean / (x_mean + 1)
            return per_level, per_level
        deeper = max(0.0, sum(w * (d - 1 - x_mean) * (m - y_mean) for d, (w, m, _) in seen.items()) / sxx)
        return max(0.0, y_mean - deeper * x_mean), deeper

    def expected_speed(self, k: int) -> float:
        """Expected tokens per ms of a pass of depth k: (1 + alpha + ... + alpha^k) over the
        drafting and the target pass it costs (needs pass_ms)."""
        a = self.alpha
        tokens = sum(a**i for i in range(k + 1))
        return tokens / (self.draft_ms(k) + self.pass_cost(self._width(k)))

    def plain_speed(self) -> float:
        """Expected tokens per ms of a plain pass (K = 0): one token over what a one-token pass and its
        verification cost (``pass_cost(1)``; needs pass_ms)."""
        return 1.0 / self.pass_cost(1)

    def pass_cost(self, width: int) -> float:
        """What a step's target pass of `width` tokens and its verification cost, in ms: the run's own mean for a
        width it ran, else the calibrated pass_ms of the width plus the step's overhead (step_overhead_ms), never
        above the run's own mean at a wider width nor below it at a narrower one.

        Why the run's own record: the calibration is one measurement per loaded model on a shared machine, and one
        slow moment in it would price a width far above what the run's passes take and hold the policy to shallow
        drafts (docs/bench/2026-12-07-notes-from-engine.md). A width the run ran is priced by what it cost there. A
        width it did not run keeps its calibrated price, bounded by the widths around it: a calibration that
        overstated one width says nothing about the others (shifting every width by the difference seen at one
        would make a one-token pass look cheaper than it is, and the run make plain passes)."""
        seen = self.verify_by_width
        if width in seen:
            return seen[width][1]
        cost = self.pass_ms[width - 1] + self.step_overhead_ms
        wider = [mean for w, (_, mean, _) in seen.items() if w > width]
        narrower = [mean for w, (_, mean, _) in seen.items() if w < width]
        if wider:
            cost = min(cost, min(wider))
        if narrower:
            cost = max(cost, max(narrower))
        return cost

    def _age_records(self) -> None:
        """A pass went by: every timing record weighs RECENCY less, and one not renewed for STALE_AFTER passes is
        forgotten (the draft line refitted without it; weights scaled alike leave the fit as it was)."""
        self.passes += 1
        stale = [d for d, (_, _, renewed) in self.draft_by_depth.items() if self.passes - renewed > STALE_AFTER]
        for record in (self.draft_by_depth, self.verify_by_width):
            for key in list(record):
                record[key][0] *= RECENCY
                if self.passes - record[key][2] > STALE_AFTER:
                    del record[key]
        if stale:
            self._draft_line = self._fit_draft_costs()

    def _renew(self, record: dict, key: int, ms: float) -> None:
        """Add a timing to a record: [recency weight, recency-weighted mean ms, the pass it was last renewed at]."""
        weight, mean, _ = record.get(key, (0.0, 0.0, 0))
        record[key] = [weight + 1.0, (weight * mean + ms) / (weight + 1.0), self.passes]

    def _seen_pass(self, width: int, verify_ms: float) -> None:
        """Record what a verification of a `width`-token pass took."""
        self._renew(self.verify_by_width, width, float(verify_ms))

    @property
    def drafts(self) -> bool:
        """Whether the next pass drafts (K >= 1); K = 0 is a plain pass, chosen by the cost-aware policy only."""
        return self.k > 0

    @property
    def calibration(self) -> tuple[float, ...]:
        """Per tenth of q: (accepted + prior * overall) / (tried + prior), the measured acceptance
        rate pulled towards the run's overall rate (itself starting from one accepted draft: 1.0)
        where few drafts of that q were seen."""
        overall = (sum(self.accepted) + 1.0) / (sum(self.tried) + 1.0)
        return tuple(
            (self.accepted[b] + CALIBRATION_PRIOR * overall) / (self.tried[b] + CALIBRATION_PRIOR)
            for b in range(CALIBRATION_BINS)
        )

    def _bounded(self, k: int) -> int:
        return max(1, min(self.k_max, int(k)))

    def shape_for_step(self, base: TreeShape) -> TreeShape:
        """The run's shape with this pass's depth and the confidence threshold. topk and the budget
        are the run's, so the pass is never wider than the run's own shape allows."""
        return dataclasses.replace(
            base, k=min(self.k, base.k), min_confidence=self.min_confidence, calibration=self.calibration
        )

    def update(
        self,
        accepted_len: int,
        drafted_depth: int,
        outcomes=(),
        draft_ms: float | None = None,
        verify_ms: float | None = None,
        drafted: int | None = None,
    ) -> None:
        """After a verification: accepted_len = depth the accepted path reached, drafted_depth = the
        deepest node drafted, outcomes = (q, accepted) of the drafts whose fate is known
        (``verified_outcomes``), draft_ms = what drafting this pass took, verify_ms = what the rest
        of the step took (the target pass of 1 + drafted tokens and the verification). A pass that
        drafted nothing carries no evidence and leaves K alone."""
        for q, accepted in outcomes:
            b = min(CALIBRATION_BINS - 1, int(q * CALIBRATION_BINS))
            self.tried[b] += 1
            self.accepted[b] += bool(accepted)
        if self.pass_ms is not None:
            self._age_records()
        if not self.drafts:  # a plain pass: its cost, and a probe after PROBE_EVERY of them
            self._plain_update(verify_ms)
            return
        if drafted_depth <= 0:
            self._because = "the last pass drafted nothing, which says nothing about K: unchanged"
            return
        if self.pass_ms is None:
            if accepted_len >= drafted_depth:
                self._because = f"the last pass kept all {drafted_depth} drafts: K + {GROW}"
                self.k = self._bounded(self.k + GROW)
            else:
                self._because = f"the last pass kept {accepted_len} of {drafted_depth} levels: K - {SHRINK}"
                self.k = self._bounded(self.k - SHRINK)
            return
        # Levels tested: the accepted ones and, unless the whole draft survived, the one that failed.
        tested = min(drafted_depth, accepted_len + 1)
        self.alpha_accepted = RECENCY * self.alpha_accepted + accepted_len
        self.alpha_tested = RECENCY * self.alpha_tested + tested
        # The run's first draft also catches a model drafter up on the whole prompt (its prefill, many times
        # a level's cost): a one-off, so its time is not a level's cost (counted, it would hold a drafter at
        # K = 1 for dozens of passes; docs/bench/2026-12-07-notes-from-engine.md).
        # A probe's draft likewise catches it up on the plain passes' tokens.
        if draft_ms is not None and self._timed_draft:
            self._renew(self.draft_by_depth, drafted_depth, max(0.0, float(draft_ms)))
            self._draft_line = self._fit_draft_costs()
        self._timed_draft = True
        if verify_ms is not None and drafted is not None and 1 + drafted <= len(self.pass_ms):
            extra = max(0.0, float(verify_ms) - self.pass_ms[drafted])
            self.step_overhead_ms = _recent(self.step_overhead_ms, extra, self.overheads_seen > 0)
            self.overheads_seen += 1
            self._seen_pass(1 + drafted, max(0.0, float(verify_ms)))
        # Every candidate's expected speed, computed once: the choice reads it now, the step event (why) next pass.
        self._speeds = [self.expected_speed(k) for k in range(1, self.k_max + 1)]
        self.k = self._best_k()
        self._because = "the most expected tokens per ms of drafting and verifying, at the pass costs this run measured (calibrated ones for widths it has not run)"
        if self.plain_speed() > self._speeds[self.k - 1]:
            self.k, self.plain_in_a_row = 0, 0
            self._because = "drafting is expected to cost more than it saves"

    def _best_k(self) -> int:
        """The depth in [1, k_max] with the most expected tokens per ms at the last update (the first among equals)."""
        return 1 + max(range(self.k_max), key=self._speeds.__getitem__)

    def _plain_update(self, verify_ms: float | None) -> None:
        """After a plain pass: what it cost (pass_cost(1) from now on), then K stays 0 until PROBE_EVERY plain
        passes in a row; then a probe (``_probe``)."""
        if verify_ms is not None:
            self._seen_pass(1, max(0.0, float(verify_ms)))
        self.plain_in_a_row += 1
        if self.plain_in_a_row < PROBE_EVERY:
            self._because = "drafting is expected to cost more than it saves"
            return
        self._probe()

    def _probe(self) -> None:
        """Draft again after PROBE_EVERY plain passes, with the timing record started afresh from the plain
        passes': what drafting cost before may have been a slow moment of the machine (the run's first passes
        in a busy app: two slow drafts, then nothing but plain passes and probes that each looked dear, since a
        probe's draft also catches the drafter up on the plain passes' tokens). The drafting costs and the wider
        passes' are forgotten, the step's overhead is the plain passes' own, and the probe's draft time is not a
        level's cost: so the probe drafts at the best K with drafting priced at nothing, and unless its target
        pass alone already costs more than it can give, the next pass drafts again and is timed whole."""
        plain = self.verify_by_width.get(1)
        self.verify_by_width = {1: plain} if plain else {}
        if plain:
            self.step_overhead_ms = max(0.0, plain[1] - self.pass_ms[0])
        self.draft_by_depth = {}
        self._draft_line = (0.0, 0.0)
        self._timed_draft = False
        self._speeds = [self.expected_speed(k) for k in range(1, self.k_max + 1)]
        self.k = self._best_k()
        self._because = f"a probe after {PROBE_EVERY} plain passes: drafting again, its costs measured afresh"

    def why(self) -> dict:
        """Why the next pass drafts self.k levels, as the step event records it: {"k", "because"} and, for the
        cost-aware policy, "alpha" (the recent acceptance rate) and "speeds" (expected tokens per ms of each
        candidate depth, 1..k_max, the chosen one the largest); a model drafter may still stop shallower on
        confidence (the step's draft.stop says so)."""
        record = {"k": self.k, "because": self._because}
        if self.pass_ms is not None:
            record["alpha"] = round(self.alpha, 3)
            speeds = self._speeds or [self.expected_speed(k) for k in range(1, self.k_max + 1)]
            record["speeds"] = [round(v, 4) for v in speeds]
            record["plain"] = round(self.plain_speed(), 4)
        return record


def _recent(average: float, sample: float, seen: bool) -> float:
    """A recency-weighted mean of timings: the first sample as is, then RECENCY of the old mean."""
    return RECENCY * average + (1 - RECENCY) * sample if seen else sample


def verified_outcomes(tree: DraftTree, path: list[int]) -> list[tuple[float, bool]]:
    """(q, accepted) of the drafts a verification decided: the accepted path's nodes, and the
    children of its last node (or of the root), which were all tried and rejected. Siblings of
    the path are left out (sampled verification stops trying them at the first acceptance, so
    their fate is not always known). Empty for point-mass drafts (n-gram: no q to calibrate)."""
    if tree.point_mass or not len(tree):
        return []
    outcomes = [(tree.q_token[node], True) for node in path]
    last = path[-1] if path else -1
    outcomes += [(tree.q_token[child], False) for child in tree.children(last)]
    return outcomes
