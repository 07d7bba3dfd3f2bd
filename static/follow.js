// Follow the page's #back link at once (the /login/cli page that hands `llmgw login` its one-time code): a
// file of its own, not an inline script, since the pages' Content-Security-Policy runs only the site's files.
var back = document.getElementById("back");
if (back) { window.location.replace(back.href); }
