// Copy buttons: a button with data-copy="ID" copies the text of the element with that id. The buttons are
// hidden in the page and shown here, so a browser without script shows no button that does nothing. A file
// of its own, not an inline script: the pages' Content-Security-Policy runs only the site's script files.
document.querySelectorAll("button[data-copy]").forEach(function (button) {
  var source = document.getElementById(button.dataset.copy);
  if (!source) { return; }
  button.hidden = false;
  button.addEventListener("click", function () {
    var text = source.textContent;
    var done = function () { say(button, "Copied"); };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, function () { select(source); });
    } else {
      // Plain HTTP has no clipboard API: select the text, for the person to copy with their keys.
      select(source);
      say(button, "Selected: copy it");
    }
  });
});

function select(element) {
  var range = document.createRange();
  range.selectNodeContents(element);
  var selection = window.getSelection();
  selection.removeAllRanges();
  selection.addRange(range);
}

function say(button, text) {
  button.textContent = text;
  setTimeout(function () { button.textContent = "Copy"; }, 2000);
}
