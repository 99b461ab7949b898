"""A trained EAGLE head measured with the real engine, and kept only where it drafts better.

``greedy_acceptance`` runs the engine's ``eagle`` drafter, greedy K = 4 chains, over prompts and reports
tokens per target pass and acceptance by depth, as a head's model card states them; ``held_out_acceptance``
loads a head folder first. ``install_if_better`` weighs a newly trained head against the one already
installed on the same held-out prompts (head_data.held_out_texts, which no head trains on) and copies its
files over only if it drafts more tokens per pass, so a retraining never silently makes drafting worse.
Apart from engine/training/train_head.py (the recipe's stages) because it runs the engine, not the training.
"""

from __future__ import annotations

import sys
from pathlib import Path

from engine.drafters.eagle import HEAD_FILE
from engine.training.head_data import held_out_texts

__all__ = ["HEAD_FILES", "greedy_acceptance", "held_out_acceptance", "install_if_better"]


def held_out_acceptance(engine, folder: Path, prompts: list[str], max_new: int) -> dict:
    """Greedy K=4 chains with the head in `folder` (loaded into the engine) on held-out prompts, measured with
    the real engine."""
    from engine.drafters.eagle import load_head

    engine.use_eagle_head(load_head(engine.target.model, engine.target.name, folder))
    return greedy_acceptance(engine, prompts, max_new)


def greedy_acceptance(engine, prompts: list[str], max_new: int) -> dict:
    """The engine's `eagle` drafter (its current head), greedy K=4 chains over `prompts`: tokens per
    target pass and acceptance by depth, as the model card reports them."""
    from engine.metrics import summarize_steps

    steps = []
    for prompt in prompts:
        run = engine.run(prompt, "eagle", max_new_tokens=max_new, k=4, temperature=0.0)
        steps += [e for e in run["events"] if e.get("type") == "step"]
    m = summarize_steps(steps, 4, 1.0)
    return {
        "prompts": len(prompts),
        "tokens_per_pass": round(m["tokens_per_pass"], 3),
        "acceptance_rate": round(m["acceptance_rate"], 3),
        "position_acceptance": round(m["position_acceptance"], 3),
        "acceptance_by_depth": [round(a, 3) if a is not None else None for a in m["acceptance_by_position"]],
    }


HEAD_FILES = (HEAD_FILE, "README.md", "training-curves.json", "held-out.json")


def install_if_better(engine, candidate: Path, final: Path, max_new: int) -> dict:
    """Measure the head in `final` and the one in `candidate` on the same held-out prompts
    (head_data.held_out_texts: the benchmark workloads and app examples, which no head trains on), greedy
    K = 4 chains; copy the candidate's files over `final` only if it drafts more tokens per pass. The
    engine keeps the head that is in `final` afterwards."""
    import shutil

    prompts = sorted(held_out_texts())
    current = held_out_acceptance(engine, final, prompts, max_new)
    new = held_out_acceptance(engine, candidate, prompts, max_new)
    replaced = new["tokens_per_pass"] > current["tokens_per_pass"]
    if replaced:
        for name in HEAD_FILES:
            if (candidate / name).exists():
                shutil.copy2(candidate / name, final / name)
    else:
        held_out_acceptance(engine, final, prompts[:1], 1)  # the engine back on the kept head
    verdict = "replaced" if replaced else "kept: the current head drafts at least as many tokens per pass"
    print(
        f"train-head: held-out tokens per pass, current {current['tokens_per_pass']} against new "
        f"{new['tokens_per_pass']}: {verdict} ({final})",
        file=sys.stderr,
    )
    return {"measure": "held_out_texts, greedy K=4", "current": current, "new": new, "replaced": replaced}
