"""Your deployment: does speculation pay on the user's own server? Its /metrics read as a window of traffic.

The window comes from two scrapes of a vLLM, llama.cpp or SpecLens /metrics (typed URL, where the operator
allows the app to fetch one), from a file saved by `python -m engine analyze URL --save FILE`, or from a
window recorded on the real vLLM CPU server (assets/scrapes). engine/tools/analyze.py reads it; the pass
costs are typed or timed through the server's OpenAI API (engine/tools/pass_costs.py). This module only
moves those between the controls and the page; every number on it was decided by the analyzer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gradio as gr

from engine.tools.analyze import AnalyzeError, analyze, load_recording, model_note, record, ticket
from engine.tools.pass_costs import parse_pass_costs, probe_pass_costs
from engine.tools.per_request import break_even_of, read_requests, request_distribution
from visuals.deployment import REQUESTS_TITLE, acceptance_window_figure, expected_speedup_figure, requests_figure

from ..config import ASSETS, scrape_allowed
from .panels import lab_tab, results_plot, status_box

__all__ = [
    "RECORDED",
    "RECORDED_REQUESTS",
    "analyze_window",
    "build_tab",
    "pass_costs_text",
    "load_saved",
    "probe",
    "read_requests_file",
    "scrape_window",
    "window_result",
]

log = logging.getLogger("speclens.app")

SCRAPES = ASSETS / "scrapes"
# Windows recorded on the real vLLM CPU server (scripts/record_deployment_windows.py), by their label.
RECORDED = {
    "vLLM on CPU, n-gram K = 8: code edits (recorded)": SCRAPES / "vllm-ngram-code-edit.json",
    "vLLM on CPU, n-gram K = 8: chat (recorded)": SCRAPES / "vllm-ngram-chat.json",
}
# Responses of the real vLLM CPU server with their own speculative metrics (scripts/record_per_request.py).
RECORDED_REQUESTS = SCRAPES / "vllm-ngram-requests.jsonl"
MAX_REQUESTS_BYTES = 20 * 1024 * 1024
REQUESTS_WAITING = (
    "Upload a log of responses from a server started with `--per-request-spec-decode-metrics summary` (one JSON "
    "per line), or read the recorded one: which requests speculation pays for, and which it does not."
)
MAX_INTERVAL_S = 300
MODEL_TOLERANCE = 0.2  # beyond this the cost model's ms per pass and the server's own are said to disagree

TEXT = """
**Does speculation pay on your server?** vLLM, llama.cpp and SpecLens count what their drafters do
(`*:spec_decode_num_drafts`, `…_draft_tokens`, `…_accepted_tokens`, `…_accepted_tokens_per_pos`). Two scrapes
of those counters around real traffic are a **window**: its draft **acceptance rate** and its **mean acceptance
length** (read them side by side: the rate can fall while the length holds), the share of drafting passes
that kept each position, and the **α** of the chain that fits them. With what a pass costs on that server
(typed, or timed through its OpenAI API), they give the **expected** speedup for each K and each number of
concurrent requests, and a recommendation. Expected means modelled from measured inputs: of whole requests
where the server counts per-request times (vLLM: each request's time outside its decode passes, which speculation
does not shrink, included), else of decode passes only; racing the server measures the real thing. Checked
against real batches on the vLLM CPU server (n-gram at K = 2, 4, 8, 1 to 16 concurrent requests, code edits and
chat, four runs; docs/vllm.md), the expected speedups came within 10% of the measured ones (median over 120
cells; 9–16% in each run), on the same side of 1× in all but one of them.
"""

WAITING = "Pick a recorded window, upload a saved one, or scrape a server."


def _source_note() -> str:
    if scrape_allowed():
        return "Scrapes are fetched by this app's server: give an address it can reach."
    return (
        "This public app does not fetch addresses for visitors. Record a window where your server runs — "
        "`python -m engine analyze http://HOST:PORT --interval 60 --save window.json` — and upload the file."
    )


def window_result(window: dict, pass_text: str) -> dict:
    """The analyzer's reading of a window with the pass costs typed (the window's own recorded or probed costs
    where the text is theirs, untouched); AnalyzeError for a window or costs it cannot use. The tab and the
    `analyze_metrics` API both read windows through here."""
    costs = None
    if (pass_text or "").strip():
        costs = parse_pass_costs(pass_text, k=(window.get("pass_costs") or {}).get("k"))
        saved = window.get("pass_costs") or {}
        if pass_costs_text(saved) == pass_costs_text(costs):
            costs = saved
    return analyze(window["before"], window["after"], window.get("interval_s"), costs)


def analyze_window(window: dict | None, pass_text: str):
    """(status markdown, acceptance figure, speedup figure) of a window with the pass costs typed."""
    if not window:
        return (WAITING, *_empty())
    try:
        result = window_result(window, pass_text)
    except AnalyzeError as exc:
        return (f"**Cannot analyse this window:** {exc}", *_empty())
    return _summary(window, result), acceptance_window_figure(result), expected_speedup_figure(result)


def _empty():
    from visuals.style import message_figure

    return (
        message_figure("Acceptance in the window", WAITING),
        message_figure("Expected speedup by K and batch size", WAITING),
    )


def _summary(window: dict, result: dict) -> str:
    seconds = f" in {result['interval_s']:.0f} s" if result.get("interval_s") else ""
    if result.get("gauges_only"):  # SGLang: what its gauges say, and what they cannot
        rate = result.get("acceptance_rate")
        return "\n".join(
            [
                f"**Window:** {window.get('url', 'a saved window')}{seconds} (SGLang's gauges).",
                "",
                "| draft acceptance rate | mean acceptance length |",
                "|---|---|",
                f"| {'—' if rate is None else f'{rate:.3f}'} | {result['mean_acceptance_length']:.2f} tokens per pass |",
                "",
                f"**What these can tell:** {result['recommendation']}.",
            ]
        )
    traffic = f"{result['requests']:.0f} requests, {result['tokens']:.0f} tokens" if result["requests"] else ""
    alpha = f"{result['alpha_fit']:.2f}" if result.get("alpha_fit") else "—"
    lines = [
        f"**Window:** {window.get('url', 'a saved window')}{seconds}. {traffic}",
        "",
        "| draft acceptance rate | mean acceptance length | drafting passes | fitted α | K on the server |",
        "|---|---|---|---|---|",
        f"| {result['acceptance_rate']:.3f} | {result['mean_acceptance_length']:.2f} tokens per pass | "
        f"{result['drafts']:.0f} | {alpha} | {result['k'] or '—'} |",
        "",
        f"**Recommendation (expected):** {result['recommendation']}.",
    ]
    if result.get("pass_costs"):
        costs = result["pass_costs"]
        lines.append(
            f"\nPass costs {costs.get('source') or 'given'}; speculation weighed against {costs['against']}. "
            f"Expected speedups are of {model_note(result)}."
        )
    if result.get("decode_passes"):
        passes = (
            f"\n**Passes in the window:** {result['decode_passes']:.0f} decode passes, "
            f"{result['drafting_share']:.0%} of them drafted, {result['tokens_per_pass']:.2f} tokens per pass"
        )
        if result.get("model_check"):
            check = result["model_check"]
            passes += (
                f"; {check['measured_ms']:.1f} ms per pass by the server's decode time, where the cost model gives "
                f"{check['model_ms']:.1f} ms; the window's own speedup against plain steps: "
                f"{result['window_speedup']:.2f}x"
            )
            miss = check["model_ms"] / check["measured_ms"] - 1
            if abs(miss) > MODEL_TOLERANCE:
                passes += (
                    f". **The cost model misses this window's passes by {miss:+.0%}**: the probe's short prompts "
                    "and this traffic differ (context length, load); read the table as rough and race the server "
                    "before deciding"
                )
        lines.insert(-1, passes + ".")
        lines.insert(-1, "")
    if result.get("best_k_by_batch"):
        # The same advice as one sentence with the line that turns it on (engine.tools.analyze.ticket; the server's
        # counters do not name its method: n-gram assumed, as the recorded windows ran, and said).
        lines.append(
            f"\n**For a ticket** (method assumed: n-gram; `analyze --drafter` names another):\n\n> {ticket(result)}"
        )
    if window.get("cpu"):
        lines.append(f"\nRecorded on {window['cpu']}, {window.get('recorded', '')}.")
    return "\n".join(lines)


def pass_costs_text(costs: dict | None) -> str:
    """The pass costs as the box shows them: "1:60.7/81.3, 4:77.2/110.0/128.5" (batch: plain / [half the
    requests drafting /] all drafting, ms)."""
    if not costs or not isinstance(costs.get("decode_ms"), dict) or not isinstance(costs.get("verify_ms"), dict):
        return ""
    verify = {int(b): ms for b, ms in costs["verify_ms"].items()}
    mixed = {int(b): ms for b, ms in (costs.get("mixed_ms") or {}).items()}
    decode = sorted((int(b), ms) for b, ms in costs["decode_ms"].items())
    return ", ".join(
        f"{b}:{float(ms):.1f}/" + (f"{float(mixed[b]):.1f}/" if b in mixed else "") + f"{float(verify[b]):.1f}"
        for b, ms in decode
        if b in verify
    )


def load_saved(path) -> tuple[dict | None, str, str]:
    """(window, pass costs text, message) of a saved window file (uploaded or recorded)."""
    if not path:
        return None, "", WAITING
    try:
        if Path(path).stat().st_size > 20 * 2**20:
            raise AnalyzeError("the file is larger than 20 MiB: a saved window is two scrapes")
        window = load_recording(str(path))
    except AnalyzeError as exc:
        return None, "", f"**Not a saved window:** {exc}"
    except OSError as exc:
        return None, "", f"**Cannot read the file:** {exc.strerror or exc}"
    window.setdefault("url", Path(path).name)
    return window, pass_costs_text(window.get("pass_costs")), ""


def scrape_window(url: str, interval: float):
    """(window, message): two scrapes of `url`, `interval` seconds apart, where the operator allows it."""
    if not scrape_allowed():
        return None, f"**Not here:** {_source_note()}"
    try:
        interval = float(interval)
        if not 1 <= interval <= MAX_INTERVAL_S:
            raise AnalyzeError(f"the interval must be between 1 and {MAX_INTERVAL_S} seconds")
        window = record((url or "").strip(), interval)
    except (AnalyzeError, ValueError, TypeError) as exc:
        return None, f"**Cannot scrape:** {exc}"
    return window, ""


def probe(url: str, window: dict | None, baseline_url: str = ""):
    """(pass costs text, window, message): the server's passes timed through its OpenAI API (and those of the
    same model without speculation, where its address is given)."""
    if not scrape_allowed():
        return gr.update(), window, f"**Not here:** {_source_note()} Or type the pass costs."
    if not window or window.get("url") != (url or "").strip():
        # Pass costs belong to the server they are timed on: never to a window of another server (a recorded one,
        # say), whose recommendation they would silently change.
        shown = (window or {}).get("url") or "none yet"
        return (
            gr.update(),
            window,
            f"**The window shown is not {url or 'this address'}'s** (it is {shown}): scrape this server first "
            "(**Scrape twice**), then time its passes; its pass costs go with its own window.",
        )
    try:
        result = probe_pass_costs((url or "").strip(), repeats=5, baseline_url=(baseline_url or "").strip() or None)
    except AnalyzeError as exc:
        return gr.update(), window, f"**Cannot time the server:** {exc}"
    log.info("probed %s: %s", url, json.dumps(result))
    window = {**window, "pass_costs": result}
    return pass_costs_text(result), window, ""


FIRST = "vLLM on CPU, n-gram K = 8: chat (recorded)"  # what the tab opens on: a real window, never empty


def read_requests_file(path, window: dict | None, pass_text: str):
    """(markdown, figure) of a log of responses read as a distribution of τ across requests
    (engine/tools/per_request.py), with the break-even from the window's pass costs where there are some."""
    from visuals.style import message_figure

    if not path:
        return REQUESTS_WAITING, message_figure(REQUESTS_TITLE, REQUESTS_WAITING)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(MAX_REQUESTS_BYTES + 1)
        if len(text) > MAX_REQUESTS_BYTES:
            raise AnalyzeError(f"the log is over {MAX_REQUESTS_BYTES // (1024 * 1024)} MiB")
        readings = read_requests(text)
        break_even, where = None, "no pass costs for this window: no break-even"
        if window and (pass_text or "").strip():
            try:
                costs = parse_pass_costs(pass_text, k=(window.get("pass_costs") or {}).get("k"))
                result = analyze(window["before"], window["after"], window.get("interval_s"), costs)
                break_even = break_even_of(result)
                where = "from the window's pass costs (batch 1, every pass drafting at its K)"
            except AnalyzeError:
                pass  # the window's own problem is said above the window's charts
        dist = request_distribution(readings, break_even)
    except (OSError, UnicodeDecodeError) as exc:
        return f"**Cannot read the log:** {exc}", message_figure(REQUESTS_TITLE, "Nothing read.")
    except AnalyzeError as exc:
        return f"**Cannot read the log:** {exc}", message_figure(REQUESTS_TITLE, "Nothing read.")
    q = dist["tau_quantiles"]
    lines = [
        f"**{dist['requests']} requests** ({' and '.join(dist['schemas'])} histograms): mean acceptance length τ "
        f"from {q['min']:.2f} to {q['max']:.2f}, median {q['median']:.2f}; the mean over requests "
        f"{dist['tau_request_mean']:.2f} beside {dist['tau_step_mean']:.2f} over verify steps (what /metrics gives: "
        "requests with more steps weigh more).",
    ]
    if dist["by_label"]:
        lines.append(
            "By workload: "
            + "; ".join(
                f"{k} median τ {v['tau_median']:.2f} ({v['requests']} request{'s' if v['requests'] != 1 else ''})"
                for k, v in dist["by_label"].items()
            )
            + "."
        )
    if break_even is not None:
        lines.append(
            f"Break-even τ {break_even:.2f} {where}: **{dist['paying']} of {dist['requests']} requests pay**, "
            f"{dist['not_paying']} {'does' if dist['not_paying'] == 1 else 'do'} not."
        )
    else:
        lines.append(f"Which requests pay needs a break-even τ: {where}.")
    return "\n\n".join(lines), requests_figure(readings, dist)


