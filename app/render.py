"""Plain data -> display text: the coloured token stream, the stat line, the run card and small formatters.

Everything here reads trace events (docs/events.md) through engine.trace and engine.metrics
and returns HTML or Markdown strings; no model, no Gradio. Colours and marks come from
visuals.PALETTE / visuals.MARKS so that the text, the legend and every figure agree. The
narration of one pass is in `narration`.
"""

from __future__ import annotations

import html
import time

from engine.metrics import BUSY_CPU_SHARE, run_summary
from engine.trace import start_event, step_events
from visuals import MARKS, PALETTE

__all__ = [
    "fmt_num",
    "legend_html",
    "md_token",
    "plural",
    "run_card",
    "stats_line",
    "token_html",
    "trace_title",
]

KIND_HELP = {
    "accepted": "drafted and kept by the target",
    "resampled": "a draft was rejected; the target drew this token instead",
    "bonus": "drawn from the target after the last accepted draft (free extra token)",
}
TINY = 0.001  # numbers below this (but not 0) are written in scientific notation
SWATCH_ALPHA = "33"  # hex alpha of a token's background: a light tint of its decision colour


def fmt_num(x, digits: int = 3) -> str:
    """A probability or similar: `digits` decimals from 0.1 up, `digits` significant digits below (0.00213, not
    0.002: a ratio beside it can be checked by eye), scientific notation when tiny, — for none."""
    if x is None:
        return "—"
    x = float(x)
    if x != 0 and abs(x) < TINY:
        return f"{x:.{max(0, digits - 1)}e}"
    if x != 0 and abs(x) < 0.1:
        return f"{x:.{digits}g}"
    return f"{x:.{digits}f}"


def plural(n, word: str, plural_word: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural_word or word + 's'}"


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


def _tint(colour: str) -> str:
    """The inline style of a token or swatch in a decision colour."""
    return f"background-color: {colour}{SWATCH_ALPHA}; border-color: {colour};"


def trace_title(trace: list[dict]) -> str:
    """One line saying what ran: drafter, target, decoding mode and seed."""
    start = start_event(trace or [])
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
        shape = f", K = {tree.get('k', settings.get('k', '?'))}"
        if (tree.get("topk") or 1) > 1:
            shape += f", tree top-k {tree.get('topk')} (tree budget {tree.get('num_draft_tokens')})"
    return f"{start.get('target', '?')} · drafter {drafter}{shape} · {mode} · seed {settings.get('seed', '?')}"


# -------------------------------------------------------------------------- token text
def _pass_html(step: dict, baseline: bool, eos: set) -> str:
    """One target pass: its tokens in a span that carries the pass number."""
    emitted = step.get("emitted") or []
    counts: dict[str, int] = {}
    for item in emitted:
        counts[item.get("kind", "?")] = counts.get(item.get("kind", "?"), 0) + 1
    summary = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    number = step.get("step", "?")
    title = f"target pass {number}: {summary}" if summary else f"target pass {number}"
    parity = "odd" if int(number or 0) % 2 else "even"
    parts = [f'<span class="sl-pass sl-pass-{parity}" title="{html.escape(title)}" data-pass="{number}">']
    for item in emitted:
        kind = item.get("kind", "bonus")
        text = item.get("text")
        if text is None:
            text = f"⟨{item.get('token_id')}⟩"
        tip = f"pass {number} · {kind}: {KIND_HELP.get(kind, '')}"
        if item.get("p") is not None:
            tip += f" · target p = {fmt_num(item['p'])}"
        style = "" if baseline else f' style="{_tint(PALETTE.get(kind, "#888888"))}"'
        classes = f"sl-tok sl-{kind}" + (" sl-special" if item.get("token_id") in eos else "")
        parts.append(f'<span class="{classes}"{style} title="{html.escape(tip)}">{_token_inner_html(text)}</span>')
    parts.append("</span>")
    return "".join(parts)


def token_html(trace: list[dict], running: bool = False, empty_message: str | None = None) -> str:
    """The generated text, one span per token coloured by how it was produced, grouped by target pass."""
    start = start_event(trace or [])
    steps = step_events(trace or [])
    baseline = start.get("mode") == "baseline"
    parts = ['<div class="sl-text' + (" sl-baseline" if baseline else "") + '">']
    if not steps:
        message = empty_message or ("Waiting for the first target pass…" if running else "No tokens yet.")
        loaded = " sl-loaded" if empty_message and not running else ""  # the page greys the last run's results
        parts.append(f'<span class="sl-muted{loaded}">{html.escape(message)}</span>')
    eos = set(start.get("eos_ids") or [])
    parts.extend(_pass_html(step, baseline, eos) for step in steps)
    if running:
        parts.append('<span class="sl-cursor">▍</span>')
    parts.append("</div>")
    return "".join(parts)


