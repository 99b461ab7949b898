"""Drafters named once: a spec parsed in one place, a family described in one record.

A spec is what a user types: ``ngram:6,2``, ``q4``, ``model:<id>``, ``q4+ngram`` (drafts of drafts), ``suffix/q4:3``
(a hybrid). ``parse`` turns it into a ``DrafterSpec``: its family, the numbers after its colon, a draft model's id,
and for a composite its model part, its copying part and its depth.

A ``Family`` is one kind of drafter, registered by the module that defines it (``register``): its label and one
line of help for screens, how its spec is written, how it builds a drafter and the weights it shares, its memory
estimate, what a production engine calls the same drafting (``Serving``, read by ``launch-command``), and what it
supports (trees, block verification, adaptive depth). Menus, the memory plan, the launch commands and the bench
read these records; nothing else parses a drafter's name. A new drafter is one module: its class, its ``Family``,
and one ``register`` call (``engine.drafters.registry`` imports the module).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "BASELINE",
    "DrafterMemory",
    "DrafterSpec",
    "Family",
    "MemorySizes",
    "Serving",
    "families",
    "family",
    "forms",
    "memory_of",
    "menu",
    "parse",
    "part",
    "register",
]

BASELINE = "none"
KINDS = ("baseline", "copying", "model", "head", "composite")


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed spec. text: the spec as typed (stripped); family: its family's name; numbers: those after its
    colon; model_id: a draft model's id (``model:<id>``); model, copy: a composite's model part and copying part;
    depth: a hybrid's deepest model chain."""

    text: str
    family: str
    numbers: tuple[int, ...] = ()
    model_id: str | None = None
    model: DrafterSpec | None = None
    copy: DrafterSpec | None = None
    depth: int | None = None

    @property
    def drafts(self) -> bool:
        """False for the baseline alone."""
        return self.family != BASELINE

    @property
    def weights(self) -> DrafterSpec | None:
        """The spec whose model weights this drafter holds: itself for a model drafter, a composite's model
        part, None for drafters that run no model of their own."""
        if self.model is not None:
            return self.model
        return self if family(self.family).kind == "model" else None

    @property
    def root(self) -> str:
        """The family a screen groups it under: a composite's model part's family, else its own."""
        return self.model.family if self.model is not None else self.family


@dataclass(frozen=True)
class MemorySizes:
    """What a family's memory estimate reads (engine.tools.memory_plan): the target's sizes (``dims``: params,
    embed_params, vocab, layers, kv_heads, head_dim, hidden, ...), the bytes of a weight and of an attention value
    (keys and values), the slots one run's cache holds, the runs at once, and ``dims_of`` for another model's
    sizes by id."""

    dims: dict
    weight_bytes: int
    attention_bytes: int
    device: str
    context: int
    runs: int
    dims_of: Callable[[str], dict]

    @property
    def kv_per_token(self) -> int:
        """Key and value bytes per cached token of the target."""
        d = self.dims
        return 2 * d["layers"] * d["kv_heads"] * d["head_dim"] * self.attention_bytes


@dataclass(frozen=True)
class DrafterMemory:
    """A drafter's share of a run's memory: its weights (shared by the runs), its caches (all runs), a note
    saying what was estimated, and the sizes of the model it runs passes of (None: it runs none)."""

    weight_bytes: int = 0
    kv_bytes: int = 0
    note: str = ""
    runs_model: dict | None = None


@dataclass(frozen=True)
class Serving:
    """What a production engine calls the same drafting (``engine.tools.launch``).

    method: "ngram" (prompt lookup), "suffix" (suffix decoding), "draft_model" (a separate draft model, the
    spec's ``model_id``), "quantised_copy" (a draft model that is the target quantised to ``bits``, llama.cpp's
    ``gguf_type``) or "eagle" (a trained head); note: what differs from SpecLens's drafter there; own_gguf: the
    default target's GGUF file is the copy (its blocks are the drafter's)."""

    method: str
    bits: int | None = None
    gguf_type: str | None = None
    note: str = ""
    own_gguf: bool = False


