"""The labs: hands-on tabs that run the real engine on the real default model and say what was measured.

* `explain`: the algorithm with rendered formulas, a live speedup calculator (theory, with the last
  Playground run as a measured point) and a toy worked example sampled 1000 times with the engine's own
  acceptance rule.
* `lossless`: thousands of real next-token samples from plain sampling, speculative sampling and a
  deliberately broken verifier, tested against the target's exact p (chi-square, total variation).
* `parity`: greedy speculative output against the greedy baseline, prompt by prompt, with the
  divergence diagnosis of `engine.tools.parity`.
* `batch`: target pass times measured now for several batch sizes; throughputs computed from them.
* `deployment` ("Your deployment"): a user's own server read from its /metrics (engine.tools.analyze) and its
  pass costs (engine.tools.pass_costs): acceptance, α, and the expected speedup by K and batch size. It runs
  no model here.

Each module's `build_tab` lays out its tab and wires its events, called from `ui.build_demo` inside
its `gr.Tabs()`; the handlers are plain functions (generators for the long runs) so tests can call
them directly. Long runs share the `model-runs` queue with the Playground and Race, and stop
cooperatively like them. The statistics live in engine.tools.exactness, the figures in visuals.lab_figures.
"""
