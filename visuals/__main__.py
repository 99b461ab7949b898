"""python -m visuals TRACE.json --out DIR [--baseline BASELINE.json]
   python -m visuals training-curves CURVES.json   (an EAGLE head's curves -> training-curves.html beside it)

Writes one standalone HTML file per figure (plotly.js inlined, so the files open offline) and prints their
paths. Exits 2 with a one-line "error: ..." message on a missing or malformed trace.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.trace import TraceError
from engine.trace import load as load_trace

from .report import all_figures


def _fail(message: str) -> int:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def training_curves(path: str) -> int:
    """The head's training curves as HTML beside the JSON. plotly.js comes from its CDN here (the
    file is committed with the head and stays ~10 KB); open it where a browser can reach the CDN."""
    import json

    from .training import training_curves_figure

    try:
        curves = json.loads(Path(path).read_text())
        fig = training_curves_figure(curves)
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        return _fail(f"cannot draw training curves from {path!r}: {exc}")
    out = Path(path).with_suffix(".html")
    fig.write_html(out, include_plotlyjs="cdn", full_html=True, config={"displaylogo": False})
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["training-curves"]:
        if len(argv) != 2:
            return _fail("usage: python -m visuals training-curves CURVES.json")
        return training_curves(argv[1])
    parser = argparse.ArgumentParser(prog="python -m visuals", description="Render a SpecLens trace as HTML figures.")
    parser.add_argument("trace", help="trace JSON file (as saved by the engine or the app)")
    parser.add_argument("--out", required=True, help="folder to write the HTML files into")
    parser.add_argument("--baseline", help="a finished baseline trace, for the measured wall-clock speedup")
    args = parser.parse_args(argv)

    try:
        events = load_trace(args.trace)
        baseline = load_trace(args.baseline) if args.baseline else None
    except TraceError as exc:
        return _fail(exc)
    try:
        figures = all_figures(events, baseline)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        return _fail(f"the trace is malformed ({type(exc).__name__}: {exc})")

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _fail(f"cannot create {str(out)!r}: {exc.strerror or exc}")
    stem = Path(args.trace).stem
    for name, fig in figures.items():
        path = out / f"{stem}-{name}.html"
        try:
            fig.write_html(path, include_plotlyjs=True, full_html=True, config={"displaylogo": False})
        except OSError as exc:
            return _fail(f"cannot write {str(path)!r}: {exc.strerror or exc}")
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