def _first() -> tuple:
    """(window, costs text, status, acceptance figure, speedup figure) of the window the tab opens on."""
    window, costs, message = load_saved(RECORDED[FIRST])
    return (window, costs, *_then_analyze(window, costs, message))


def _then_analyze(window, pass_text, message):
    status, fig_a, fig_s = analyze_window(window, pass_text)
    return (message or status), fig_a, fig_s


def _controls(first: tuple) -> dict:
    c = {}
    c["recorded"] = gr.Radio(list(RECORDED), label="A window recorded on the real vLLM CPU server", value=FIRST)
    c["upload"] = gr.File(label="…or a saved window (JSON)", file_types=[".json"], type="filepath")
    allowed = scrape_allowed()
    c["url"] = gr.Textbox(
        label="…or your server's address (its /metrics)",
        placeholder="http://127.0.0.1:8000",
        interactive=allowed,
        max_lines=1,
        elem_id="sl-deploy-url",
    )
    c["interval"] = gr.Slider(
        1, MAX_INTERVAL_S, value=30, step=1, label="seconds between the two scrapes", elem_id="sl-deploy-interval"
    )
    c["scrape"] = gr.Button("Scrape twice", interactive=allowed, elem_id="sl-deploy-scrape")
    gr.Markdown(_source_note(), elem_classes=["sl-note"])
    c["pass_ms"] = gr.Textbox(
        first[1],
        label="Pass costs, ms: batch : plain / half drafting / all drafting (at the server's K)",
        placeholder="1:63/83, 4:116/150/168, 16:180/330/395",
        max_lines=3,
        info="Typed, or timed below: one decode pass of B requests, none, half or all of them verifying K drafts.",
    )
    c["baseline_url"] = gr.Textbox(
        label="…and the same model without speculation (optional): what speculation is weighed against",
        placeholder="http://127.0.0.1:8001",
        interactive=allowed,
        max_lines=1,
    )
    c["probe"] = gr.Button("Time the servers' passes (their OpenAI API)", interactive=allowed)
    c["analyze"] = gr.Button("Analyse", variant="primary")
    c["window"] = gr.State(first[0])
    gr.Markdown("**Which requests pay?** Per-request metrics, read as a distribution.", elem_classes=["sl-note"])
    c["requests_recorded"] = gr.Button("Read 16 recorded responses (vLLM on CPU, n-gram K = 8)", size="sm")
    c["requests_upload"] = gr.File(
        label="…or a log of your server's responses (JSONL)", file_types=[".jsonl", ".json"], type="filepath"
    )
    return c


