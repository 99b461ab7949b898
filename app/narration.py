"""The Step-through's narration: one target pass of a trace, every decision explained in plain words.

It reads what the engine recorded for each tried node (accept_prob, u, p_eff, q_eff and whether
the test was `adjusted` by earlier rejected siblings) and never recomputes the rule; p is the
target, q the drafter. Markdown out, no Gradio.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.trace import start_event, step_events
from visuals import MARKS
from visuals.steps import absent_note
from visuals.style import fmt_uniform

from .render import fmt_num, md_token, plural

__all__ = ["narrate_step"]


@dataclass(frozen=True)
class _Pass:
    """The facts about one pass that every sentence of its narration needs."""

    step: dict
    number: int
    total: int  # passes in the trace
    greedy: bool
    point_mass: bool  # n-gram drafts: q is a point mass
    baseline: bool
    drafted: int
    eos: set


def _read_pass(trace: list[dict], step_index: int) -> _Pass:
    steps = step_events(trace)
    step = steps[step_index]
    start = start_event(trace)
    return _Pass(
        step=step,
        number=step.get("step", step_index + 1),
        total=len(steps),
        greedy=bool(start.get("greedy")),
        point_mass=bool(step.get("point_mass")),
        baseline=start.get("mode") == "baseline",
        drafted=int(step.get("drafted") or len(step.get("nodes") or [])),
        eos=set(start.get("eos_ids") or []),
    )


def _timing(pp: _Pass) -> str:
    step = pp.step
    if step.get("verify_ms") is None:
        return ""
    if pp.drafted and step.get("draft_ms") is not None:
        return f" ({step['draft_ms']:.0f} ms drafting, {step['verify_ms']:.0f} ms for the target pass and checks)"
    return f" ({step['verify_ms']:.0f} ms)"


def _opening(pp: _Pass) -> str:
    """What happened in the pass, in one sentence."""
    head = f"**Pass {pp.number} of {pp.total}.**"
    if pp.drafted == 0 and pp.baseline:
        return f"{head} No drafter: the target runs once and adds one token{_timing(pp)}."
    why = (pp.step.get("draft") or {}).get("why")
    if pp.drafted == 0 and isinstance(why, dict) and why.get("k") == 0:
        plain = why.get("plain")
        expected = f" ({plain:.3f} tokens/ms expected)" if isinstance(plain, (int, float)) else ""
        return (
            f"{head} Adaptive drafting chose a plain pass (K = 0): {why.get('because', '?')}{expected}, so the "
            f"target adds one token on its own{_timing(pp)}; now and then a pass drafts again, to measure whether "
            "drafting pays by now."
        )
    if pp.drafted == 0:
        return (
            f"{head} The drafter had nothing to propose this time "
            f"(e.g. no n-gram match), so the target adds one token on its own{_timing(pp)}."
        )
    nodes = pp.step.get("nodes") or []
    shape = "a chain" if all(n.get("depth") == i + 1 for i, n in enumerate(nodes)) else "a tree"
    depth = pp.step.get("draft_depth") or max((n.get("depth") or 0) for n in nodes)
    return (
        f"{head} The drafter proposed {plural(pp.drafted, 'token')} "
        f"({shape}, {depth} deep){_hybrid_why(pp.step)}{_adaptive_why(pp.step)}; the target scored all of them in **one** forward "
        f"pass{_timing(pp)}. Checking walks from the last committed token down the drafts:"
    )


def _hybrid_why(step: dict) -> str:
    """A hybrid drafter's pick for this pass, as the engine recorded it (draft.hybrid), or ''."""
    pick = (step.get("draft") or {}).get("hybrid")
    if not isinstance(pick, dict):
        return ""
    speeds = pick.get("speeds") or {}
    copy, model = speeds.get("copy"), speeds.get("model")
    measured = lambda v: "not measured yet" if v is None else f"{v:.3f} tokens/ms"  # noqa: E731
    continued = pick.get("continued") or 0
    if pick.get("bridged"):
        why = (
            f"copying pays in this run, {measured(copy)} against the model's {measured(model)}, but had no match "
            "here: the model bridges the gap one token at a time"
            + (
                f", and the copying drafter continued with the last {plural(continued, 'token')} where it matched again"
                if continued
                else ", and the copying drafter did not match again within the model's depth"
            )
        )
    elif not pick.get("proposed"):
        why = "the copying drafter had no proposal here"
    elif model is None:
        why = "the model had not drafted yet in this run"
    else:
        why = f"measured so far: copying {measured(copy)}, the model {measured(model)}"
    return f" — the hybrid drafter picked **{pick.get('picked')}** ({why})"


