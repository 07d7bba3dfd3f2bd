"""Every response carries X-Request-Id; an error names it and nothing internal; the log has the detail under it."""

import contextvars
import http.client
import io
import json
import logging
import re

import pytest

from llmgw.gateway import requestid
from llmgw.gateway.errors import ApiError
from llmgw.procs import free_port
from tests.conftest import Gateway, Sim, make_key, wait_until

CHAT = {"model": "sim", "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]}
MADE = re.compile(r"[0-9a-f]{16}")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("request-id")
    url = f"sqlite:///{tmp}/rid.db"
    sims = [Sim(model="sim", replica="good", ttft_ms=1, tokens_per_s=0),
            Sim(model="stalled", replica="stalled", ttft_ms=5000),
            Sim(model="stalling", replica="stalling", ttft_ms=1, tokens_per_s=100, stall_after_tokens=2)]
    dead_port = free_port()
    # Replica ids no message would contain by chance, so their absence means something.
    endpoints = [{"id": "replica-good-5", "url": sims[0].url, "models": ["sim"]},
                 {"id": "replica-dead-7", "url": f"http://127.0.0.1:{dead_port}", "models": ["dead"]},
                 {"id": "replica-stalled-8", "url": sims[1].url, "models": ["stalled"]},
                 {"id": "replica-stalling-9", "url": sims[2].url, "models": ["stalling"]}]
    key = make_key(url)
    gw = Gateway(tmp, url, endpoints=endpoints, workers=1, timeouts__first_byte=0.5, timeouts__idle=0.5,
                 routing__attempts=1, gateway__trusted_proxies=["127.0.0.2"])

    class Env:
        pass

    e = Env()
    e.gw, e.key, e.dead_port, e.sims = gw, key, dead_port, sims
    yield e
    gw.stop()
    for s in sims:
        s.stop()


def call(env, method, path, body=None, key=None, headers=None, source="127.0.0.1"):
    """(status, headers with lower-case names, body) of one request, from SOURCE."""
    conn = http.client.HTTPConnection("127.0.0.1", env.gw.port, timeout=30, source_address=(source, 0))
    hdrs = dict(headers or {})
    if key:
        hdrs["Authorization"] = f"Bearer {key}"
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        hdrs["Content-Type"] = "application/json"
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def assert_nothing_internal(env, message: str, replica: str, port: int, rid: str):
    assert f"(request id {rid})" in message
    rest = message.replace(rid, "")
    assert "127.0.0.1" not in rest and "http://" not in rest and str(port) not in rest
    assert replica not in rest and "replica-" not in rest


def log_line_with(env, rid: str) -> str:
    """The first line of the gateway's log tagged with RID, waited for."""
    tag = f"request_id={rid}"
    wait_until(f"a log line tagged {tag}", 10, lambda: tag in env.gw.log())
    return next(line for line in env.gw.log().splitlines() if tag in line)


def test_every_kind_of_response_carries_its_own_id(env):
    answers = {
        "health": call(env, "GET", "/health"),
        "ready": call(env, "GET", "/ready"),
        "models": call(env, "GET", "/v1/models", key=env.key),
        "chat": call(env, "POST", "/v1/chat/completions", CHAT, env.key),
        "stream": call(env, "POST", "/v1/chat/completions", {**CHAT, "stream": True}, env.key),
        "no such API": call(env, "POST", "/v1/nothing", CHAT, env.key),
        "no key": call(env, "POST", "/v1/chat/completions", CHAT),
        "page": call(env, "GET", "/login"),
        "no such page": call(env, "GET", "/no-such-page"),
        "chat page, signed out": call(env, "POST", "/chat/completions", CHAT),
    }
    statuses = {name: a[0] for name, a in answers.items()}
    assert statuses == {"health": 200, "ready": 200, "models": 200, "chat": 200, "stream": 200,
                        "no such API": 404, "no key": 401, "page": 200, "no such page": 404,
                        "chat page, signed out": 401}
    assert b"data: [DONE]" in answers["stream"][2]
    ids = {name: a[1].get("x-request-id") for name, a in answers.items()}
    assert all(rid and MADE.fullmatch(rid) for rid in ids.values()), ids
    assert len(set(ids.values())) == len(ids), "two requests shared an id"
    # An error object ends with the id of its own response.
    for name in ("no such API", "no key"):
        message = json.loads(answers[name][2])["error"]["message"]
        assert message.endswith(f"(request id {ids[name]})"), message


def test_a_dead_engine_error_names_no_host_port_or_replica_and_the_log_does(env):
    status, headers, raw = call(env, "POST", "/v1/chat/completions", {**CHAT, "model": "dead"}, env.key)
    rid = headers["x-request-id"]
    error = json.loads(raw)["error"]
    assert status == 502 and error["code"] == "upstream_error"
    assert "could not be reached" in error["message"] and "Try again" in error["message"]
    assert_nothing_internal(env, error["message"], "replica-dead-7", env.dead_port, rid)
    # The operator, given the id, finds the replica, its address and what failed.
    line = log_line_with(env, rid)
    assert "WARNING" in line and "replica-dead-7" in line and f"127.0.0.1:{env.dead_port}" in line


def test_a_timed_out_engine_error_names_nothing_internal(env):
    port = env.sims[1].port
    status, headers, raw = call(env, "POST", "/v1/chat/completions", {**CHAT, "model": "stalled"}, env.key)
    rid = headers["x-request-id"]
    error = json.loads(raw)["error"]
    assert status == 504 and error["code"] == "upstream_timeout" and "timed out" in error["message"]
    assert_nothing_internal(env, error["message"], "replica-stalled-8", port, rid)
    line = log_line_with(env, rid)
    assert "replica-stalled-8" in line and f"127.0.0.1:{port}" in line and "0.5 s" in line


def test_a_stream_broken_off_ends_with_an_event_naming_the_id_only(env):
    port = env.sims[2].port
    status, headers, raw = call(env, "POST", "/v1/chat/completions",
                                {**CHAT, "model": "stalling", "max_tokens": 10, "stream": True}, env.key)
    rid = headers["x-request-id"]
    events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert status == 200 and b"tok1" in events[1]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "upstream_timeout" and events[-1] == b"[DONE]"
    assert_nothing_internal(env, error["message"], "replica-stalling-9", port, rid)
    line = log_line_with(env, rid)
    assert "broke off" in line and "replica-stalling-9" in line and f"127.0.0.1:{port}" in line


def test_an_id_sent_by_a_client_is_kept_only_from_a_trusted_proxy(env):
    offered = "edge-4f2a9c1e-77"
    _, headers, raw = call(env, "POST", "/v1/chat/completions", CHAT, headers={"X-Request-Id": offered})
    replaced = headers["x-request-id"]
    assert replaced != offered and MADE.fullmatch(replaced)
    message = json.loads(raw)["error"]["message"]
    assert replaced in message and offered not in message
    # 127.0.0.2 is in gateway.trusted_proxies: its id follows the request, in the header and the error.
    _, headers, raw = call(env, "POST", "/v1/chat/completions", CHAT, headers={"X-Request-Id": offered},
                           source="127.0.0.2")
    assert headers["x-request-id"] == offered
    assert json.loads(raw)["error"]["message"].endswith(f"(request id {offered})")
    # Even a trusted proxy's id is replaced when it could forge a log line or bloat it.
    for odd in ("two words", "x" * 65, "a=b request_id=other"):
        _, headers, _ = call(env, "GET", "/health", headers={"X-Request-Id": odd}, source="127.0.0.2")
        assert MADE.fullmatch(headers["x-request-id"]), odd


def test_the_log_filter_tags_a_line_once_and_only_inside_a_request():
    outs = [io.StringIO(), io.StringIO()]
    handlers = [logging.StreamHandler(out) for out in outs]
    log = logging.getLogger("llmgw.test_request_id")
    log.propagate = False
    for h in handlers:
        h.addFilter(requestid.LogFilter())
        log.addHandler(h)

    def outside():
        log.warning("outside %s", "any request")
        return ApiError(502, "It failed.", "upstream_error").payload()["error"]["message"]

    def inside():
        requestid.current.set("abc123")
        log.warning("replica %s failed", "r1")
        return ApiError(502, "It failed.", "upstream_error").payload()["error"]["message"]

    # Each in a fresh context, as each greenlet has: a request served in this process earlier
    # (the pages' tests call the app directly) left its id in this thread's own.
    try:
        assert contextvars.Context().run(outside) == "It failed."
        assert contextvars.Context().run(inside) == "It failed. (request id abc123)"
        for out in outs:
            assert out.getvalue().splitlines() == ["outside any request", "replica r1 failed request_id=abc123"]
    finally:
        for h in handlers:
            log.removeHandler(h)
