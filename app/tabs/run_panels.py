"""The Playground's two panels about where a run goes next: the model (target, precision, the CPU kernel that
computes its passes, and the memory a run with these settings needs, planned before anything loads), and the
command that turns the same drafting on in a production engine (vLLM, SGLang, llama.cpp, transformers).

Both read only the Playground's controls and answer without running a model.
"""

from __future__ import annotations

import gradio as gr

from engine.model.loading import DEFAULT_MODEL, DTYPES, PRESETS

from .. import config, zerogpu
from ..engine_access import VLLM_DRAFTER
from ..inputs import as_int
from ..wiring import PRIVATE

__all__ = ["LAUNCH_ENGINES", "launch_controls", "launch_text", "launch_view", "memory_plan", "model_controls", "wire"]


def _target_choices() -> list[str]:
    return [DEFAULT_MODEL] + [name for name in PRESETS if name != DEFAULT_MODEL]


LAUNCH_ENGINES = [("vLLM", "vllm"), ("SGLang", "sglang"), ("llama.cpp", "llama.cpp"), ("transformers", "transformers")]


def launch_view(engine_name, target, drafter, k, topk, budget, temperature, adaptive, verify="token"):
    """The command that turns the current drafting on in a production engine (engine.tools.launch), as the
    Command box's update, and its notes: what differs, or why there is no equivalent."""
    command, language, notes = launch_text(engine_name, target, drafter, k, topk, budget, temperature, adaptive, verify)
    return gr.Code(value=command, language=language), notes


def launch_text(engine_name, target, drafter, k, topk, budget, temperature, adaptive, verify="token"):
    """(command, its language, notes markdown) for launch_view; the command "" where there is none. Plain values:
    a component made while the page is built would be placed on it (the panel showed a second, stale box)."""
    from engine.tools.launch import launch_command

    try:
        result = launch_command(
            engine_name or "vllm",
            drafter if drafter != VLLM_DRAFTER else "none",
            as_int(k, "K"),
            as_int(topk, "tree topk"),
            as_int(budget, "tree budget") or None,
            target or DEFAULT_MODEL,
            float(temperature or 0.0),
            bool(adaptive),
            verify or "token",
        )
    except (ValueError, gr.Error) as exc:
        return "", "shell", f"*{exc}*"
    language = "python" if result["engine"] == "transformers" else "shell"
    notes = "\n".join(f"- {note}" for note in result["notes"])
    return result["command"] or "", language, notes


def launch_controls(c: dict, start: dict, s: dict) -> None:
    with gr.Accordion("Turn it on in your engine", open=False, elem_classes=["sl-settings"]):
        c["launch_engine"] = gr.Radio(
            LAUNCH_ENGINES,
            value="vllm",
            label="Production engine",
            info="The command that gives it the drafting set above (SpecLens's own drafters where it has them).",
        )
        command, _, notes = launch_text(
            "vllm",
            DEFAULT_MODEL,
            start.get("drafter") or "ngram",
            s.get("k", 4),
            s.get("topk", 1),
            0,
            s.get("temperature", 0.0),
            False,
        )
        c["launch_code"] = gr.Code(value=command, language="shell", label="Command", elem_id="sl-launch", lines=3)
        c["launch_notes"] = gr.Markdown(notes, elem_id="sl-launch-notes")


def _kernel_note() -> str:
    """Which of our CPU kernel variants computes the passes here, and why (or why none)."""
    from engine.kernels import cpu_build

    kernel = cpu_build.describe()
    if kernel["variant"] is None:
        return f"*CPU kernels: none here ({kernel['reason']}); torch's own ops compute the passes.*"
    return f"*CPU kernels: **{kernel['variant']}**, {kernel['label']} ({kernel['reason']}).*"


def memory_plan(target, drafter, dtype, k, topk, budget, max_new_tokens) -> str:
    """What a run with these settings needs in memory (engine.tools.memory_plan, sized before any load) against
    what this machine has free; a plan that does not fit says so with the numbers."""
    if drafter == VLLM_DRAFTER:
        return "*The vLLM server holds its own model and caches: nothing is loaded here.*"
    from engine.tools.memory_plan import plan_memory

    try:
        config.check_model_allowed(target or "default")
        plan = plan_memory(
            target or "default",
            (drafter or "none").strip(),
            dtype=dtype or "auto",
            device=zerogpu.app_device(),  # (on ZeroGPU the app's engine is the CPU one)
            k=as_int(k, "K"),
            topk=as_int(topk, "tree topk"),
            num_draft_tokens=as_int(budget, "tree budget") or None,
            max_new_tokens=as_int(max_new_tokens, "max_new_tokens"),
            prompt_tokens=config.MAX_PROMPT_TOKENS,
            concurrent_runs=config.MAX_CONCURRENT_RUNS,
        )
    except ValueError as exc:
        return f"*Cannot plan: {exc}*"
    verdict = "fits" if plan.fits else "**does not fit**: choose a smaller model, K or tree, or fewer concurrent runs"
    return f"*Memory plan ({config.MAX_CONCURRENT_RUNS} concurrent runs, prompts up to {config.MAX_PROMPT_TOKENS} tokens): {plan.describe()}. It {verdict}.*"


def model_controls(c: dict) -> None:
    with gr.Accordion("Model", open=False, elem_classes=["sl-settings"]):
        c["target"] = gr.Dropdown(
            choices=_target_choices(),
            value=DEFAULT_MODEL,
            label="Target model",
            info="The model whose output you get. Only the default runs offline; the "
            "others download from the Hugging Face Hub.",
        )
        c["dtype"] = gr.Radio(
            list(DTYPES),
            value="auto",
            label="Precision (dtype)",
            info="auto = bfloat16 where our CPU kernels (or a GPU) run, else float32. q4_1 = the default model's "
            "own 4-bit GGUF blocks on our kernels: fewest bytes per token.",
        )
        gr.Markdown(_kernel_note(), elem_id="sl-kernel")
        c["memory_btn"] = gr.Button("Check memory for these settings", size="sm", elem_id="sl-memory-btn")
        c["memory"] = gr.Markdown("", elem_id="sl-memory")


def wire(c: dict) -> None:
    """The memory plan on request, and the launch command following the drafting controls (and the engine)."""
    plan_inputs = [c[key] for key in ("target", "drafter", "dtype", "k", "topk", "budget", "max_new")]
    c["memory_btn"].click(memory_plan, plan_inputs, [c["memory"]], show_progress="hidden", **PRIVATE)
    # The launch command follows the drafting controls (and the engine chosen), computed here, no model needed.
    launch_inputs = [c[key] for key in ("launch_engine", "target", "drafter", "k", "topk", "budget", "temperature")]
    launch_inputs += [c["adaptive"], c["verify"]]
    gr.on(
        [
            c[key].change
            for key in ("launch_engine", "drafter", "k", "topk", "budget", "temperature", "adaptive", "verify")
        ],
        launch_view,
        launch_inputs,
        [c["launch_code"], c["launch_notes"]],
        show_progress="hidden",
        queue=False,
        **PRIVATE,
    )