def _adaptive_why(step: dict) -> str:
    """Adaptive drafting's reason for this pass's K, as the engine recorded it (draft.why), or ''."""
    why = (step.get("draft") or {}).get("why")
    if not isinstance(why, dict):
        return ""
    text = f" — adaptive depth chose K = {why.get('k')} because {why.get('because', '?')}"
    speeds, k = why.get("speeds"), why.get("k")
    if speeds and isinstance(k, int) and 1 <= k <= len(speeds):  # the engine's choice, with what it expected of it
        text += f" (K = {k} expected {speeds[k - 1]:.3f} tokens/ms at α = {why.get('alpha', 0):.2f})"
    if (step.get("draft") or {}).get("stop") == "confidence":
        text += ", and the drafter stopped shallower when its confidence fell below the threshold"
    return text


def _top_token(step: dict, parent: int) -> list | None:
    for dist in step.get("dists") or []:
        if dist.get("node") == parent and dist.get("p_top"):
            return dist["p_top"][0]
    return None


GREEDY_HINT = (
    "  *Greedy (temperature 0): a draft is accepted iff it is the target's top token, so no random test u "
    "is drawn. Set temperature > 0 to see the test u < p/q.*"
)


def _greedy_decision(pp: _Pass, node: dict, token: str, verdict: str) -> str:
    if node.get("decision") == "accepted":
        return f"- Drafted {token}; it is the target's top token here → {verdict}."
    top = _top_token(pp.step, node.get("parent", -1))
    if top is not None:
        return f"- Drafted {token}; the target's top token is {md_token(top[1])} → {verdict}."
    return f"- Drafted {token}; the target's top token is a different one → {verdict}."


def _point_mass_decision(node: dict, token: str, verdict: str) -> str:
    p_shown = node.get("p_eff") if node.get("p_eff") is not None else node.get("p")
    text = (
        f"- Drafted {token} by n-gram lookup. q is a point mass (n-gram), so accept with probability "
        f"p(x) = {fmt_num(p_shown)}"
    )
    if node.get("adjusted"):
        text += " (p after removing the already rejected drafts, renormalised)"
    if node.get("u") is not None:
        text += f"; drew u = {fmt_uniform(node['u'])}"
    return text + f" → {verdict}."


def _sampled_decision(node: dict, token: str, verdict: str) -> str:
    accept_prob, u = node.get("accept_prob"), node.get("u")
    text = f"- Drafted {token} with q = {fmt_num(node.get('q'))}; target gives p = {fmt_num(node.get('p'))}"
    if node.get("adjusted"):
        text += (
            f". A sibling was rejected first, so it is compared with what is left: p′ = norm(max(0, p − q)) = "
            f"{fmt_num(node.get('p_eff'))} and q′ = q without the rejected sibling = {fmt_num(node.get('q_eff'))}: "
            f"min(1, p′/q′) = {fmt_num(accept_prob)}"
        )
        if node.get("p_eff") == 0:
            text += " (nothing of p is left for it)"
    else:
        text += f"; min(1, p/q) = {fmt_num(accept_prob)}"
    if u is not None and (accept_prob is None or accept_prob < 1.0 or node.get("decision") == "rejected"):
        text += f", drew u = {fmt_uniform(u)}"
    elif accept_prob is not None and accept_prob >= 1.0:
        text += " (p ≥ q: always kept)"
    return text + f" → {verdict}."


