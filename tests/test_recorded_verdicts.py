"""A verdict is recomputable from its record alone: what a race measured and the host figures it read are
recorded beside its verdict, so neither the process's later history nor its run modes can change it."""

from __future__ import annotations

import json

from engine.metrics import MIN_PAIRS
from engine.tools.race import race, recompute_verdict

PROMPT = "Copy this: alpha beta gamma delta alpha beta gamma delta"
VERDICT_KEYS = ("pairs", "ratios", "speedup", "low", "high", "verdict", "implied_speedup", "ceiling", "note", "busy")


def test_every_verdict_of_a_recorded_race_is_recomputed_from_the_record_alone(tiny_engine):
    result = race(tiny_engine, PROMPT, "ngram", pairs=MIN_PAIRS, max_new_tokens=12, k=3, chat=False)
    saved = json.loads(json.dumps(result))  # what a trace file or the /race API holds
    assert len(saved["measured"]) == MIN_PAIRS and saved["measured_costs"]["quickest_pass_ms"] is not None
    # The process measures on: a much quicker pass than any of the race's would call the recorded machine busy
    # if the verdict read the live figure.
    tiny_engine.costs.quickest_pass_ms = saved["measured_costs"]["quickest_pass_ms"] / 100
    try:
        again = recompute_verdict(saved)
    finally:
        tiny_engine.costs.quickest_pass_ms = saved["measured_costs"]["quickest_pass_ms"]
    for key in VERDICT_KEYS:
        assert again[key] == saved[key], key


def test_run_modes_are_settings_recorded_in_the_start_event(tiny_engine):
    run = tiny_engine.run(PROMPT, "ngram", max_new_tokens=4, chat=False, pass_graphs="off", chain_verifier="walk")
    settings = run["events"][0]["settings"]
    assert settings["pass_graphs"] == "off" and settings["chain_verifier"] == "walk"
    assert run["metrics"]["pass_path"] == "eager"
