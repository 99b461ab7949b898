() => {
  // Point labels that would meet on a narrow chart are shortened to their mark. The draft tree puts a token's
  // label beside its marker, and on a phone a depth is only a few characters wide: "✓ ␣afternoon" ran into
  // "↻ :", and the last label ran past the plot's right edge and was cut. A figure opts in with
  // layout.meta.declutter (visuals/tree.py). Labels are placed in order of importance (the target's own token,
  // then rejected, accepted and untried drafts; within one kind, left to right); a label past the plot's edge
  // slides inside it; a label that would meet one already placed, or leave the plot area, shows its mark and "…" instead (✓…, ✗…, ↻…, +…), and nothing where
  // even that would meet one (the marker's colour and symbol still say the decision). The token itself is one
  // hover or tap away, as every detail of the tree is.
  if (window.__slLabels) return;
  window.__slLabels = true;
  const RANK = { extra: 0, rejected: 1, accepted: 2, not_reached: 3 };
  const GAP = 3; // pixels kept between two labels

  const meets = (a, b) =>
    a.left < b.right + GAP && b.left < a.right + GAP && a.top < b.bottom && b.top < a.bottom;

  // The text a label should show in full: plotly rewrites a label's text when it draws a new figure into the
  // same element, so a text that is no longer the one set here is the new full text.
  const fullText = (el) => {
    if (el.__slShort === undefined || el.textContent !== el.__slShort) el.__slFull = el.textContent;
    return el.__slFull;
  };

  const declutter = (gd) => {
    const meta = gd.layout && gd.layout.meta;
    const size = gd._fullLayout && gd._fullLayout._size;
    if (!meta || !meta.declutter || !size || gd.offsetWidth < 50) return;
    const box = gd.getBoundingClientRect();
    // the plot area, where scatter text is clipped: a label slid to its very edge lost its last letter
    const area = { left: box.left + size.l + 1, right: box.left + size.l + size.w - 1 };
    const labels = [];
    gd.querySelectorAll('g.trace').forEach((group) => {
      const cd = group.__data__;
      const trace = cd && cd[0] && cd[0].trace;
      const role = trace && trace.meta && (trace.meta.role === 'extra' ? 'extra' : trace.meta.decision);
      group.querySelectorAll('g.textpoint text').forEach((el) => {
        const full = fullText(el);
        if (el.textContent !== full) el.textContent = full;
        el.__slShort = undefined;
        const x = el.getAttribute('x');
        if (el.__slMoved === undefined || x !== el.__slMoved) el.__slX = x; // plotly placed it anew
        else el.setAttribute('x', el.__slX);
        el.__slMoved = undefined;
        labels.push({ el, full, rank: RANK[role] ?? 4, x: el.getBoundingClientRect().left });
      });
    });
    labels.sort((a, b) => a.rank - b.rank || a.x - b.x);
    const placed = [];
    for (const label of labels) {
      let r = label.el.getBoundingClientRect();
      if (r.width === 0) continue;
      // past the plot's edge (the last depth's label): slid inside it, still under its marker
      const slide = r.right > area.right ? area.right - 1 - r.right : r.left < area.left ? area.left + 1 - r.left : 0;
      if (slide && r.width <= area.right - area.left) {
        label.el.setAttribute('x', String(parseFloat(label.el.__slX) + slide));
        label.el.__slMoved = label.el.getAttribute('x');
        r = label.el.getBoundingClientRect();
      }
      const fits = r.left >= area.left && r.right <= area.right && !placed.some((p) => meets(p, r));
      if (!fits) {
        const mark = label.full.split(' ')[0];
        label.el.textContent = `${mark}…`;
        r = label.el.getBoundingClientRect();
        // still in the way: the marker's colour and symbol say the decision, the hover the rest
        if (placed.some((p) => meets(p, r)) || r.left < area.left || r.right > area.right) label.el.textContent = '';
        label.el.__slShort = label.el.textContent;
        if (!label.el.textContent) continue;
      }
      placed.push(r);
    }
  };

  // Only a new chart and plotly's own redraws run it: the labels it shortens are page changes too, and running
  // it on every change of the page would never settle.
  window.slOnCharts((gd) => {
    if (gd.__slLabels || !gd.on) return;
    gd.__slLabels = true;
    gd.on('plotly_afterplot', () => declutter(gd)); // a new figure, a relayout or a resize
    declutter(gd);
  });
}