BLOCK_HINT = (
    "  *Block verification: every prefix of the drafts is tested at once. The test of the prefix ending at "
    "draft i is u < h, where h comes from the running joint ratio min(1, p/q × the previous one) and the mass "
    "the target still has beyond the drafter after that prefix; the **longest** prefix that passes is kept, so a "
    "draft can be kept although its own prefix failed (a later one passed). Exact, like the token rule, and "
    "never fewer tokens on average.*"
)


def _block_decision(node: dict, token: str, verdict: str, kept: int) -> str:
    passed = bool(node.get("prefix_passed"))  # (the engine's outcome of u < h, recorded)
    text = (
        f"- Drafted {token} with q = {fmt_num(node.get('q_eff'))}; target gives p = {fmt_num(node.get('p_eff'))}; "
        f"joint ratio {fmt_num(node.get('joint'))}; the prefix ending here: h = {fmt_num(node.get('accept_prob'))}, "
        f"u = {fmt_uniform(node.get('u'))} → prefix {'passes' if passed else 'fails'}"
    )
    if node.get("decision") == "accepted" and not passed:
        text += f" (kept anyway: the prefix of {kept} passed)"
    return text + f" → {verdict}."


def _decisions(pp: _Pass) -> list[str]:
    """One line per tried draft, shallowest first."""
    tried = [n for n in pp.step.get("nodes") or [] if n.get("decision") in ("accepted", "rejected")]
    tried.sort(key=lambda n: (n.get("depth") or 0, n.get("id") or 0))
    if pp.step.get("verify") == "block" and tried:
        kept = pp.step.get("accepted_len", 0)
        lines = [BLOCK_HINT]
        for node in tried:
            verdict = f"{MARKS[node['decision']]} **{node['decision']}**"
            lines.append(_block_decision(node, md_token(node.get("text")), verdict, kept))
        return lines
    lines = [GREEDY_HINT] if pp.greedy and tried else []
    for node in tried:
        token = md_token(node.get("text"))
        verdict = f"{MARKS[node['decision']]} **{node['decision']}**"
        if pp.greedy:
            lines.append(_greedy_decision(pp, node, token, verdict))
        elif pp.point_mass:
            lines.append(_point_mass_decision(node, token, verdict))
        else:
            lines.append(_sampled_decision(node, token, verdict))
    return lines


def _residual_text(last: dict, top: list) -> str:
    """A resampled token's odds where it was drawn, the residual, beside its p (the target's probability before
    the rejection, which a reader would otherwise take for the odds of the draw)."""
    p = last.get("p")
    drawn = next((t[2] for t in top if t[0] == last.get("token_id")), None)
    if p is None:
        return "" if drawn is None else f" (residual probability {fmt_num(drawn)})"
    if drawn is None:
        return f" (p = {fmt_num(p)}: the target's probability before the rejection, not the residual's)"
    return f" (residual probability {fmt_num(drawn)}; its p, before the rejection, {fmt_num(p)})"


def _resampled(pp: _Pass, last: dict, token: str, p_text: str) -> list[str]:
    mark = MARKS["resampled"]
    if pp.greedy:
        return [f"- {mark} Instead the target's own top token {token} is emitted (**resampled**)."]
    if pp.step.get("verify") == "block" and pp.step.get("accepted_len", 0) > 0:
        return [
            f"- {mark} **Resampled** {token} from the block rule's residual norm(max(0, joint × p − q)) after the "
            f"kept prefix of {pp.step['accepted_len']}{p_text}."
        ]
    if pp.point_mass:
        return [
            f"- {mark} **Resampled** {token} from the residual norm(max(0, p − q)): with "
            f"a point-mass q this is p with the rejected draft removed{p_text}."
        ]
    top = last.get("residual_top") or []
    lines = [f"- {mark} **Resampled** {token} from the residual norm(max(0, p − q)){_residual_text(last, top)}."]
    if top:
        shown = ", ".join(f"{md_token(t[1])} {fmt_num(t[2])}" for t in top[:3])
        lines.append(f"  The residual's most likely tokens were {shown}.")
    return lines


