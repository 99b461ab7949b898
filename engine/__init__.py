"""SpecLens engine: exact speculative decoding on real models, as a stream of events.

Public API (imported lazily so that ``import engine`` stays cheap)::

    from engine import SpeculativeEngine, GenerationSettings
    engine = SpeculativeEngine.load()                  # offline default model
    for event in engine.generate("Hello", drafter="ngram", k=4):
        ...                                            # start, step..., finish dicts

Layout: ``models`` (loading, cache, presets), ``transformer`` (forward + KV cache),
``sampling`` (verification maths), ``drafters``, ``decode`` (the loop),
``metrics``, ``trace`` (JSON I/O), ``parity``, ``cli``.
"""

__all__ = ["GenerationSettings", "SpeculativeEngine", "load_model", "ModelLoadError"]


def __getattr__(name):
    if name in ("GenerationSettings", "SpeculativeEngine"):
        from . import decode

        return getattr(decode, name)
    if name in ("load_model", "ModelLoadError"):
        from . import models

        return getattr(models, name)
    raise AttributeError(name)