@dataclass(frozen=True)
class Family:
    """One kind of drafter (module docstring). build(spec, registry, history) -> a fresh Drafter; weights(spec,
    target) -> the weights its runs share (built once per target by the registry); memory(spec, MemorySizes) ->
    DrafterMemory (a composite without one: its model part's); parse(text) -> DrafterSpec for a form other than NAME[:N,...]; join: the character that
    makes a composite spec (``+``, ``/``). serving None: no production engine drafts this way (``unserved``
    says why). copy_of_target: its model is the target's own weights, quantised (drafts of drafts run on those);
    target_kv: it reads the committed positions' keys and values from the target's cache (DrafterNeeds.target_kv).
    trees, block, adaptive: whether it drafts trees, whether block verification applies to its chains (it hands
    on q), whether adaptive depth may pick its K. about: a paragraph on how it drafts and what it costs (the
    Drafters lab). order: its place in menus and lists. menu: its entries (label, spec) in the drafter menus
    (default: its label and name; a composite lists its usual pairings)."""

    name: str
    label: str
    help: str
    form: str
    build: Callable
    kind: str = "model"
    numbers: int = 0
    weights: Callable | None = None
    memory: Callable | None = None
    parse: Callable[[str], DrafterSpec] | None = None
    join: str | None = None
    serving: Serving | None = None
    unserved: str = ""
    copy_of_target: bool = False
    target_kv: bool = False
    order: int = 100
    trees: bool = True
    block: bool = True
    adaptive: bool = True
    about: str = ""
    menu: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"a drafter family's kind is one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.name or any(c in self.name for c in ":+/ "):
            raise ValueError(f"a drafter family's name is one word, got {self.name!r}")

    @property
    def builds_weights(self) -> bool:
        """Whether its first run builds or loads weights (worth a message on screen)."""
        return self.weights is not None


_FAMILIES: dict[str, Family] = {}


def register(new: Family) -> Family:
    """Add a family (a module's import registers its own); registering a name again replaces it."""
    _FAMILIES[new.name] = new
    return new


def families(kind: str | None = None) -> list[Family]:
    """Every registered family in menu order (of one kind, if given)."""
    ordered = sorted(_FAMILIES.values(), key=lambda f: f.order)
    return [f for f in ordered if kind is None or f.kind == kind]


def family(name: str) -> Family:
    """The family of this name (KeyError if none is registered)."""
    return _FAMILIES[name]


def memory_of(spec: DrafterSpec, sizes: MemorySizes) -> DrafterMemory | None:
    """A spec's memory estimate: its family's, else (a composite) its model part's; None where none is known."""
    own = family(spec.family)
    if own.memory is not None:
        return own.memory(spec, sizes)
    return memory_of(spec.model, sizes) if spec.model is not None else None


def forms() -> str:
    """Every spec form, for help texts and error messages."""
    return ", ".join(f.form for f in families())


def menu() -> list[tuple[str, str]]:
    """The drafter menus' entries (label, spec), in family order."""
    return [entry for f in families() for entry in (f.menu or ((f.label, f.name),))]


def parse(text) -> DrafterSpec:
    """A spec's text -> DrafterSpec; ValueError saying what is wrong and which forms there are."""
    if not isinstance(text, str):
        raise ValueError(f"drafter must be a string, got {text!r}")
    text = text.strip()
    if text in ("", BASELINE, "baseline"):
        return DrafterSpec(BASELINE, BASELINE)
    name, colon, rest = text.partition(":")
    own = _FAMILIES.get(name)
    if own is not None and own.parse is not None and own.join is None:  # a form of its own (model:<id>)
        return own.parse(text)
    for composite in _FAMILIES.values():
        if composite.join and composite.join in text:
            return composite.parse(text)
    if own is None:
        raise ValueError(f"unknown drafter {text!r}; choose {forms()}")
    return DrafterSpec(text, own.name, numbers(text, own) if colon else ())


def numbers(text: str, of: Family) -> tuple[int, ...]:
    """The numbers after a spec's colon ("suffix:24,3" -> (24, 3)), at most as many as the family takes."""
    try:
        found = tuple(int(x) for x in text.split(":", 1)[1].split(","))
    except ValueError:
        found = ()
    if not 1 <= len(found) <= of.numbers:
        raise ValueError(f"the drafter takes {of.form}, got {text!r}")
    return found


def part(text: str, kinds: tuple[str, ...], where: str, whole: str, of: str, test=None) -> DrafterSpec:
    """One part of the spec `whole` of the composite `of` (its label), parsed and checked: its family of one of
    `kinds` and passing `test` (a further condition on the family); ValueError naming the composite and the forms
    the part may take `where` ("before the '+'")."""
    allowed = [f for f in families() if f.kind in kinds and (test is None or test(f))]
    try:
        spec = parse(text)
    except ValueError:
        spec = None
    if spec is None or spec.model is not None or _FAMILIES[spec.family] not in allowed:
        names = ", ".join(f.form for f in allowed)
        raise ValueError(f"{of} {whole!r} takes {names} {where}, got {text!r}")
    return spec