def legend_html(baseline: bool = False) -> str:
    if baseline:
        return (
            '<div class="sl-legend">Baseline: no drafter, the target produces exactly one token per pass '
            "(plain decoding).</div>"
        )
    items = []
    for kind in ("accepted", "resampled", "bonus"):
        items.append(
            f'<span class="sl-legend-item"><span class="sl-swatch" style="{_tint(PALETTE[kind])}">'
            f"{MARKS[kind]} {kind}</span> {html.escape(KIND_HELP[kind])}</span>"
        )
    items.append(
        '<span class="sl-legend-item"><span class="sl-swatch sl-swatch-pass">tokens</span> '
        "alternating underline = one target pass (hover or tap a token for details)</span>"
    )
    return '<div class="sl-legend">' + "".join(items) + "</div>"


# ----------------------------------------------------------------------------- stats
def _alpha_text(s: dict) -> str:
    """α (accepted ÷ depths tried, the α of the formula) of a run summary; — while nothing was tried."""
    return f"{s['position_acceptance']:.2f}" if s["drafted"] else "—"


def stats_line(trace: list[dict], running: bool = False) -> str:
    """A one-line live counter: passes, tokens, tokens/pass, α, tokens/s, time."""
    s = run_summary(trace or [])
    state = "running" if running else ("finished" if s["finished"] else "stopped early" if s["target_passes"] else "")
    items = [
        f"<b>{s['target_passes']}</b> target passes",
        f"<b>{s['new_tokens']}</b> tokens",
        f"<b>{s['tokens_per_pass']:.2f}</b> tokens/pass",
    ]
    if s["mode"] != "baseline":
        # two rates, two denominators, both said (#40): every draft proposed, and the depths a pass tried
        # (a draft after a rejection is never tried: it counts in the first, not in α)
        alpha = f"α = <b>{_alpha_text(s)}</b>"
        if s["drafted"]:
            alpha += f" ({s['accepted']} of {s['positions_tried']} depths tried)"
        items.append(f"<b>{s['accepted']}</b> of {s['drafted']} drafts accepted, {alpha}")
    items.append(f"<b>{s['tokens_per_s']:.1f}</b> tokens/s")
    items.append(f"{s['wall_s']:.1f} s")
    badge = f'<span class="sl-badge sl-badge-{state.replace(" ", "-")}">{state}</span>' if state else ""
    return '<div class="sl-stats">' + badge + " · ".join(items) + "</div>"


def recorded_on(trace: list[dict]) -> str:
    """A recorded run's date and machine, short enough for a chart title: "recorded <date> on <CPU>"."""
    start = start_event(trace or [])
    host = start.get("host") or {}
    machine = host.get("gpu") or host.get("cpu") or start.get("device", "?")
    when = time.strftime("%Y-%m-%d", time.gmtime(start["started_at"])) if start.get("started_at") else "?"
    return f"recorded {when} on {machine}"


def recorded_where(trace: list[dict]) -> str:
    """Where and when a run happened: drafter and settings, dtype, CPU (or GPU), kernel, date."""
    start = start_event(trace or [])
    host = start.get("host") or {}
    machine = host.get("gpu") or host.get("cpu") or start.get("device", "?")
    kernel = host.get("kernel")
    kernel = f", our {kernel} kernels" if kernel else (", torch's ops" if "kernel" in host else "")
    when = time.strftime("%Y-%m-%d", time.gmtime(start["started_at"])) if start.get("started_at") else "?"
    return f"{trace_title(trace)}; {start.get('dtype', '?')} on {machine}{kernel}, {when}"


def _card_header(start: dict, s: dict, source: str) -> list[str]:
    """The card's title and what ran, with which settings."""
    settings = start.get("settings") or {}
    if s["finished"]:
        status = f"finished ({'end of answer' if s['stop_reason'] == 'eos' else 'reached max new tokens'})"
    else:
        status = f"stopped early after {s['target_passes']} passes (partial trace)"
    lines = [f"### Run summary: {status}"]
    if source:
        lines.append(f"*{source}*")
    lines.append("")
    host = start.get("host") or {}
    machine = host.get("gpu") or host.get("cpu")
    lines.append(
        f"- **What ran:** {start.get('target', '?')} with drafter **{start.get('drafter', '?')}** "
        f"({start.get('dtype', '?')} on {start.get('device', '?')}{f', {machine}' if machine else ''})"
    )
    tree = start.get("tree") or {}
    shape = f"K = {tree.get('k', settings.get('k'))}"
    if s["tree_topk"] > 1:
        shape += f", tree top-k {tree.get('topk')}, tree budget {tree.get('num_draft_tokens')}"
    sampling = "greedy" if start.get("greedy") else f"temperature {settings.get('temperature')}"
    sampling += f", top-p {settings.get('top_p')}, top-k {settings.get('top_k')}"
    lines.append(f"- **Settings:** {shape}; {sampling}; seed {settings.get('seed')}")
    return lines


