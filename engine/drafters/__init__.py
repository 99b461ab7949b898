"""Drafters: cheap guessers of the next tokens, behind one small interface (``base.Drafter``:
propose a draft tree, be told which path was accepted).

- ``base``: the interface, ``DraftTree``, ``TreeShape`` and ``NoDrafter`` (``none``, the baseline)
- ``ngram``: prompt lookup over prompt + generated text
- ``suffix``: suffix decoding over the context and the session's earlier answers
- ``model``: ``model:<id>`` (a small model of the same vocabulary) and ``int8`` (self-drafting)
- ``eagle``: a one-layer head over the target's own features (EAGLE-style)
- ``adaptive``: each pass's K from measured costs and recent acceptance
"""

from engine.drafters.base import Drafter, DraftTree, NoDrafter, TreeShape
from engine.drafters.model import ModelDrafter, int8_weights
from engine.drafters.ngram import NgramDrafter
from engine.drafters.suffix import SuffixDrafter

__all__ = [
    "DraftTree",
    "Drafter",
    "ModelDrafter",
    "NgramDrafter",
    "NoDrafter",
    "SuffixDrafter",
    "TreeShape",
    "int8_weights",
]
