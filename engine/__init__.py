"""SpecLens engine: exact speculative decoding on real models, as a stream of events.

Public API (imported lazily so that ``import engine`` stays cheap)::

    from engine import SpeculativeEngine, GenerationSettings
    engine = SpeculativeEngine.load()                  # offline default model
    for event in engine.generate("Hello", drafter="ngram", k=4):
        ...                                            # start, step..., finish dicts

Layout (docs/architecture.md follows one token through it): ``models`` (loading,
cache, presets), ``transformer`` + ``cpu_kernels`` (forward + KV cache), ``drafters`` (+ ``adaptive``),
``decode`` (the loop), ``verification`` (a pass's logits -> decisions) on
``acceptance`` (the one acceptance rule; ``batched_verifier`` mirrors it on the GPU),
``sampling`` (filters, draws), ``events``, ``trace`` and ``metrics`` (plain Python:
the trace model and the one run summary), ``parity``, ``bench``, ``vllm_*``, ``cli``.
"""

__all__ = ["GenerationSettings", "SpeculativeEngine", "load_model", "ModelLoadError"]


def __getattr__(name):
    if name in ("GenerationSettings", "SpeculativeEngine"):
        from engine import decode

        return getattr(decode, name)
    if name in ("load_model", "ModelLoadError"):
        from engine.model import loading as models

        return getattr(models, name)
    raise AttributeError(name)
