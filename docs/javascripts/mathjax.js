// MathJax 3 for the pages' math: \( \) and \[ \] from pymdownx.arithmatex, $ and $$ in the
// tutorials' notebook cells.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true,
  },
  // The whole page is searched (code and pre blocks are skipped), as the notebooks' math sits in
  // plain paragraphs.
};

document$.subscribe(() => {
  if (window.MathJax && MathJax.typesetPromise) {
    MathJax.typesetPromise();
  }
});
