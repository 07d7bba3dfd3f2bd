// Follow a log as it is written: every two seconds while the tab is visible, ask the page's follow address
// for what came after the cursor, and add those lines at the end. Lines are set as text, never as HTML: an
// engine's log holds whatever prompts said. A file of its own: the pages' Content-Security-Policy runs
// only the site's script files.
(function () {
  var log = document.getElementById("log");
  if (!log) { return; }
  var status = document.getElementById("follow-status");
  var pause = document.getElementById("follow-pause");
  var empty = document.getElementById("log-empty");
  var KEPT = 2000;  // lines shown at most, as many as the agent keeps
  var cursor = log.dataset.cursor;
  var lines = log.textContent ? log.textContent.split("\n") : [];
  var paused = false;
  var busy = false;

  function say(text) { status.textContent = text; }
  function atEnd() { return log.scrollHeight - log.scrollTop - log.clientHeight < 40; }

  pause.hidden = false;
  pause.addEventListener("click", function () {
    paused = !paused;
    pause.textContent = paused ? "Follow" : "Pause";
    say(paused ? "Paused: new lines wait until you follow again." : "Following: new lines appear below as they are written.");
  });
  say("Following: new lines appear below as they are written.");
  log.scrollTop = log.scrollHeight;

  function poll() {
    if (paused || busy || document.hidden) { return; }
    busy = true;
    fetch(log.dataset.follow + "&after=" + encodeURIComponent(cursor), { credentials: "same-origin" })
      .then(function (r) {
        if (r.redirected) { throw { said: "Your session ended: sign in again to follow this log." }; }
        if (!r.ok) { throw { said: "The gateway answered " + r.status + "; trying again." }; }
        return r.json();
      })
      .then(function (answer) {
        if (answer.problem) { say(answer.problem + " Trying again."); return; }
        var stay = atEnd();
        if (answer.skipped) { lines.push("[… some lines were left out here: more were written than are shown …]"); }
        lines = lines.concat(answer.lines);
        if (lines.length > KEPT) { lines = lines.slice(lines.length - KEPT); }
        cursor = answer.cursor;
        if (answer.lines.length || answer.skipped) {
          log.textContent = lines.join("\n");
          if (empty) { empty.hidden = true; }
          if (stay) { log.scrollTop = log.scrollHeight; }
        }
        say("Following: new lines appear below as they are written (checked " + new Date().toLocaleTimeString() + ").");
      })
      .catch(function (e) { say(e && e.said ? e.said : "The gateway did not answer; trying again."); })
      .then(function () { busy = false; });
  }
  setInterval(poll, 2000);
})();
