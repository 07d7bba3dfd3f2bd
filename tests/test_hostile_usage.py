"""An engine's usage is believed only within what the request could have used: a real gateway in front of an
engine (a small HTTP server here) that reports whatever usage the prompt asks it to.

A hostile engine reporting 1,000,000 completion tokens for `max_tokens: 2` was billed as such, and one
reporting -5 got the client a 500 page and lost the usage row.
"""

import http.server
import json
import threading

import pytest
import sqlalchemy as sa

from llmgw import store
from tests.conftest import Gateway, make_key, post, wait_until


class LyingEngine(http.server.BaseHTTPRequestHandler):
    """Answers a chat with "ok", in two deltas when streamed, and the usage its user message holds as JSON;
    counts a text a token a byte on `/tokenize` (so the gateway's own count of a prompt is its bytes)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            content = body.get("content")
            return self._json(200, {"tokens": [1] * len(content.encode()) if isinstance(content, str) else []})
        if self.path != "/v1/chat/completions":
            return self._json(404, {"error": {"message": "not here", "type": "not_found"}})
        usage = json.loads(body["messages"][-1]["content"])
        if not body.get("stream"):
            return self._json(200, {"id": "x", "object": "chat.completion", "model": body["model"], "usage": usage,
                                    "choices": [{"index": 0, "finish_reason": "stop",
                                                 "message": {"role": "assistant", "content": "ok"}}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = {"id": "x", "object": "chat.completion.chunk", "model": body["model"]}
        events = [{**chunk, "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                  for piece in ("o", "k")]
        events += [{**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                   {**chunk, "choices": [], "usage": usage}]
        for event in [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]:
            data = event.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.write(b"0\r\n\r\n")

    def _json(self, status, value):
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def liar(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile_usage")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), LyingEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"sqlite:///{tmp}/usage.db"
    key = make_key(url)
    gw = Gateway(tmp, url, endpoints=[{"id": "liar", "url": f"http://127.0.0.1:{server.server_port}",
                                       "models": ["m"]}], workers=1)
    yield gw, key, url
    gw.stop()
    server.shutdown()
    server.server_close()


def rows(url):
    engine = store.open_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.select(store.usage).order_by(store.usage.c.id)).all()
    finally:
        engine.dispose()


def ask(gw, key, url, usage: dict, stream: bool, path="/v1/chat/completions", **more):
    """Send a request whose engine reports USAGE; (the client's status, its answer, the usage row)."""
    before = len(rows(url))
    content = json.dumps(usage)
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2, "stream": stream,
            **more}
    status, _, raw = post(gw.url + path, body, key)
    wait_until("the usage row", 30, lambda: len(rows(url)) > before)
    return status, raw, rows(url)[before]


# The engine's figures, and what is billed: (prompt, completion).
CASES = {
    "a million for max_tokens 2": ({"prompt_tokens": 50, "completion_tokens": 1_000_000}, (50, 2)),
    "a negative completion": ({"prompt_tokens": 50, "completion_tokens": -5}, (50, None)),
    "a negative prompt": ({"prompt_tokens": -5, "completion_tokens": 2}, (None, 2)),
    "a boolean": ({"prompt_tokens": True, "completion_tokens": 2}, (None, 2)),
    "a fraction": ({"prompt_tokens": 50, "completion_tokens": 1.5}, (50, None)),
    "a string": ({"prompt_tokens": "5", "completion_tokens": 2}, (None, 2)),
    "past any column": ({"prompt_tokens": 10**30, "completion_tokens": 10**30}, (None, None)),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", CASES)
def test_an_engines_usage_is_billed_only_within_what_was_asked(liar, case, stream):
    gw, key, url = liar
    usage, (prompt, completion) = CASES[case]
    status, raw, row = ask(gw, key, url, usage, stream)
    assert status == 200, raw
    if stream:
        assert raw.rstrip().endswith(b"data: [DONE]") and b'"ok"' not in raw and b'"k"' in raw
    else:
        assert json.loads(raw)["choices"][0]["message"]["content"] == "ok"
    assert row.status == 200
    # A figure that is not a count is the gateway's own: the prompt as the engine's tokenizer counts it (its
    # bytes here), the completion as served (one token of the two-character answer; two deltas streamed).
    own = (len(json.dumps(usage).encode()), 2 if stream else 1)
    assert (row.prompt_tokens, row.completion_tokens) == (prompt or own[0], completion or own[1])


def test_an_anthropic_client_is_answered_whatever_the_engine_reports(liar):
    gw, key, url = liar
    for stream in (False, True):
        status, raw, row = ask(gw, key, url, {"prompt_tokens": -5, "completion_tokens": 1_000_000}, stream,
                               "/v1/messages")
        assert status == 200 and row.status == 200 and row.completion_tokens == 2, raw