def _results(first: tuple) -> dict:
    out = {"status": status_box(first[2], "sl-deploy-status")}
    out["acceptance"] = results_plot("Acceptance in the window", WAITING, "sl-deploy-acceptance", first[3])
    out["speedup"] = results_plot("Expected speedup by K and batch size", WAITING, "sl-deploy-speedup", first[4])
    out["requests_status"] = gr.Markdown(REQUESTS_WAITING, elem_id="sl-deploy-requests-status")
    out["requests"] = results_plot(REQUESTS_TITLE, REQUESTS_WAITING, "sl-deploy-requests")
    return out


def _wire(c: dict, out: dict) -> None:
    shown = [out["status"], out["acceptance"], out["speedup"]]
    then_analyze = _then_analyze

    def from_recorded(label):
        window, costs, message = load_saved(RECORDED.get(label)) if label else (None, "", WAITING)
        return (window, costs, *then_analyze(window, costs, message))

    def from_upload(path):
        window, costs, message = load_saved(path)
        return (window, costs, *then_analyze(window, costs, message))

    def from_scrape(url, interval):
        # A new window starts without pass costs: those in the box were another window's (timed or typed there).
        window, message = scrape_window(url, interval)
        if window is None:
            return (gr.update(), gr.update(), message, gr.update(), gr.update())
        return (window, "", *then_analyze(window, "", message))

    def from_probe(url, window, baseline_url):
        costs, window, message = probe(url, window, baseline_url)
        text = costs if isinstance(costs, str) else ""
        status, fig_a, fig_s = analyze_window(window, text) if text else (message, gr.update(), gr.update())
        return (costs, window, message or status, fig_a, fig_s)

    c["recorded"].change(from_recorded, [c["recorded"]], [c["window"], c["pass_ms"], *shown])
    c["upload"].upload(from_upload, [c["upload"]], [c["window"], c["pass_ms"], *shown])
    c["scrape"].click(from_scrape, [c["url"], c["interval"]], [c["window"], c["pass_ms"], *shown], concurrency_limit=4)
    c["probe"].click(
        from_probe, [c["url"], c["window"], c["baseline_url"]], [c["pass_ms"], c["window"], *shown], concurrency_limit=1
    )
    c["analyze"].click(analyze_window, [c["window"], c["pass_ms"]], shown)
    per_request = [out["requests_status"], out["requests"]]
    c["requests_recorded"].click(
        lambda window, text: read_requests_file(str(RECORDED_REQUESTS), window, text),
        [c["window"], c["pass_ms"]],
        per_request,
    )
    c["requests_upload"].upload(read_requests_file, [c["requests_upload"], c["window"], c["pass_ms"]], per_request)


def build_tab() -> gr.Tab:
    first = _first()
    return lab_tab("Your deployment", "deployment", TEXT, lambda: _controls(first), lambda: _results(first), _wire)
