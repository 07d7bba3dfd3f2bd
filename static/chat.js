// The chat page: streams an answer from /chat/completions, shows it as plain text while it arrives,
// then asks the server for its Markdown rendering (the server drops raw HTML and unsafe links).
// The conversation lives in this browser's localStorage, so a reload keeps it.
(function () {
  "use strict";
  var KEY = "llmgw-chat";
  var token = document.querySelector("meta[name=csrf-token]").content;
  var form = document.getElementById("chat");
  var log = document.getElementById("log");
  var statusLine = document.getElementById("status");
  var prompt = document.getElementById("prompt");
  var model = document.getElementById("model");
  var system = document.getElementById("system");
  var temperature = document.getElementById("temperature");
  var spend = document.getElementById("spend");
  var send = document.getElementById("send");
  var stop = document.getElementById("stop");
  var state = load();
  var controller = null;

  function load() {
    try { return JSON.parse(localStorage.getItem(KEY)) || { messages: [] }; } catch (e) { return { messages: [] }; }
  }
  function save() {
    state.model = model.value; state.system = system.value; state.temperature = temperature.value;
    state.spend = spend.value;
    localStorage.setItem(KEY, JSON.stringify(state));
  }

  // The spans of mathematics the server set aside (chatpage.render_markdown), typeset by KaTeX where the
  // page has it; one KaTeX cannot typeset stays the TeX the model wrote.
  function typeset(container) {
    if (!window.katex) { return; }
    Array.prototype.forEach.call(container.querySelectorAll("span.math"), function (span) {
      try {
        window.katex.render(span.textContent, span, { displayMode: span.dataset.display === "1", throwOnError: false,
                                                      maxSize: 20, maxExpand: 200 });
      } catch (e) { /* left as text */ }
    });
  }

  function bubble(message) {
    var div = document.createElement("div");
    div.className = "msg " + message.role;
    var body = document.createElement("div");
    body.className = "body";
    if (message.html) { body.innerHTML = message.html; body.classList.add("md"); typeset(body); } else { body.textContent = message.content; }
    div.appendChild(body);
    if (message.stats) {
      var stats = document.createElement("p");
      stats.className = "stats";
      stats.textContent = message.stats;
      div.appendChild(stats);
    }
    log.appendChild(div);
    return div;
  }
  function redraw() {
    log.textContent = "";
    state.messages.forEach(bubble);
  }

  function render(message, div) {
    return fetch("/chat/render", {
      method: "POST", headers: { "Content-Type": "application/json", "X-CSRF-Token": token },
      body: JSON.stringify({ text: message.content }), credentials: "same-origin"
    }).then(function (r) { return r.ok ? r.json() : null; }).then(function (data) {
      if (data && typeof data.html === "string") {
        message.html = data.html;
        div.querySelector(".body").innerHTML = data.html;
        div.querySelector(".body").classList.add("md");
        typeset(div.querySelector(".body"));
        save();
      }
    }).catch(function () {});
  }

  function statsLine(usage, started, first, ended, stopped, woken) {
    var parts = [];
    if (woken) { parts.push(woken.name + " started for this, in " + (woken.ms / 1000).toFixed(1) + " s"); }
    if (usage && usage.completion_tokens != null) {
      parts.push(usage.completion_tokens + " tokens");
      if (first && ended > first) {
        parts.push((usage.completion_tokens / ((ended - first) / 1000)).toFixed(1) + " tokens/s");
      }
    }
    if (first) { parts.push("first token after " + Math.round(first - started) + " ms"); }
    if (stopped) { parts.push("stopped"); }
    return parts.join(" · ");
  }

  function ask(woken) {
    var messages = [];
    if (system.value.trim()) { messages.push({ role: "system", content: system.value }); }
    state.messages.forEach(function (m) { if (!m.error) { messages.push({ role: m.role, content: m.content }); } });
    var body = { model: model.value, messages: messages, stream: true, stream_options: { include_usage: true } };
    var t = parseFloat(temperature.value);
    if (!isNaN(t)) { body.temperature = Math.min(2, Math.max(0, t)); }
    var max = model.selectedOptions[0] && model.selectedOptions[0].dataset.maxTokens;
    if (max) { body.max_tokens = parseInt(max, 10); }

    var answer = { role: "assistant", content: "" };
    var div = bubble(answer);
    var text = div.querySelector(".body");
    var started = performance.now(), first = null, usage = null, stopped = false;
    controller = new AbortController();
    send.disabled = true; stop.disabled = false;
    statusLine.textContent = "Waiting for " + model.value + "…";

    function finish(problem) {
      var ended = performance.now();
      controller = null;
      send.disabled = false; stop.disabled = true;
      statusLine.textContent = problem || "";
      if (problem && !answer.content) { answer.error = true; answer.content = problem; text.textContent = problem; }
      answer.stats = statsLine(usage, started, first, ended, stopped, woken);
      var s = document.createElement("p"); s.className = "stats"; s.textContent = answer.stats; div.appendChild(s);
      state.messages.push(answer);
      save();
      if (!answer.error && answer.content) { render(answer, div); }
    }

    fetch("/chat/completions", {
      method: "POST", signal: controller.signal, credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": token, "X-Llmgw-Spend": spend.value },
      body: JSON.stringify(body)
    }).then(function (resp) {
      if (!resp.ok) {
        return resp.json().then(function (e) { finish(e.error ? e.error.message : "Error " + resp.status); },
                                function () { finish("Error " + resp.status); });
      }
      var reader = resp.body.getReader(), decoder = new TextDecoder(), buffer = "";
      function pump() {
        return reader.read().then(function (chunk) {
          if (chunk.done) { finish(); return; }
          buffer += decoder.decode(chunk.value, { stream: true });
          var events = buffer.split("\n\n");
          buffer = events.pop();
          events.forEach(function (event) {
            event.split("\n").forEach(function (line) {
              if (line.indexOf(": ") === 0 && line.indexOf("loading") > 0) { statusLine.textContent = line.slice(2) + "…"; }
              if (line.indexOf("data: ") !== 0) { return; }
              var data = line.slice(6);
              if (data === "[DONE]") { return; }
              var parsed;
              try { parsed = JSON.parse(data); } catch (e) { return; }
              if (parsed.error) { statusLine.textContent = parsed.error.message; return; }
              if (parsed.usage) { usage = parsed.usage; }
              var delta = parsed.choices && parsed.choices[0] && parsed.choices[0].delta;
              if (delta && delta.content) {
                if (first === null) { first = performance.now(); statusLine.textContent = ""; }
                answer.content += delta.content;
                text.textContent = answer.content;
              }
            });
          });
          return pump();
        });
      }
      return pump();
    }).catch(function (e) {
      if (e.name === "AbortError") { stopped = true; finish(); } else { finish("The connection failed: " + e.message); }
    });
  }

  // A model that is not running is woken first, and the page says what it waits for (a node, its weights'
  // download, its engine) until it is ready; only then is the question sent, so a long start is no timeout.
  var waking = null;
  function whenReady(name, then) {
    var option = model.selectedOptions[0];
    if (!option || option.dataset.ready === "1") { then(); return; }
    waking = { cancelled: false };
    var mine = waking, asked = performance.now();
    send.disabled = true; stop.disabled = false;
    function said(text) { statusLine.textContent = "Starting " + name + ": " + text + "…"; }
    function done(problem, wasUp) {
      waking = null; send.disabled = false; stop.disabled = true;
      if (problem) { statusLine.textContent = problem; } else { then(wasUp ? null : { name: name, ms: performance.now() - asked }); }
    }
    fetch("/chat/wake", {
      method: "POST", credentials: "same-origin", body: JSON.stringify({ model: name }),
      headers: { "Content-Type": "application/json", "X-CSRF-Token": token, "X-Llmgw-Spend": spend.value }
    }).then(function (r) {
      if (r.ok) { return r.json(); }
      return r.text().then(function (t) {
        var told = new DOMParser().parseFromString(t, "text/html").querySelector("main p, p");
        return Promise.reject(new Error(told ? told.textContent : "HTTP " + r.status));
      });
    })
      .then(function (woken) {
        if (woken.ready) { option.dataset.ready = "1"; done(null, true); return; }
        said(woken.status);
        (function look() {
          if (mine.cancelled) { done("Stopped waiting for " + name + "."); return; }
          fetch("/chat/models", { credentials: "same-origin" }).then(function (r) { return r.json(); }).then(function (data) {
            var m = data.models.filter(function (x) { return x.name === name; })[0];
            if (!m) { done(name + " is no longer offered here."); return; }
            if (m.ready) { option.dataset.ready = "1"; done(); return; }
            said(m.status);
            setTimeout(look, 2000);
          }).catch(function () { setTimeout(look, 2000); });
        })();
      }).catch(function (e) { done("Could not start " + name + ": " + e.message); });
  }

  form.addEventListener("submit", function (e) {
    e.preventDefault();
    if (controller || waking || !prompt.value.trim()) { return; }
    var message = { role: "user", content: prompt.value };
    state.messages.push(message);
    bubble(message);
    prompt.value = "";
    save();
    whenReady(model.value, ask);
  });
  prompt.addEventListener("keydown", function (e) {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); form.requestSubmit(); }
  });
  stop.addEventListener("click", function () {
    if (controller) { controller.abort(); }
    if (waking) { waking.cancelled = true; }
  });
  document.getElementById("clear").addEventListener("click", function () {
    state.messages = []; save(); redraw();
  });
  [model, system, temperature, spend].forEach(function (el) { el.addEventListener("change", save); });

  // While any model is not running, look every few seconds, so the picker says when one is ready.
  function refreshModels() {
    fetch("/chat/models", { credentials: "same-origin" }).then(function (r) { return r.ok ? r.json() : null; })
      .then(function (data) {
        if (!data) { return; }
        var waiting = false;
        data.models.forEach(function (m) {
          var option = Array.prototype.find.call(model.options, function (o) { return o.value === m.name; });
          if (!option) { return; }
          option.textContent = m.name + (m.ready ? "" : " (" + m.status + ")");
          option.dataset.ready = m.ready ? "1" : "0";
          waiting = waiting || !m.ready;
        });
        if (waiting) { setTimeout(refreshModels, 3000); }
      }).catch(function () {});
  }
  if (Array.prototype.some.call(model.options, function (o) { return / \(/.test(o.textContent); })) {
    setTimeout(refreshModels, 3000);
  }

  if (state.model && Array.prototype.some.call(model.options, function (o) { return o.value === state.model; })) {
    model.value = state.model;
  }
  if (state.spend && spend.tagName === "SELECT" &&
      Array.prototype.some.call(spend.options, function (o) { return o.value === state.spend; })) {
    spend.value = state.spend;  // what the person chose last time, while it is still theirs to choose
  }
  if (state.system) { system.value = state.system; }
  if (state.temperature) { temperature.value = state.temperature; }
  redraw();
})();
