"""A new drafter is one class and one registered family: everything that lists, plans, launches or runs drafters
finds it through engine.drafters.spec, with no other file edited (engine/drafters/spec.py)."""

from __future__ import annotations

import pytest

from engine.drafters import spec as drafter_spec
from engine.drafters.base import DraftContext, Drafter, DrafterNeeds, DraftTree
from engine.drafters.spec import DrafterMemory, Family, parse


class RepeatDrafter(Drafter):
    """Proposes the last committed token again, `times` times in a row (a point mass: q = 1 on each)."""

    name = "repeat"
    needs = DrafterNeeds(point_mass=True)

    def __init__(self, times: int = 2):
        self.times = times

    def propose(self, context: DraftContext) -> DraftTree:
        tree = DraftTree(point_mass=True, stop="depth", facts={"repeated": context.tokens[-1]})
        for depth in range(1, min(self.times, context.shape.k) + 1):
            tree.tokens.append(context.tokens[-1])
            tree.parents.append(depth - 2)
            tree.depths.append(depth)
            tree.q_token.append(1.0)
        return tree


REPEAT = Family(
    "repeat",
    label="repeat (the last token again)",
    help="proposes the last token again: a toy drafter defined in a test",
    form="repeat[:TIMES]",
    build=lambda spec, registry, history: RepeatDrafter(*spec.numbers),
    kind="copying",
    numbers=1,
    memory=lambda spec, sizes: DrafterMemory(note="repeat drafter: holds nothing"),
    order=15,
)


@pytest.fixture
def repeat_family():
    drafter_spec.register(REPEAT)
    yield REPEAT
    drafter_spec._FAMILIES.pop(REPEAT.name)


def test_a_family_registered_in_a_test_is_parsed_listed_planned_and_launched(repeat_family):
    from app.drafter_help import drafter_choices, single_drafters
    from engine.cli import _build_parser
    from engine.tools.launch import ENGINES, launch_command
    from engine.tools.memory_plan import plan_memory

    assert parse("repeat:3").family == "repeat" and parse("repeat:3").numbers == (3,)
    assert parse("q4+repeat").copy.family == "repeat"  # a copying family composes like ngram and suffix
    with pytest.raises(ValueError, match=r"repeat\[:TIMES\]"):
        parse("repeat:1,2")
    generate = _build_parser()._subparsers._group_actions[0].choices["generate"]
    assert "repeat[:TIMES]" in " ".join(generate.format_help().split())
    assert ("repeat (the last token again)", "repeat") in drafter_choices()
    assert "repeat" in single_drafters()
    for engine in ENGINES:
        launched = launch_command(engine, "repeat:3")
        assert launched["command"] is None and not launched["equivalent"]
        assert (
            launched["notes"][0]
            == f"{engine}: no equivalent for repeat: SpecLens's drafter 'repeat' has no counterpart here"
        )
    plan = plan_memory("SmolLM2-135M-Instruct", "repeat:3", available_bytes=10**10)
    assert plan.drafter == "repeat:3" and plan.drafter_bytes == 0 and "repeat drafter: holds nothing" in plan.notes


def test_the_registered_family_runs_in_the_engine_exactly(repeat_family, tiny_engine):
    """Greedy output with the toy drafter equals the baseline's, and its facts reach the step events."""
    prompt = [101, 2202, 2202, 2202, 3303]
    base = tiny_engine.run(prompt, "none", chat=False, max_new_tokens=12, temperature=0.0)
    run = tiny_engine.run(prompt, "repeat:3", chat=False, max_new_tokens=12, temperature=0.0, k=3)
    assert run["token_ids"] == base["token_ids"]
    steps = [e for e in run["events"] if e["type"] == "step"]
    assert run["events"][0]["family"] == "repeat"
    assert steps and all(step["draft"]["repeated"] in prompt + run["token_ids"] for step in steps)
