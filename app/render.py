"""Plain-data -> display text: the coloured token stream, stat lines, the run card and the narration.

Everything here reads trace events (docs/events.md) and returns HTML or Markdown strings; no
model, no Gradio. Colours and marks come from visuals.PALETTE / visuals.MARKS so that the text,
the legend and every figure agree.
"""

from __future__ import annotations

import html

__all__ = [
    "palette",
    "marks",
    "token_html",
    "legend_html",
    "stats_line",
    "run_card",
    "narrate_step",
    "md_token",
    "trace_title",
]

_FALLBACK_PALETTE = {
    "accepted": "#009E73",
    "rejected": "#D55E00",
    "resampled": "#E69F00",
    "bonus": "#0072B2",
    "not_reached": "#999999",
    "drafted": "#56B4E9",
}
_FALLBACK_MARKS = {"accepted": "✓", "rejected": "✗", "resampled": "↻", "bonus": "+", "not_reached": "·"}

KIND_HELP = {
    "accepted": "drafted and kept by the target",
    "resampled": "a draft was rejected; the target drew this token instead",
    "bonus": "drawn from the target after the last accepted draft (free extra token)",
}


def palette() -> dict[str, str]:
    try:
        from visuals import PALETTE

        return {**_FALLBACK_PALETTE, **PALETTE}
    except Exception:  # visuals missing or broken: keep the text readable anyway
        return dict(_FALLBACK_PALETTE)


def marks() -> dict[str, str]:
    try:
        from visuals import MARKS

        return {**_FALLBACK_MARKS, **MARKS}
    except Exception:
        return dict(_FALLBACK_MARKS)


# ----------------------------------------------------------------------------- helpers
def _steps(trace: list[dict]) -> list[dict]:
    return [e for e in trace or [] if isinstance(e, dict) and e.get("type") == "step"]


def _start(trace: list[dict]) -> dict:
    return trace[0] if trace and trace[0].get("type") == "start" else {}


def _finish(trace: list[dict]) -> dict | None:
    return trace[-1] if trace and trace[-1].get("type") == "finish" else None


def _num(x, digits: int = 3) -> str:
    if x is None:
        return "—"
    x = float(x)
    if x != 0 and abs(x) < 0.001:
        return f"{x:.1e}"
    return f"{x:.{digits}f}"


