"""The Parity lab: greedy speculative decoding must reproduce greedy plain decoding token for token.

For each prompt the lab runs both (engine.tools.parity.parity_check) and, at the first difference, reports
the target's top-2 margin there: a numerical near-tie (rounding picked one of two almost equal tokens)
or a real mismatch (a bug).
"""

from __future__ import annotations

import json
import logging
import time

import gradio as gr

from visuals import show_token

from ..config import ASSETS
from ..drafter_help import drafter_choices
from ..engine_access import builds_on_first_use, get_engine, is_loaded, use_drafter
from ..inputs import number
from ..stopping import show_progress, stop_requested
from ..wiring import run_stop_buttons
from ..zerogpu import measured_on
from .panels import lab_tab, results_table, status_box, wire_lab_run

__all__ = ["build_tab", "default_parity_prompts", "run_parity"]

# The run"s inputs (controls, in the order the run takes them) and outputs (results).
INPUTS = ["prompts", "drafter", "dtype", "max_new", "k", "strict"]
OUTPUTS = ["status", "table"]

log = logging.getLogger("speclens.app")

MAX_PARITY_PROMPTS = 20
MAX_NEW = 64
MAX_K = 16
PROMPT_SHOWN = 60  # characters of a prompt shown in the table
NEAR_TIE = "numerical near-tie"  # engine.tools.parity's verdicts
REAL_MISMATCH = "real mismatch"
PARITY_HEADERS = [
    "#",
    "prompt",
    "result",
    "tokens per pass",
    "baseline token",
    "speculative token",
    "top-2 margin",
    "verdict",
]

PARITY_TEXT = """
**Greedy parity, measured.** With temperature 0 the target always emits its top token, so speculative decoding
must reproduce plain decoding **token for token**. For each prompt this lab runs, now and on this machine, the
greedy **baseline** (no drafter) and greedy **speculative** decoding, and compares the tokens. At the first
difference it recomputes the target's logits for the shared prefix and reports the **top-2 margin**: below the
dtype's tolerance (0.01 in float32, 1.0 in bfloat16) the two best tokens were practically tied and rounding picked
one (a *numerical near-tie*); above it the target clearly preferred one token (a *real mismatch*, a bug).
**Strict** mode pads every target pass, the baseline's included, to one shape, so both compute bitwise the same
numbers in any dtype (slower; for checking only). On a CPU with AVX512-BF16, bfloat16 runs on SpecLens's own kernels,
which compute every token of a pass on its own: there bf16 is bitwise identical even without strict mode.
"""


