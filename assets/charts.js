() => {
  // Every plotly chart on the page, now and as gradio adds or replaces them: the other chart scripts
  // (titles.js, labels.js) register a function of one chart here, run for each chart on the page after any change
  // to the page (once per animation frame at most) and on a resize. Each decides what a second call does.
  if (window.slOnCharts) return;
  const callbacks = [];
  let pending = false;
  const run = () => {
    pending = false;
    for (const gd of document.querySelectorAll('.js-plotly-plot')) callbacks.forEach((callback) => callback(gd));
  };
  const soon = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(run);
  };
  window.slOnCharts = (callback) => {
    callbacks.push(callback);
    soon();
  };
  new MutationObserver(soon).observe(document.body, { childList: true, subtree: true });
  window.addEventListener('resize', soon);
}
