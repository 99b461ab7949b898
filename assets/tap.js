() => {
  // Touch screens have no hover: a tap on a token of the generated text (its details are in its title) shows
  // them in a box at the bottom of the screen; a tap anywhere else hides it. Charts show their hover labels on
  // a tap by themselves (plotly).
  if (document.getElementById('sl-tap-tip')) return;
  const tip = document.createElement('div');
  tip.id = 'sl-tap-tip';
  tip.setAttribute('role', 'status');
  document.body.appendChild(tip);
  document.addEventListener('click', (event) => {
    const el = event.target.closest && event.target.closest('.sl-tok[title], .sl-pass[title]');
    if (!el || !window.matchMedia('(hover: none)').matches) {
      tip.style.display = 'none';
      return;
    }
    tip.textContent = el.getAttribute('title');
    tip.style.display = 'block';
  });
}