def default_parity_prompts(n: int = 4) -> str:
    prompts = []
    try:
        for line in (ASSETS / "parity_prompts.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                prompts.append(json.loads(line)["prompt"])
            if len(prompts) >= n:
                break
    except (OSError, ValueError, KeyError, TypeError):
        log.exception("cannot read assets/parity_prompts.jsonl")
    return "\n".join(prompts) or "What is the capital of France?\nList three fruits that are red."


def _parity_row(result: dict) -> list:
    prompt = result["prompt"] if len(result["prompt"]) <= PROMPT_SHOWN else result["prompt"][: PROMPT_SHOWN - 1] + "…"
    head = [result["index"] + 1, prompt]
    if result.get("identical"):
        tokens = f"identical ({result['baseline_tokens']} tokens)"
        return [*head, tokens, f"{result['tokens_per_pass']:.2f}", "—", "—", "—", "✓ identical"]
    return [
        *head,
        f"first differs at token {result.get('position')}",
        f"{result['tokens_per_pass']:.2f}",
        show_token(result.get("baseline_token")),
        show_token(result.get("speculative_token")),
        f"{result.get('margin', 0.0):.4f} (tolerance {result.get('tolerance')})",
        ("≈ numerical near-tie" if result.get("verdict", "?") == NEAR_TIE else "✗ real mismatch"),
    ]


def _summary(results: list[dict], lab: dict, seconds: float) -> str:
    same = sum(r["identical"] for r in results)
    ties = sum(r.get("verdict") == NEAR_TIE for r in results)
    bugs = sum(r.get("verdict") == REAL_MISMATCH for r in results)
    mode = "strict (every pass padded to one shape)" if lab["strict"] else "normal"
    summary = (
        f"**{len(results)} prompts: {same} identical, {ties} numerical near-tie{'s' if ties != 1 else ''}, "
        f"{bugs} real mismatch{'es' if bugs != 1 else ''}** ({lab['dtype']}, {lab['drafter']}, K = {lab['k']}, "
        f"{lab['max_new']} new tokens, {mode}; {seconds:.0f} s, {measured_on(lab['device'])})."
    )
    if bugs:
        return summary + " A real mismatch means the target clearly preferred the baseline's token: that is a bug."
    if ties:
        return summary + (
            " Near-ties are rounding: a pass over several tokens can round differently from a one-token pass, "
            "which flips a choice between two almost equal logits. Strict mode removes it."
        )
    return summary + " Speculative decoding changed how many target passes were needed, not the text."


def _checked(prompts_text, drafter, dtype, max_new_tokens, k, strict) -> dict:
    prompts = [line.strip() for line in str(prompts_text or "").splitlines() if line.strip()]
    if not prompts:
        raise gr.Error("Enter at least one prompt (one per line).")
    if len(prompts) > MAX_PARITY_PROMPTS:
        raise gr.Error(f"At most {MAX_PARITY_PROMPTS} prompts per run (got {len(prompts)}).")
    if dtype not in ("float32", "bfloat16"):
        raise gr.Error(f"dtype must be float32 or bfloat16, got {dtype!r}.")
    lab = {
        "prompts": prompts,
        "dtype": dtype,
        "max_new": number(max_new_tokens, "Max new tokens", 1, MAX_NEW, integer=True),
        "k": number(k, "K", 1, MAX_K, integer=True),
        "drafter": (drafter or "").strip(),
        "strict": bool(strict),
    }
    if lab["drafter"] in ("", "none", "baseline"):
        raise gr.Error("Choose a drafter (ngram, suffix, int8, eagle or model:<id>): the baseline runs anyway.")
    return lab


def run_parity(
    prompts_text,
    drafter,
    dtype,
    max_new_tokens,
    k,
    strict,
    run_id: str = "",
    progress=gr.Progress(),  # noqa: B008
):
    """Generator: greedy baseline vs greedy speculative decoding per prompt; yields (status, table rows)."""
    from engine.tools.parity import parity_check

    lab = _checked(prompts_text, drafter, dtype, max_new_tokens, k, strict)
    prompts, drafter = lab["prompts"], lab["drafter"]
    if not is_loaded("default", dtype):
        yield f"Loading the model in {dtype} (once per server)…", gr.skip()
    engine = get_engine("default", dtype, progress)
    lab["device"] = engine.target.model.device
    if builds_on_first_use(drafter):
        yield f"Preparing drafter **{drafter}** (first use builds it)…", gr.skip()
    use_drafter(engine, drafter)
    rows: list[list] = []
    results: list[dict] = []
    checks = parity_check(
        engine, prompts, drafter=drafter, max_new_tokens=lab["max_new"], k=lab["k"], strict=lab["strict"]
    )
    started = time.perf_counter()
    try:
        for i in range(len(prompts)):
            if stop_requested(run_id):
                yield f"■ Stopped after {len(results)} of {len(prompts)} prompts.", rows
                return
            show_progress(progress, i / len(prompts), f"prompt {i + 1}/{len(prompts)}: baseline, then {drafter}")
            yield f"Prompt {i + 1}/{len(prompts)}: greedy baseline, then greedy with {drafter}…", gr.skip()
            try:
                result = next(checks)
            except ValueError as exc:
                raise gr.Error(f"Prompt {i + 1}: {exc}") from None
            results.append(result)
            rows = rows + [_parity_row(result)]
            yield f"Checked {len(results)}/{len(prompts)} prompts…", rows
    finally:
        checks.close()
    yield _summary(results, lab, time.perf_counter() - started), rows


def _controls() -> dict:
    c = {}
    c["prompts"] = gr.Textbox(
        default_parity_prompts(4),
        lines=6,
        max_lines=20,
        label=f"Prompts, one per line (at most {MAX_PARITY_PROMPTS})",
        elem_id="pl-prompts",
    )
    c["run_btn"], c["stop_btn"] = run_stop_buttons("▶ Check parity", "pl-run", "pl-stop")
    c["drafter"] = gr.Dropdown(
        drafter_choices(vllm=False, baseline=False),
        value="ngram",
        allow_custom_value=True,
        label="Drafter",
        info="or type model:<id> for a separate draft model",
    )
    c["dtype"] = gr.Radio(["float32", "bfloat16"], value="float32", label="Precision (dtype)")
    c["max_new"] = gr.Slider(1, MAX_NEW, 16, step=1, label="Max new tokens", elem_id="pl-max-new")
    c["k"] = gr.Slider(1, MAX_K, 4, step=1, label="K (draft depth)")
    c["strict"] = gr.Checkbox(
        False, label="Strict: pad every target pass to one shape (bitwise identical, slower)", elem_id="pl-strict"
    )
    return c


def _results() -> dict:
    status = status_box(
        "*Press **Check parity** to run each prompt twice (baseline and speculative, greedy).*", "pl-status"
    )
    widths = ["5%", "26%", "13%", "9%", "10%", "13%", "10%", "14%"]
    not_run = [["—", "(press Check parity)", "—", "—", "—", "—", "—", "not run"]]
    return {"status": status, "table": results_table(not_run, PARITY_HEADERS, "Per prompt", widths, "pl-table")}


def _wire(c: dict, out: dict) -> None:
    wire_lab_run(c, out, run_parity, INPUTS, OUTPUTS)


def build_tab() -> gr.Tab:
    return lab_tab("Parity lab", "parity", PARITY_TEXT, _controls, _results, _wire)
