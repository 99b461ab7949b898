"""The text report of ``python -m engine analyze``: what the command prints of a window's analysis.

Each function takes the plain dict a tool returns (``analyze`` and ``ticket`` in engine/tools/analyze.py,
``measure_what_if`` in what_if.py, ``request_distribution`` in per_request.py) and gives the text to print,
so the report reads the same numbers ``--json`` prints. engine/cli.py parses the arguments, runs the tools
and prints this text; nothing here scrapes, times or measures.
"""

from __future__ import annotations

from engine.tools.analyze import model_note

__all__ = ["format_distribution", "format_report"]


def format_report(result: dict) -> str:
    """The whole report of an analysis: the window, the recommendation, the measured what-if where one ran,
    the sentence for a ticket and the per-request distribution where requests were read. SGLang's gauges
    (``gauges_only``) give the recommendation alone."""
    if result.get("gauges_only"):  # SGLang: gauges, not counters (engine.tools.analyze.gauge_reading)
        return f"recommendation: {result['recommendation']}"
    lines = _window_lines(result)
    lines.append(f"recommendation: {result['recommendation']}")
    if result.get("what_if"):
        lines += _what_if_lines(result["what_if"])
    lines.append(f"for a ticket: {result['ticket']}")
    if result.get("per_request"):
        lines.append(format_distribution(result["per_request"]))
    return "\n".join(lines)


def format_distribution(dist: dict) -> str:
    """Per-request τ (engine/tools/per_request.py ``request_distribution``): its quantiles, the verify steps by
    drafts accepted, τ by label and, with a break-even τ, how many requests speculation pays for."""
    q = dist["tau_quantiles"]
    lines = [
        f"per request ({dist['requests']} requests, {' and '.join(dist['schemas'])} histograms): mean acceptance "
        f"length τ min {q['min']:.2f}, p10 {q['p10']:.2f}, median {q['median']:.2f}, p90 {q['p90']:.2f}, max "
        f"{q['max']:.2f}; mean over requests {dist['tau_request_mean']:.2f} beside {dist['tau_step_mean']:.2f} over "
        "verify steps (what /metrics gives: requests with more steps weigh more)"
    ]
    total = sum(dist["histogram"]) or 1
    lines.append(
        "  verify steps by drafts accepted: "
        + ", ".join(f"{j}: {n / total:.0%}" for j, n in enumerate(dist["histogram"]))
    )
    for label, row in dist["by_label"].items():
        lines.append(
            f"  {label}: {row['requests']} request{'s' if row['requests'] != 1 else ''}, median τ {row['tau_median']:.2f}"
        )
    if dist["break_even"] is not None:
        lines.append(
            f"  with a break-even τ of {dist['break_even']:.2f} (a speculative pass's cost ÷ a plain one's): "
            f"{dist['paying']} of {dist['requests']} requests pay, {dist['not_paying']} "
            + ("does not" if dist["not_paying"] == 1 else "do not")
        )
    else:
        lines.append("  which requests pay needs a break-even τ: give --break-even, or pass costs (--probe, --pass-ms)")
    return "\n".join(lines)


def _window_lines(result: dict) -> list[str]:
    """The window's counters, passes, acceptance by position and, with pass costs, the expected speedup table."""
    lines = [
        f"{result['server']}: {result['drafts']:.0f} drafts in the window ("
        + (f"{result['requests']:.0f} requests, " if result["requests"] else "requests not counted by this server, ")
        + f"{result['tokens']:.0f} tokens)\n"
        f"draft acceptance rate {result['acceptance_rate']:.3f} beside mean acceptance length "
        f"{result['mean_acceptance_length']:.2f} tokens per drafting pass"
    ]
    if result["decode_passes"]:
        line = (
            f"{result['decode_passes']:.0f} decode passes, {result['drafting_share']:.0%} of them drafted: "
            f"{result['tokens_per_pass']:.2f} tokens per pass"
        )
        if result["window_pass_ms"]:
            line += f", {result['window_pass_ms']:.1f} ms per pass (the server's decode time)"
        lines.append(line)
    if result["acceptance_by_position"]:
        shares = ", ".join(f"{r:.3f}" for r in result["acceptance_by_position"])
        lines.append(f"acceptance by position: {shares}; fitted α = {result['alpha_fit']:.3f} (α^i)")
    if result.get("speedup_by_batch"):
        lines += _speedup_lines(result)
    return lines


def _speedup_lines(result: dict) -> list[str]:
    """The pass costs the window was weighed with, the model's check against the window, and the expected
    speedup by K and batch size."""
    costs = result["pass_costs"]
    lines = [
        f"pass costs ({costs['source'] or 'given'}; speculation weighed against {costs['against']}), "
        f"ms plain / speculative at K = {costs['k']}:",
        "  "
        + ", ".join(
            f"B={b}: {costs['decode_ms'][b]:.1f} / {costs['verify_ms'][b]:.1f}"
            for b in sorted(costs["decode_ms"])
            if b in costs["verify_ms"]
        ),
    ]
    if result.get("model_check"):
        check = result["model_check"]
        lines.append(
            f"model check at batch {check['batch']}: {check['model_ms']:.1f} ms per pass modelled, "
            f"{check['measured_ms']:.1f} ms measured; the window's own speedup {result['window_speedup']:.2f}x"
        )
    lines.append(f"expected speedup (K down, batch across), of {model_note(result)}:")
    batches = sorted(result["speedup_by_batch"])
    lines.append("  K  " + "".join(f"{f'B={b}':>8}" for b in batches))
    for k in sorted(result["speedup_by_batch"][batches[0]]):
        lines.append(f"  {k:<3}" + "".join(f"{result['speedup_by_batch'][b][k]:>7.2f}x" for b in batches))
    return lines


def _what_if_lines(report: dict) -> list[str]:
    """The measured what-if (engine/tools/what_if.py ``measure_what_if``): by batch size, the measured speedup
    with its spread beside the model's prediction and the acceptance the server ran at, and the verdict."""
    shape = report["shape"]
    lines = [
        f"what-if, measured: a drafter keeping drafts at {', '.join(f'{r:.2f}' for r in report['rates'])} by position "
        f"(τ = {report['tau']:.2f}), requests of {shape['prompt_tokens']:.0f} prompt and {shape['output_tokens_asked']} "
        f"output tokens, {report['settings']['repeats']} repeats per batch size"
    ]
    if report["synthetic"] is not True:
        lines.append(
            "  note: the what-if server does not say it runs synthetic rejection (vLLM shows its config only in dev "
            "mode): its acceptance is what it measured (below), not necessarily the rates asked"
        )
    accepted = report["modes"]["what-if"]["acceptance_rate"]

    def num(x, unit=""):
        return "—" if x is None else f"{x:.2f}{unit}"

    lines.append(
        f"  {'B':<4} {'measured (slowest–quickest repeat)':<36} {'predicted':>10} {'measured ÷ predicted':>21} {'acceptance':>11}"
    )
    for i, b in enumerate(report["batch_sizes"]):
        low, high = report["speedup_bounds"][i]
        measured = f"{num(report['speedup'][i], 'x')} ({num(low)}–{num(high)})"
        lines.append(
            f"  {b:<4} {measured:<36} {num(report['predicted'][i], 'x'):>10} "
            f"{num(report['measured_vs_predicted'][i]):>21} {num(accepted[i]):>11}"
        )
    lines.append(f"  verdict (measured): {report['verdict']}")
    return lines