def _plural(n, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def md_token(text: str | None) -> str:
    """A token as an inline code span, quoted, with newlines and tabs made visible."""
    if text is None:
        return "`?`"
    shown = "'" + text.replace("\n", "⏎").replace("\r", "␍").replace("\t", "⇥") + "'"
    fence = "``" if "`" in shown else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{shown}{pad}{fence}"


def _token_inner_html(text: str) -> str:
    out = html.escape(text, quote=False)
    out = out.replace("\r", "")
    out = out.replace("\n", '<span class="sl-nl">⏎</span>\n')
    out = out.replace("\t", "    ")
    return out


def trace_title(trace: list[dict]) -> str:
    """One line saying what ran: drafter, target, decoding mode and seed."""
    start = _start(trace)
    settings = start.get("settings") or {}
    if start.get("greedy"):
        mode = "greedy (temperature 0)"
    else:
        mode = f"sampling (temperature {settings.get('temperature', '?')})"
    drafter = start.get("drafter", "?")
    drafter = "none (baseline)" if drafter == "none" else drafter
    tree = start.get("tree") or {}
    shape = ""
    if drafter != "none (baseline)":
        shape = f", K = {tree.get('steps', settings.get('k', '?'))}"
        if (tree.get("topk") or 1) > 1:
            shape += f", tree top-k {tree.get('topk')} (budget {tree.get('budget')})"
    return f"{start.get('target', '?')} · drafter {drafter}{shape} · {mode} · seed {settings.get('seed', '?')}"


# -------------------------------------------------------------------------- token text
def token_html(trace: list[dict], running: bool = False, empty_message: str | None = None) -> str:
    """The generated text, one span per token coloured by how it was produced, grouped by target pass."""
    start = _start(trace)
    steps = _steps(trace)
    colours = palette()
    baseline = start.get("mode") == "baseline"
    parts = ['<div class="sl-text' + (" sl-baseline" if baseline else "") + '">']
    if not steps:
        message = empty_message or ("Waiting for the first target pass…" if running else "No tokens yet.")
        parts.append(f'<span class="sl-muted">{html.escape(message)}</span>')
    eos = set(start.get("eos_ids") or [])
    for step in steps:
        emitted = step.get("emitted") or []
        counts: dict[str, int] = {}
        for item in emitted:
            counts[item.get("kind", "?")] = counts.get(item.get("kind", "?"), 0) + 1
        summary = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        number = step.get("step", "?")
        title = f"target pass {number}: {summary}" if summary else f"target pass {number}"
        parity = "odd" if int(number or 0) % 2 else "even"
        parts.append(f'<span class="sl-pass sl-pass-{parity}" title="{html.escape(title)}" data-pass="{number}">')
        for item in emitted:
            kind = item.get("kind", "bonus")
            text = item.get("text")
            if text is None:
                text = f"⟨{item.get('token_id')}⟩"
            special = item.get("token_id") in eos
            tip = f"pass {number} · {kind}: {KIND_HELP.get(kind, '')}"
            if item.get("p") is not None:
                tip += f" · target p = {_num(item['p'])}"
            if baseline:
                style = ""
            else:
                colour = colours.get(kind, "#888888")
                style = f' style="background-color: {colour}33; border-color: {colour};"'
            classes = f"sl-tok sl-{kind}" + (" sl-special" if special else "")
            parts.append(f'<span class="{classes}"{style} title="{html.escape(tip)}">{_token_inner_html(text)}</span>')
        parts.append("</span>")
    if running:
        parts.append('<span class="sl-cursor">▍</span>')
    parts.append("</div>")
    return "".join(parts)


def legend_html(baseline: bool = False) -> str:
    colours = palette()
    mk = marks()
    if baseline:
        return (
            '<div class="sl-legend">Baseline: no drafter, the target produces exactly one token per pass '
            "(plain decoding).</div>"
        )
    items = []
    for kind in ("accepted", "resampled", "bonus"):
        colour = colours.get(kind, "#888")
        items.append(
            f'<span class="sl-legend-item"><span class="sl-swatch" style="background-color: {colour}33; '
            f'border-color: {colour};">{mk.get(kind, "")} {kind}</span> {html.escape(KIND_HELP[kind])}</span>'
        )
    items.append(
        '<span class="sl-legend-item"><span class="sl-swatch sl-swatch-pass">tokens</span> '
        "alternating underline = one target pass (hover a token for details)</span>"
    )
    return '<div class="sl-legend">' + "".join(items) + "</div>"


# ----------------------------------------------------------------------------- stats
def _summary(trace: list[dict]) -> dict:
    steps = _steps(trace)
    finish = _finish(trace) or {}
    metrics = finish.get("metrics") or {}
    passes = len(steps)
    tokens = steps[-1].get("tokens_total", 0) if steps else 0
    drafted = sum(int(s.get("drafted") or 0) for s in steps)
    accepted = sum(int(s.get("accepted_len") or 0) for s in steps)
    elapsed = float(steps[-1].get("elapsed_s") or 0.0) if steps else 0.0
    out = {
        "passes": int(metrics.get("target_passes", passes)),
        "tokens": int(metrics.get("new_tokens", tokens)),
        "drafted": int(metrics.get("drafted", drafted)),
        "accepted": int(metrics.get("accepted", accepted)),
        "wall_s": float(metrics.get("wall_s", elapsed) or 0.0),
    }
    out["alpha"] = metrics.get("acceptance_rate", out["accepted"] / out["drafted"] if out["drafted"] else None)
    out["tokens_per_pass"] = out["tokens"] / out["passes"] if out["passes"] else 0.0
    out["tokens_per_s"] = metrics.get("tokens_per_s", out["tokens"] / out["wall_s"] if out["wall_s"] else 0.0)
    return out


def stats_line(trace: list[dict], running: bool = False) -> str:
    """A one-line live counter: passes, tokens, tokens/pass, α, tokens/s, time."""
    s = _summary(trace)
    start = _start(trace)
    state = "running" if running else ("finished" if _finish(trace) else "stopped early" if _steps(trace) else "")
    alpha = "—" if s["alpha"] is None else f"{s['alpha']:.2f}"
    items = [
        f"<b>{s['passes']}</b> target passes",
        f"<b>{s['tokens']}</b> tokens",
        f"<b>{s['tokens_per_pass']:.2f}</b> tokens/pass",
    ]
    if start.get("mode") != "baseline":
        items.append(f"α = <b>{alpha}</b> ({s['accepted']} of {s['drafted']} drafts accepted)")
    items.append(f"<b>{s['tokens_per_s']:.1f}</b> tokens/s")
    items.append(f"{s['wall_s']:.1f} s")
    badge = f'<span class="sl-badge sl-badge-{state.replace(" ", "-")}">{state}</span>' if state else ""
    return '<div class="sl-stats">' + badge + " · ".join(items) + "</div>"


def run_card(trace: list[dict], source: str = "") -> str:
    """Markdown summary of a finished or stopped run."""
    start = _start(trace)
    finish = _finish(trace)
    steps = _steps(trace)
    if not start:
        return "No run yet."
    s = _summary(trace)
    metrics = (finish or {}).get("metrics") or {}
    settings = start.get("settings") or {}
    status = (
        f"finished ({'end of answer' if finish.get('stop_reason') == 'eos' else 'reached max new tokens'})"
        if finish
        else f"stopped early after {len(steps)} passes (partial trace)"
    )
    lines = [f"### Run summary: {status}"]
    if source:
        lines.append(f"*{source}*")
    lines.append("")
    lines.append(
        f"- **What ran:** {start.get('target', '?')} with drafter **{start.get('drafter', '?')}** "
        f"({start.get('dtype', '?')} on {start.get('device', '?')})"
    )
    tree = start.get("tree") or {}
    shape = f"K = {tree.get('steps', settings.get('k'))}"
    if (tree.get("topk") or 1) > 1:
        shape += f", tree top-k {tree.get('topk')}, budget {tree.get('budget')}"
    sampling = "greedy" if start.get("greedy") else f"temperature {settings.get('temperature')}"
    sampling += f", top-p {settings.get('top_p')}, top-k {settings.get('top_k')}"
    lines.append(f"- **Settings:** {shape}; {sampling}; seed {settings.get('seed')}")
    lines.append(
        f"- **Output:** {_plural(s['tokens'], 'token')} in {_plural(s['passes'], 'target pass', 'target passes')} → "
        f"**{s['tokens_per_pass']:.2f} tokens per pass** (plain decoding: 1.00)"
    )
    if start.get("mode") != "baseline":
        alpha = s["alpha"]
        alpha_text = "—" if alpha is None else f"{alpha:.2f}"
        lines.append(f"- **Acceptance α:** {alpha_text} ({s['accepted']} of {s['drafted']} drafted tokens accepted)")
        if "theoretical_tokens_per_pass" in metrics:
            tree_note = (
                " A tree beats it by offering several candidates per position." if (tree.get("topk") or 1) > 1 else ""
            )
            lines.append(
                f"- **Theory:** a K-token chain with this α gives (1 − α^(K+1)) / (1 − α) = "
                f"{metrics['theoretical_tokens_per_pass']:.2f} tokens per pass.{tree_note}"
            )
    if metrics:
        lines.append(
            f"- **Time:** {metrics.get('wall_s', 0):.2f} s in all: prefill {metrics.get('prefill_s', 0):.2f} s, drafting "
            f"{metrics.get('draft_s', 0):.2f} s, target passes and checks {metrics.get('verify_s', 0):.2f} s → "
            f"**{metrics.get('tokens_per_s', 0):.1f} tokens/s**"
        )
    else:
        lines.append(
            f"- **Time:** {s['wall_s']:.2f} s until the last completed pass → {s['tokens_per_s']:.1f} tokens/s"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- narration
def _top_token(step: dict, parent: int) -> list | None:
    for dist in step.get("dists") or []:
        if dist.get("node") == parent and dist.get("p_top"):
            return dist["p_top"][0]
    return None


def _node_text(node: dict) -> str | None:
    return node.get("text")


def narrate_step(trace: list[dict], step_index: int) -> str:
    """Markdown explaining every decision of step `step_index` (0-based) in plain words."""
    steps = _steps(trace)
    if not steps:
        return "This trace has no target passes yet."
    step_index = max(0, min(step_index, len(steps) - 1))
    step = steps[step_index]
    start = _start(trace)
    greedy = bool(start.get("greedy"))
    point_mass = bool(step.get("point_mass"))
    nodes = step.get("nodes") or []
    emitted = step.get("emitted") or []
    number = step.get("step", step_index + 1)

    lines: list[str] = []
    drafted = int(step.get("drafted") or len(nodes))
    eos = set(start.get("eos_ids") or [])
    timing = ""
    if step.get("verify_ms") is not None:
        if drafted and step.get("draft_ms") is not None:
            timing = f" ({step['draft_ms']:.0f} ms drafting, {step['verify_ms']:.0f} ms for the target pass and checks)"
        else:
            timing = f" ({step['verify_ms']:.0f} ms)"
    if drafted == 0:
        if start.get("mode") == "baseline":
            lines.append(
                f"**Pass {number} of {len(steps)}.** No drafter: the target runs once and adds one token{timing}."
            )
        else:
            lines.append(
                f"**Pass {number} of {len(steps)}.** The drafter had nothing to propose this time "
                f"(e.g. no n-gram match), so the target adds one token on its own{timing}."
            )
    else:
        shape = "a chain" if all(n.get("depth") == i + 1 for i, n in enumerate(nodes)) else "a tree"
        depth = step.get("draft_depth") or max((n.get("depth") or 0) for n in nodes)
        lines.append(
            f"**Pass {number} of {len(steps)}.** The drafter proposed {drafted} token{'s' if drafted != 1 else ''} "
            f"({shape}, {depth} deep); the target scored all of them in **one** forward pass{timing}. "
            "Checking walks from the last committed token down the drafts:"
        )
    lines.append("")

    tried = [n for n in nodes if n.get("decision") in ("accepted", "rejected")]
    tried.sort(key=lambda n: (n.get("depth") or 0, n.get("id") or 0))
    mk = marks()
    for node in tried:
        token = md_token(_node_text(node))
        decision = node.get("decision")
        verdict = f"{mk.get(decision, '')} **{decision}**"
        q, p = node.get("q"), node.get("p")
        p_eff, q_eff = node.get("p_eff"), node.get("q_eff")
        accept_prob, u = node.get("accept_prob"), node.get("u")
        adjusted = (
            p_eff is not None
            and q_eff is not None
            and p is not None
            and q is not None
            and (abs(p_eff - p) > 1e-6 or abs(q_eff - q) > 1e-6)
        )
        if greedy:
            top = _top_token(step, node.get("parent", -1))
            if decision == "accepted":
                lines.append(f"- Drafted {token}; it is the target's top token here → {verdict}.")
            elif top is not None:
                lines.append(f"- Drafted {token}; the target's top token is {md_token(top[1])} → {verdict}.")
            else:
                lines.append(f"- Drafted {token}; the target's top token is a different one → {verdict}.")
            continue
        if point_mass:
            p_shown = p_eff if p_eff is not None else p
            text = (
                f"- Drafted {token} by n-gram lookup. q is a point mass (n-gram), so accept with probability "
                f"p(x) = {_num(p_shown)}"
            )
            if adjusted:
                text += " (p after removing the already rejected drafts, renormalised)"
            if u is not None:
                text += f"; drew u = {_num(u)}"
            lines.append(text + f" → {verdict}.")
            continue
        text = f"- Drafted {token} with q = {_num(q)}; target gives p = {_num(p)}"
        if adjusted:
            text += (
                f". A sibling was rejected first, so it is compared with what is left: p′ = norm(max(0, p − q)) = "
                f"{_num(p_eff)} and q′ = q without the rejected sibling = {_num(q_eff)}: min(1, p′/q′) = "
                f"{_num(accept_prob)}"
            )
            if p_eff == 0:
                text += " (nothing of p is left for it)"
        else:
            text += f"; min(1, p/q) = {_num(accept_prob)}"
        if u is not None and (accept_prob is None or accept_prob < 1.0 or decision == "rejected"):
            text += f", drew u = {_num(u)}"
        elif accept_prob is not None and accept_prob >= 1.0:
            text += " (p ≥ q: always kept)"
        lines.append(text + f" → {verdict}.")

    if emitted:
        last = emitted[-1]
        kind = last.get("kind")
        token = md_token(last.get("text"))
        p_text = f" (p = {_num(last.get('p'))})" if last.get("p") is not None else ""
        if last.get("token_id") in eos:
            p_text += ": the end-of-answer token, so the run stops here"
        if kind == "resampled":
            if greedy:
                lines.append(
                    f"- {mk.get('resampled', '')} Instead the target's own top token {token} is emitted (**resampled**)."
                )
            elif point_mass:
                lines.append(
                    f"- {mk.get('resampled', '')} **Resampled** {token} from the residual norm(max(0, p − q)): with "
                    f"a point-mass q this is p with the rejected draft removed{p_text}."
                )
            else:
                lines.append(
                    f"- {mk.get('resampled', '')} **Resampled** {token} from the residual norm(max(0, p − q)){p_text}."
                )
                top = last.get("residual_top") or []
                if top:
                    shown = ", ".join(f"{md_token(t[1])} {_num(t[2])}" for t in top[:3])
                    lines.append(f"  The residual's most likely tokens were {shown}.")
        elif kind == "bonus":
            how = "the target's top token" if greedy else "drawn from p"
            if drafted == 0:
                lines.append(f"- The target's own token {token}, {how}{p_text} ({mk.get('bonus', '')} bonus).")
            elif step.get("accepted_len", 0) and step.get("accepted_len") == step.get("draft_depth"):
                lines.append(
                    f"- All drafts on the path accepted → {mk.get('bonus', '')} **bonus** token {token}, {how}{p_text}."
                )
            else:
                lines.append(
                    f"- The accepted path reached a draft with no children → {mk.get('bonus', '')} **bonus** token "
                    f"{token}, {how}{p_text}."
                )
    unreached = sum(1 for n in nodes if n.get("decision") == "not_reached")
    if unreached:
        lines.append(
            f"- {mk.get('not_reached', '·')} {unreached} drafted token{'s were' if unreached != 1 else ' was'} never "
            "checked: {} on a branch the walk did not take.".format("they were" if unreached != 1 else "it was")
        )
    lines.append("")
    produced = "".join(md_token(e.get("text")) + " " for e in emitted).strip()
    kept = len(emitted)
    lines.append(
        f"**Result:** {kept} token{'s' if kept != 1 else ''} added in this pass: {produced or '—'}"
        + (" (cut at the end of the answer / the token limit)" if step.get("truncated") else "")
        + f". Running total: {_plural(step.get('tokens_total', 0), 'token')} after "
        f"{_plural(step.get('target_passes', number), 'target pass', 'target passes')}."
    )
    return "\n".join(lines)
