"""Drafters by spec for one target: a spec (``ngram:6,2``, ``int8``, ``model:<id>``...) -> a fresh drafter for one run.

The spec is parsed once (``engine.drafters.spec.parse``) and its family builds the drafter
(``Family.build``). Model weights (the int8 and q4 copies, a draft model, the EAGLE head) are built once per
target and shared read-only; the per-run state (a drafter's KV cache, its index of the context) is new for every
drafter built, so concurrent runs never share it.
"""

from __future__ import annotations

import threading

from engine.drafters.base import Drafter
from engine.drafters.eagle import EagleHead, load_head
from engine.drafters.spec import DrafterSpec, family, parse
from engine.model.loading import LoadedModel

__all__ = ["DrafterRegistry"]


class DrafterRegistry:
    """The drafters one target can run with, and the weights they share."""

    def __init__(self, target: LoadedModel, stop_ids: frozenset[int], allow_remote_code: bool = False):
        self.target = target
        self.stop_ids = stop_ids  # never drafted by the copying drafters (template markers, EOS)
        self.allow_remote_code = allow_remote_code
        self._weights: dict[str, object] = {}
        self._head: EagleHead | None = None  # the EAGLE head, loaded at the first eagle run
        self._lock = threading.Lock()

    def build(self, spec: str | DrafterSpec, history: list[list[int]] = ()) -> Drafter:
        """A fresh drafter for one run; history: earlier answers (token ids) a copying drafter may copy."""
        spec = spec if isinstance(spec, DrafterSpec) else parse(spec)
        return family(spec.family).build(spec, self, list(history))

    def weights(self, spec: DrafterSpec):
        """The shared weights of a model drafter's spec, built at its first run on this target."""
        with self._lock:
            found = self._weights.get(spec.text)
            if found is None:
                found = self._weights[spec.text] = family(spec.family).weights(spec, self)
            return found

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
