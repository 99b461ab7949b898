"""Drafters by name: a spec (``ngram:6,2``, ``int8``, ``model:<id>``...) -> a fresh drafter for one run.

Model weights (the int8 copy, a draft model, the EAGLE head) are built once per target and shared
read-only; the per-run state (a drafter's KV cache, its index of the context) is new for every drafter
built, so concurrent runs never share it.
"""

from __future__ import annotations

import threading

from engine.drafters.base import Drafter, NoDrafter
from engine.drafters.eagle import EagleDrafter, EagleHead, load_head
from engine.drafters.hybrid import HybridDrafter, parse_hybrid
from engine.drafters.model import ModelDrafter, int8_weights, q4_weights
from engine.drafters.multilevel import MultiLevelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.drafters.suffix import SuffixDrafter
from engine.model.loading import LoadedModel, check_same_vocab, load_model

__all__ = ["DRAFTER_SPECS", "DrafterRegistry", "spec_numbers"]

DRAFTER_SPECS = (
    "none, ngram[:MAX[,MIN[,WINDOW[,PER_MATCH]]]], suffix[:MAX[,MIN]], int8, q4, eagle, model:<id>,"
    " MODEL+COPY (drafts of drafts: q4+ngram, int8+suffix...),"
    " or COPY/MODEL[:DEPTH] (hybrid, each pass the one that pays: suffix/q4, ngram/int8:3...)"
)


def spec_numbers(spec: str, form: str, most: int) -> list[int]:
    """The numbers after a drafter spec's colon ("suffix:24,3" -> [24, 3]); [] without a colon."""
    if ":" not in spec:
        return []
    try:
        numbers = [int(x) for x in spec.split(":", 1)[1].split(",")]
    except ValueError:
        numbers = []
    if not 1 <= len(numbers) <= most:
        raise ValueError(f"the drafter takes {form}, got {spec!r}")
    return numbers


class DrafterRegistry:
    """The drafters one target can run with, and the weights they share."""

    def __init__(self, target: LoadedModel, stop_ids: frozenset[int], allow_remote_code: bool = False):
        self.target = target
        self.stop_ids = stop_ids  # never drafted by the copying drafters (template markers, EOS)
        self.allow_remote_code = allow_remote_code
        self._weights: dict[str, object] = {}
        self._head: EagleHead | None = None  # the EAGLE head, loaded at the first eagle run
        self._lock = threading.Lock()

    def build(self, spec: str, history: list[list[int]] = ()) -> Drafter:
        """A fresh drafter for one run; history: earlier answers (token ids) the suffix drafter may copy."""
        if not isinstance(spec, str):
            raise ValueError(f"drafter must be a string, got {spec!r}")
        spec = spec.strip()
        if spec in ("none", "", "baseline"):
            return NoDrafter()
        if spec == "ngram" or spec.startswith("ngram:"):
            parts = spec_numbers(spec, "ngram:MAX[,MIN[,WINDOW[,PER_MATCH]]]", 4)
            if len(parts) == 1:  # ngram:1 means single-token matches only
                parts.append(min(2, parts[0]))
            return NgramDrafter(*parts, stop_ids=self.stop_ids)
        if spec == "suffix" or spec.startswith("suffix:"):
            drafter = SuffixDrafter(*spec_numbers(spec, "suffix:MAX_MATCH[,MIN_MATCH]", 2), stop_ids=self.stop_ids)
            drafter.remember(list(history))
            return drafter
        if spec == "eagle":
            return EagleDrafter(self.eagle_head())
        if "/" in spec and not spec.startswith("model:"):
            copy, model, depth = parse_hybrid(spec)
            return HybridDrafter(spec, self.build(copy, history), self.build(model), depth)
        if "+" in spec and not spec.startswith("model:"):
            return self._multilevel(spec, history)
        return ModelDrafter(self._model_weights(spec), spec, share_target_kv=spec == "q4")

    def _multilevel(self, spec: str, history) -> MultiLevelDrafter:
        """MODEL+COPY: the model drafter MODEL (int8, q4) whose own chain COPY (ngram..., suffix...) drafts."""
        outer, inner = (part.strip() for part in spec.split("+", 1))
        if outer not in ("int8", "q4"):
            raise ValueError(f"drafts of drafts take int8 or q4 before the '+', got {outer!r} in {spec!r}")
        if not (inner.startswith("ngram") or inner.startswith("suffix")):
            raise ValueError(f"drafts of drafts take ngram or suffix after the '+', got {inner!r} in {spec!r}")
        return MultiLevelDrafter(self._model_weights(outer), spec, self.build(inner, history), outer == "q4")

    def use_eagle_head(self, head: EagleHead | None) -> None:
        """Draft `eagle` with this head instead of the one shipped for the target (training, tests); None:
        the shipped one again."""
        with self._lock:
            self._head = head

    def eagle_head(self) -> EagleHead:
        with self._lock:
            if self._head is None:
                self._head = load_head(self.target.model, self.target.name)
            return self._head

    def _model_weights(self, spec: str):
        with self._lock:
            model = self._weights.get(spec)
            if model is None:
                model = self._weights[spec] = self._load_weights(spec)
            return model

    def _load_weights(self, spec: str):
        if spec == "int8":
            return int8_weights(self.target.model)
        if spec == "q4":
            source = self.target.source
            gguf = source.get("file") if source.get("kind") == "gguf-package" else None
            return q4_weights(self.target.model, gguf)
        if not spec.startswith("model:"):
            raise ValueError(f"unknown drafter {spec!r}; choose {DRAFTER_SPECS}")
        model_id = spec.split(":", 1)[1].strip()
        if not model_id:
            raise ValueError("model drafter needs an id: model:<hub id, preset or folder>")
        loaded = load_model(
            model_id,
            self.target.dtype,
            device=str(self.target.model.device),
            allow_remote_code=self.allow_remote_code,
        )
        check_same_vocab(self.target.tokenizer, loaded.tokenizer)
        return loaded.model
