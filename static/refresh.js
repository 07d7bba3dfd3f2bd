// Refresh an element's content in place every five seconds, while the tab is visible: each element with
// data-refresh="URL" takes the HTML that URL answers. With data-refresh-while="SELECTOR", refreshing stops
// once nothing inside matches it (a download finished). A file of its own, not an inline script: the
// pages' Content-Security-Policy runs only the site's script files.
document.querySelectorAll("[data-refresh]").forEach(function (element) {
  var timer = setInterval(function () {
    if (document.hidden) { return; }
    fetch(element.dataset.refresh, { credentials: "same-origin" }).then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) {
        if (!html) { return; }
        element.innerHTML = html;
        var until = element.dataset.refreshWhile;
        if (until && !element.querySelector(until)) { clearInterval(timer); }
      }).catch(function () {});
  }, 5000);
});
