"""Drafters: cheap guessers of the next tokens, behind one small interface (``base.Drafter``: propose a draft
tree, be told which path was accepted), each kind a family (``spec.Family``) registered by its own module.

Importing the package registers every family here, so a spec parses wherever any part of it is imported. A new
drafter is one module (its class, its ``Family``, one ``register`` call) and one line below.
"""

from engine.drafters import base, eagle, hybrid, model, multilevel, ngram, suffix  # noqa: F401  (registers)
from engine.drafters.base import Drafter, DraftTree, NoDrafter, TreeShape
from engine.drafters.spec import DrafterSpec, Family, families, family, parse, register

__all__ = [
    "DraftTree",
    "Drafter",
    "DrafterSpec",
    "Family",
    "NoDrafter",
    "TreeShape",
    "families",
    "family",
    "parse",
    "register",
]