def _bonus(pp: _Pass, token: str, p_text: str) -> str:
    how = "the target's top token" if pp.greedy else "drawn from p"
    mark = MARKS["bonus"]
    if pp.drafted == 0:
        return f"- The target's own token {token}, {how}{p_text} ({mark} bonus)."
    if pp.step.get("accepted_len", 0) and pp.step.get("accepted_len") == pp.step.get("draft_depth"):
        return f"- All drafts on the path accepted → {mark} **bonus** token {token}, {how}{p_text}."
    return f"- The accepted path reached a draft with no children → {mark} **bonus** token {token}, {how}{p_text}."


def _target_token(pp: _Pass) -> list[str]:
    """The token the target added itself (resampled after a rejection, or the bonus), if any."""
    emitted = pp.step.get("emitted") or []
    if not emitted:
        return []
    last = emitted[-1]
    token = md_token(last.get("text"))
    p_text = f" (p = {fmt_num(last.get('p'))})" if last.get("p") is not None else ""
    if last.get("token_id") in pp.eos:
        p_text += ": the end-of-answer token, so the run stops here"
    if last.get("kind") == "resampled":
        return _resampled(pp, last, token, p_text)
    if last.get("kind") == "bonus":
        return [_bonus(pp, token, p_text)]
    return []


def _unreached(pp: _Pass) -> list[str]:
    unreached = sum(1 for n in pp.step.get("nodes") or [] if n.get("decision") == "not_reached")
    if not unreached:
        return []
    return [
        f"- {MARKS['not_reached']} {unreached} drafted token{'s were' if unreached != 1 else ' was'} never "
        "checked: {} on a branch the walk did not take.".format("they were" if unreached != 1 else "it was")
    ]


def _result(pp: _Pass) -> str:
    emitted = pp.step.get("emitted") or []
    produced = "".join(md_token(e.get("text")) + " " for e in emitted).strip()
    return (
        f"**Result:** {plural(len(emitted), 'token')} added in this pass: {produced or '—'}"
        + (" (cut at the end of the answer / the token limit)" if pp.step.get("truncated") else "")
        + f". Running total: {plural(pp.step.get('tokens_total', 0), 'token')} after "
        f"{plural(pp.step.get('target_passes', pp.number), 'target pass', 'target passes')}."
    )


def narrate_step(trace: list[dict], step_index: int) -> str:
    """Markdown explaining every decision of step `step_index` (0-based, clamped) in plain words."""
    steps = step_events(trace or [])
    if not steps:
        return "This trace has no target passes yet."
    pp = _read_pass(trace, max(0, min(step_index, len(steps) - 1)))
    lines = [_opening(pp), ""]
    absent = absent_note(start_event(trace))
    if absent:  # a production engine's trace: the counts are real, the drafts themselves were not reported
        lines += [f"*This run came from a production engine; {absent}. The tokens below are what it emitted.*", ""]
    lines += _decisions(pp) + _target_token(pp) + _unreached(pp)
    lines += ["", _result(pp)]
    kv = steps[max(0, min(step_index, len(steps) - 1))].get("kv")
    if kv:  # the engine's record of this pass's target cache
        lines += [
            "",
            f"*KV cache:* this pass wrote {kv['written']} slots (the pending token and every draft), kept "
            f"{kv['kept']} (the pending token and the accepted path) and rolled back {kv['rolled_back']}; "
            f"{kv['length']} tokens are cached now.",
        ]
    return "\n".join(lines)
