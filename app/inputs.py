"""UI and API values -> checked numbers, or a gr.Error naming the field.

Gradio hands handlers what the browser (or an API client) sent: floats for integer sliders,
None or "" for an emptied box, strings from raw HTTP clients. These helpers accept exactly
the values a field may hold and say what is wrong with anything else.
"""

from __future__ import annotations

import math
import random

import gradio as gr

__all__ = ["as_int", "number", "random_seed", "seed_or_random"]

MAX_SEED = 2**31 - 1


def _missing(value) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def as_int(value, name: str) -> int:
    """An integer given as int, integral float or numeric string."""
    if isinstance(value, bool):
        raise gr.Error(f"{name} must be an integer, got {value!r}")
    try:
        number_ = float(value)
    except (TypeError, ValueError):
        raise gr.Error(f"{name} must be an integer, got {value!r}") from None
    if not math.isfinite(number_) or number_ != int(number_):
        raise gr.Error(f"{name} must be an integer, got {value!r}")
    return int(number_)


def number(value, name: str, lo: float, hi: float, integer: bool = False) -> float:
    """A finite number in [lo, hi] (a whole number if `integer`)."""
    if isinstance(value, bool) or _missing(value):
        raise gr.Error(f"{name} is missing: enter a number between {lo:g} and {hi:g}.")
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise gr.Error(f"{name} must be a number, got {value!r}.") from None
    if not math.isfinite(result) or not lo <= result <= hi:
        raise gr.Error(f"{name} must be between {lo:g} and {hi:g}, got {value!r}.")
    if integer:
        if result != int(result):
            raise gr.Error(f"{name} must be a whole number, got {value!r}.")
        return int(result)
    return result


def random_seed() -> int:
    return random.SystemRandom().randrange(MAX_SEED + 1)


def seed_or_random(value) -> int:
    """The seed to use: the given one, or a fresh random one for a blank box or -1."""
    if _missing(value):
        return random_seed()
    seed = number(value, "Seed", -1, MAX_SEED, integer=True)
    return random_seed() if seed < 0 else seed