def theory_line(s: dict) -> str:
    """The theory against the measurement, honest for every run kind: E = (1 − α^(K+1)) / (1 − α) at the K
    each pass actually drafted (adaptive depth, n-gram matches shorter than K, passes with nothing to draft),
    with α's own sample size; where most passes drafted nothing, the theory over the passes that drafted."""
    kind = "some sibling at a tried depth is kept" if s["tree_topk"] > 1 else "a tried draft is kept"
    passes, drafting = s["target_passes"], s.get("passes_drafted", s["target_passes"])
    # The mean K over every pass the theory averages (0 where nothing was drafted): at α = 1, E = that mean + 1,
    # which a reader can check by eye (the mean over the drafting passes alone would not add up).
    mean_k = s.get("mean_depth_per_pass", s["k"])
    text = (
        f"- **Theory:** α = {fmt_num(s['position_acceptance'])} (the chance that {kind}; "
        f"{plural(s.get('positions_tried', 0), 'depth')} tried), E = (1 − α^(K+1)) / (1 − α) at the K each pass "
        f"drafted (mean {mean_k:.2f} over all {passes} passes, slider K = {s['k']}) = "
        f"**{s['theoretical_tokens_per_pass']:.2f} tokens per pass** (measured {s['tokens_per_pass']:.2f})"
    )
    if drafting < passes:
        text += f"; {drafting} of {passes} passes drafted (a pass with nothing to draft yields 1 token)"
        if drafting * 2 < passes:
            text += (
                f", and over the {drafting} drafting pass{'' if drafting == 1 else 'es'} alone the theory is "
                f"{s.get('theoretical_tokens_per_drafting_pass', 1.0):.2f}"
            )
    return text + "."


def _card_numbers(s: dict) -> list[str]:
    """The card's output, acceptance, theory and time lines."""
    lines = [
        f"- **Output:** {plural(s['new_tokens'], 'token')} in "
        f"{plural(s['target_passes'], 'target pass', 'target passes')} → "
        f"**{s['tokens_per_pass']:.2f} tokens per pass** (plain decoding: 1.00)"
    ]
    if s["mode"] != "baseline":
        lines.append(
            f"- **Acceptance:** {s['accepted']} of {s['drafted']} drafted tokens accepted (accepted ÷ drafted = "
            f"{fmt_num(s['acceptance_rate'])}, vLLM's draft acceptance rate: drafts after a rejection were never "
            f"tried) beside a **mean acceptance length of {s.get('mean_acceptance_length', 1.0):.2f}** tokens per "
            f"drafting pass (1 + accepted ÷ drafting passes: a rate can fall while the length stays); "
            f"α = accepted ÷ depths tried = **{_alpha_text(s)}**"
            + (
                f"; {plural(s['dropped_at_end'], 'token', 'tokens')} past the run's end (EOS or the token limit) "
                "counted as accepted but not output, so the length exceeds tokens per pass"
                if s.get("dropped_at_end")
                else ""
            )
        )
        if s["finished"]:
            lines.append(theory_line(s))
    if s["finished"]:
        other = max(0.0, s["wall_s"] - s["prefill_s"] - s["draft_s"] - s["verify_s"])
        lines.append(
            f"- **Time:** {s['wall_s']:.2f} s in all = prefill {s['prefill_s']:.2f} s + drafting "
            f"{s['draft_s']:.2f} s + target passes and checks {s['verify_s']:.2f} s + other {other:.2f} s "
            f"(events, text, the loop; on a busy machine, waiting for a core) → **{s['tokens_per_s']:.1f} tokens/s**"
        )
        share = s.get("cpu_share")
        if share is not None and share < BUSY_CPU_SHARE:
            lines.append(
                f"- ⚠ **Busy machine:** this run got {share:.0%} of the cores it asked for (other work held the rest): "
                "its speed says as much about the machine as about the method; the Race measures it in pairs."
            )
    else:
        lines.append(
            f"- **Time:** {s['wall_s']:.2f} s until the last completed pass → {s['tokens_per_s']:.1f} tokens/s"
        )
    return lines


def run_card(trace: list[dict], source: str = "") -> str:
    """Markdown summary of a finished or stopped run."""
    start = start_event(trace or [])
    if not start:
        return "No run yet."
    s = run_summary(trace)
    return "\n".join(_card_header(start, s, source) + _card_numbers(s))
