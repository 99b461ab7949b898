() => {
  // Chart titles fit the chart they are on. visuals/style.py wraps every title and subtitle for a phone's
  // figure (about 330 px: TITLE_CHARS and SUBTITLE_CHARS characters per line), since plotly does not wrap
  // text; on a desktop's wide figure that squeezes the title into a third of it. Each figure keeps its raw
  // texts and those sizes in layout.meta.wrap; here they are wrapped again for the figure's real width, by
  // the same rule (break at " · " first, then between words, keep explicit <br>), and the top margin and
  // height grow or shrink by the same number of lines, so that the plot area keeps its size.
  if (window.__slTitles) return;
  window.__slTitles = true;
  const MAX_SCALE = 3; // lines of at most three phone lines' length: long lines read badly
  const BAR_GAP = 16; // pixels between a title line and plotly's mode bar

  const wrap = (text, width) => {
    const lines = [];
    for (const paragraph of (text || '').split('<br>')) {
      let line = '';
      for (const piece of paragraph.split(' · ')) {
        piece.split(' ').forEach((word, index) => {
          const joint = index === 0 ? ' · ' : ' ';
          if (line && line.length + joint.length + word.length > width) {
            lines.push(line);
            line = word;
          } else {
            line = line ? line + joint + word : word;
          }
        });
      }
      lines.push(line);
    }
    return [lines.join('<br>'), lines.length];
  };

  // A wide figure inside a box that scrolls sideways (p vs q on a phone) shows only the box's width at a
  // time: its title must fit that, not the figure.
  const shownWidth = (gd) => {
    let shown = window.innerWidth;
    for (let el = gd.parentElement; el && el !== document.body; el = el.parentElement) {
      if (getComputedStyle(el).overflowX !== 'visible' && el.clientWidth > 0) shown = Math.min(shown, el.clientWidth);
    }
    return shown;
  };

  const fit = (gd) => {
    const m = gd.layout && gd.layout.meta && gd.layout.meta.wrap;
    const width = gd._fullLayout && gd._fullLayout.width;
    if (!m || !width || !window.Plotly || gd.offsetWidth < 50) return; // hidden tabs have no width yet
    // The mode bar (top right, shown on hover) takes its width from the title's lines where it shows.
    const bar = gd.querySelector('.modebar');
    const barWidth = bar ? bar.getBoundingClientRect().width : 0;
    const room = Math.min(width, shownWidth(gd)) - (barWidth > 0 ? barWidth + BAR_GAP : 0);
    const scale = Math.min(MAX_SCALE, Math.max(room, m.figure_px * 0.8) / m.figure_px);
    const [title, titleLines] = wrap(m.title, Math.max(16, Math.floor(m.title_chars * scale)));
    const [subtitle, subtitleLines] = m.subtitle
      ? wrap(m.subtitle, Math.max(24, Math.floor(m.subtitle_chars * scale)))
      : ['', 0];
    const shown = gd.layout.title || {};
    if (title === shown.text && subtitle === ((shown.subtitle || {}).text || '')) return;
    let top = m.pad + titleLines * m.title_line + m.to_plot;
    if (subtitleLines) top += m.subtitle_gap + subtitleLines * m.subtitle_line;
    top = Math.max(top, m.min_top);
    const delta = top - m.top;
    const height = gd.layout.height + delta;
    const marginTop = (gd.layout.margin && gd.layout.margin.t ? gd.layout.margin.t : m.top) + delta;
    m.top = top; // the layout as it now is: a later fit moves on from here
    window.Plotly.relayout(gd, {
      'title.text': title,
      'title.subtitle.text': subtitle,
      'margin.t': marginTop,
      height: height,
      'title.y': 1 - m.pad / height,
    });
  };

  window.slOnCharts((gd) => {
    if (!gd.__slTitles && gd.on) {
      gd.__slTitles = true;
      gd.on('plotly_afterplot', () => fit(gd)); // a new figure from the server, or a resize
    }
    fit(gd);
  });
}
