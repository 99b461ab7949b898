"""SpecLens engine: exact speculative decoding on real models, as a stream of events.

Public API (imported lazily so that ``import engine`` stays cheap)::

    from engine import SpeculativeEngine, GenerationSettings
    engine = SpeculativeEngine.load()                  # offline default model
    for event in engine.generate("Hello", drafter="ngram", k=4):
        ...                                            # start, step..., finish dicts

Layout: the top level is the one-token path in reading order, the folders are its rooms;
docs/architecture.md names every module and follows one token through them.
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
