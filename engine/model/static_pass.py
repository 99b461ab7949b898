"""The target's verify pass in fixed shapes and fixed addresses: what a CUDA graph can record once and replay.

Why: on a GPU the default target's pass is launch-bound: reading the 135M model's bf16 weights is a small
part of an eager pass, which is a few hundred small kernels launched one by one from Python
(docs/bench/2026-11-30-gpu-check-h200.md, docs/bench/2026-12-07-notes-from-kernels-and-model.md). A CUDA
graph records those launches once and replays them with one call, but only if nothing in the pass depends
on the host: every tensor's shape and address fixed, no Python number that changes between passes, no read
back to the host in the middle.

The strict pass (``GenerationSettings.strict``) already has fixed shapes: W = the run's widest pass
(pending token + draft budget, padded), attending over the whole cache through a [W, S] mask. What it
still takes from the host each pass is the write offset ``cache.length`` (a Python int baked into a
slice) and the rotary table's size check. Here both become device tensors in buffers that live as long
as the runner:

    tokens    [W] int64       the pending token, the draft nodes, then padding (token 0)
    positions [W] int64       rotary positions (tree nodes: prefix length + depth)
    slots     [W] int64       the cache slot each row's K/V is written to: start + row
    mask      [W, S] bool     which cache slots each row attends to (padding rows: slot 0)
    x_in      [W, E]          input rows in place of the token embeddings (the EAGLE head's fused
                              feature + embedding rows), when a pass is given them
    cache     k, v [L, Hkv, S, D]  one static KV cache, owned by the runner (S = its capacity)
  outputs:
    logits    [W, V] float32  on the device (the host copy is taken after the replay)
    hidden    [W, F E]        the feature layers' rows, when a drafter reads them (EAGLE)

The computation is ``Transformer._layer`` itself (torch's ops, the K/V write through ``slots``), so on
the CPU the same function runs eagerly and the tests compare it bit for bit with ``Transformer.run_pass``
in strict shape on torch's ops. On CUDA it is captured once per width (a run of K = 4 uses one width)
and replayed; the only host synchronisation left in a step is the copy of the logits the verification
reads (how many tokens were accepted follows from them).

One runner serves one run at a time (its cache is the graph's cache): a run that finds it busy, or needs
more than its capacity, takes the eager strict path with its own cache (``acquire``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from engine.model.transformer import KVCache, PassOutput, Transformer, check_feature_layers, decoder_layer

__all__ = ["StaticPasses", "capture_available"]

_CAPTURE_LOCK = threading.Lock()


def capture_available(device: torch.device) -> bool:
    """Whether CUDA graphs can record passes on `device` (a CUDA device with torch's graph support)."""
    return device.type == "cuda" and torch.cuda.is_available() and hasattr(torch.cuda, "CUDAGraph")


@dataclass
class _Recorded:
    """One width's captured graph and the output tensors its replays overwrite."""

    graph: object
    output: PassOutput


@dataclass
class StaticPasses:
    """Fixed-shape target passes over one static KV cache, captured per width where CUDA graphs exist.

    model:      the target (its weights are read by the graphs, never copied)
    capacity:   S, the cache slots every pass attends over
    max_width:  the widest pass W a run may ask for (16: a K = 15 chain, or a tree of 15 nodes)
    capture:    record CUDA graphs (default: where the model's device has them); False runs the same
                fixed-shape function eagerly (the CPU, and the reference the GPU check compares with)
    """

    model: Transformer
    capacity: int
    max_width: int = 16
    capture: bool | None = None
    cache: KVCache = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _graphs: dict = field(default_factory=dict, init=False, repr=False)
    _pool: object = field(default=None, init=False, repr=False)
    passes: int = field(default=0, init=False)  # passes run (replays, or eager runs without capture)
    captured: int = field(default=0, init=False)  # graphs recorded
    # Why this runner stopped capturing, for good (its passes then run the same function uncaptured), or None.
    capture_error: str | None = field(default=None, init=False)

    def __post_init__(self):
        if not 1 <= self.max_width <= self.capacity:
            raise ValueError(f"max_width must be between 1 and the capacity {self.capacity}, got {self.max_width}")
        device = self.model.device
        if self.capture is None:
            self.capture = capture_available(device)
        if self.capture and not capture_available(device):
            raise ValueError(f"CUDA graphs need a CUDA device; the target runs on {device}")
        self.cache = self.model.new_cache(self.capacity)
        w, s = self.max_width, self.capacity
        self.tokens = torch.zeros(w, dtype=torch.long, device=device)  # [W]
        self.positions = torch.zeros(w, dtype=torch.long, device=device)  # [W]
        self.slots = torch.zeros(w, dtype=torch.long, device=device)  # [W]
        self.mask = torch.zeros(w, s, dtype=torch.bool, device=device)  # [W, S]
        self.x_in = torch.zeros(w, self.model.cfg.hidden_size, dtype=self.model.act_dtype, device=device)  # [W, E]
        # The rotary table once, for every position a pass over this cache can have, held here: the model
        # may later grow its own table, and a recorded graph must keep reading live tensors.
        self.model._rope(torch.tensor([s - 1]), s - 1)
        self._cos, self._sin = self.model._rope_table  # [>= S, D] each

    # ---------------------------------------------------------------- one run at a time
    def acquire(self, needed: int) -> KVCache | None:
        """The static cache, emptied, for a run of `needed` slots; None if another run holds it or it is
        too small (that run then takes the eager path with a cache of its own)."""
        if needed > self.capacity or not self._lock.acquire(blocking=False):
            return None
        self.cache.length = 0
        return self.cache

    def release(self) -> None:
        if self._lock.locked():
            self._lock.release()

    # ---------------------------------------------------------------- the pass
    def run(
        self,
        tokens: list[int],
        positions: list[int],
        mask: torch.Tensor,
        feature_layers: tuple[int, ...] | None = None,
        features: bool = False,
        to_host: bool = True,
        x_in: torch.Tensor | None = None,
    ) -> PassOutput:
        """One strict pass of W = len(tokens) rows at slots [cache.length, cache.length + W) of the static
        cache: the logits [W, V] float32 (on the host, or on the device with to_host=False), and the
        feature rows [W, F E] on the device when asked; copies, which the next pass does not overwrite.

        tokens, positions: W ints (padding included); mask: [W, S] bool on the host, every row with at
        least one allowed slot (checked here, on the host, before anything runs); x_in: [W, E] rows in place
        of the tokens' embeddings (the EAGLE head), or None."""
        cache, w = self.cache, len(tokens)
        start = cache.length
        if not 1 <= w <= self.max_width:
            raise ValueError(f"a static pass has 1 to {self.max_width} rows, got {w}")
        if len(positions) != w or tuple(mask.shape) != (w, self.capacity):
            raise ValueError(f"positions must have {w} entries and mask be [{w}, {self.capacity}]")
        if start + w > self.capacity:
            raise ValueError(f"sequence of {start + w} tokens exceeds the static cache capacity {self.capacity}")
        if not bool(mask.any(dim=1).all()):
            raise ValueError("every row of the mask must allow at least one slot")
        if max(positions) >= self.capacity or min(positions) < 0:
            raise ValueError(f"positions must lie in [0, {self.capacity})")
        if x_in is not None and tuple(x_in.shape) != (w, self.x_in.shape[1]):
            raise ValueError(f"x_in must be [{w}, {self.x_in.shape[1]}], got {list(x_in.shape)}")
        layers = check_feature_layers(feature_layers, len(self.model.layers)) if features and feature_layers else ()
        # Host -> static buffers (one small copy each; the graph reads these addresses).
        self.tokens[:w].copy_(torch.tensor(tokens), non_blocking=True)
        self.positions[:w].copy_(torch.tensor(positions), non_blocking=True)
        self.slots[:w].copy_(torch.arange(start, start + w), non_blocking=True)
        self.mask[:w].copy_(mask, non_blocking=True)
        if x_in is not None:
            self.x_in[:w].copy_(x_in)
        key = (w, layers, features, x_in is not None)
        recorded = self._recorded(key) if self.capture else None
        if recorded is not None:
            recorded.graph.replay()
            out = recorded.output
        else:
            out = self._compute(*key)
        cache.length = start + w
        self.passes += 1
        logits = out.logits.float()
        logits = logits.cpu() if to_host else logits.clone()
        return PassOutput(logits, out.hidden.clone() if out.hidden is not None else None)

    @torch.inference_mode()
    def _compute(self, w: int, layers: tuple[int, ...], features: bool, rows_given: bool) -> PassOutput:
        """The pass on the first w rows of the buffers: Transformer._layer per layer, torch's ops only
        (rows_given: the x_in buffer in place of the token embeddings)."""
        model, cache = self.model, self.cache
        tokens, positions, slots, mask = self.tokens[:w], self.positions[:w], self.slots[:w], self.mask[:w]
        cos, sin = self._cos[positions], self._sin[positions]  # [W, D]
        x = self.x_in[:w] if rows_given else model.embed[tokens].to(model.act_dtype)  # [W, E]
        keep = set(layers[:-1]) if layers else set()
        captured = {}
        for li, layer in enumerate(model.layers):
            x = decoder_layer(
                model, li, layer, x, cos, sin, cache, None, self.capacity, mask, False, False, slots=slots
            )
            if li in keep:
                captured[li] = x
        hidden = None
        if features:
            hidden = torch.cat([captured[i] for i in layers[:-1]] + [x], dim=-1) if keep else x
        return PassOutput(model.logits_of(x, to_host=False), hidden)

    def _recorded(self, key) -> _Recorded | None:
        """This width's graph, recorded at its first use; None once a capture has failed: the runner then stays
        uncaptured for good (``capture_error`` says why; the run's finish metrics report it), instead of
        trying again at every pass."""
        recorded = self._graphs.get(key)
        if recorded is not None:
            return recorded
        with _CAPTURE_LOCK:  # one capture at a time in the process (other runs may be recording too)
            try:
                return self._graphs.get(key) or self._record(key)
            except Exception as exc:  # a capture that fails leaves no graph: run uncaptured from now on
                self.capture, self.capture_error = False, f"CUDA graph capture failed: {type(exc).__name__}: {exc}"
                return None

    def _record(self, key) -> _Recorded:
        """Capture one width's pass: warm it up on a side stream (allocations, lazy inits), then record.
        The warm-up and recording passes write K/V at the buffers' slots, past the committed length, where
        the real pass then writes again: the cache is unchanged from the caller's point of view."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._compute(*key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one memory pool shared by every width's graph
        # thread_local: CUDA work other threads do meanwhile (other visitors' eager runs) is not captured, and
        # does not invalidate this capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = self._compute(*key)
        recorded = _Recorded(graph, output)
        self._graphs[key] = recorded
        self.captured += 1
        return recorded
