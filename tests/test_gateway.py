"""The OpenAI API through a real gateway (gunicorn, two gevent workers) in front of simulated engines."""

import http.client
import json
import os
import socket
import subprocess
import sys
import time

import openai
import pytest
from click.testing import CliRunner

from bench.procstat import children
from llmgw import store
from llmgw.cli.main import main as cli
from llmgw.people import keys
from llmgw.procs import free_port
from tests.conftest import ROOT, Gateway, Sim, make_key, post, wait_until, write_config


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    url = f"sqlite:///{tmp}/gw.db"
    engine = store.open_store(url)
    engine.dispose()
    sims = [Sim(model="sim", replica=f"s{i}", ttft_ms=5, tokens_per_s=500) for i in range(2)]
    embed = Sim(model="embedder", replica="e", ttft_ms=0, tokens_per_s=0)
    endpoints = [{"id": f"s{i}", "url": s.url, "models": ["sim"]} for i, s in enumerate(sims)]
    endpoints.append({"id": "e", "url": embed.url, "models": ["embedder"]})
    models = [{"name": "sim", "aliases": ["sim-alias", "fast"], "description": "the simulated engine",
               "max_output": 1000}]
    key = make_key(url)
    gw = Gateway(tmp, url, endpoints=endpoints, models=models, workers=2,
                 gateway__trusted_proxies=["127.0.0.2"], gateway__contact="the platform team")

    class Env:
        pass

    e = Env()
    e.gw, e.url, e.key, e.sims, e.store = gw, gw.url, key, sims, url
    e.client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    yield e
    e.client.close()
    gw.stop()
    for s in sims + [embed]:
        s.stop()


def test_chat_completion(env):
    reply = env.client.chat.completions.create(model="sim", max_tokens=4,
                                               messages=[{"role": "user", "content": "hello there"}])
    assert reply.choices[0].message.content == "tok0 tok1 tok2 tok3 "
    assert reply.usage.completion_tokens == 4


def test_chat_stream_without_usage_asked(env):
    stream = env.client.chat.completions.create(model="sim", max_tokens=5, stream=True,
                                                messages=[{"role": "user", "content": "hi"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok0 tok1 tok2 tok3 tok4 "
    # The gateway asked the engine for usage on the client's behalf; the client did not ask, so sees none.
    assert all(c.usage is None for c in chunks)


def test_chat_stream_with_usage_asked(env):
    stream = env.client.chat.completions.create(model="sim", max_tokens=3, stream=True,
                                                stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": "hi"}])
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].choices == []


def test_completions_plain_and_streamed(env):
    reply = env.client.completions.create(model="sim", prompt="once upon", max_tokens=2)
    assert reply.choices[0].text == "tok0 tok1 "
    streamed = "".join(c.choices[0].text for c in env.client.completions.create(
        model="sim", prompt="once upon", max_tokens=3, stream=True) if c.choices)
    assert streamed == "tok0 tok1 tok2 "


def test_embeddings(env):
    result = env.client.embeddings.create(model="embedder", input=["a", "b c"])
    assert len(result.data) == 2 and len(result.data[0].embedding) == 16
    assert result.usage.prompt_tokens == 3


def test_model_list_shows_each_alias(env):
    ids = {m.id: m for m in env.client.models.list()}
    assert set(ids) == {"sim", "sim-alias", "fast", "embedder"}
    assert ids["fast"].model_extra["root"] == "sim"


def test_one_model_by_its_id_or_alias(env):
    model = env.client.models.retrieve("fast")
    assert model.id == "fast" and model.model_extra["root"] == "sim" and model.model_extra["max_context"] is None
    assert env.client.models.retrieve("sim").model_extra["description"] == "the simulated engine"
    assert "description" not in env.client.models.retrieve("embedder").model_extra  # nobody wrote one
    with pytest.raises(openai.NotFoundError) as e:
        env.client.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found" and "sim-alias" in e.value.body["message"]
    conn = http.client.HTTPConnection("127.0.0.1", env.gw.port, timeout=5)
    conn.request("GET", "/v1/models/sim")
    assert conn.getresponse().status == 401  # a key is needed, as for the list
    conn.close()


def test_an_alias_is_served_by_its_model(env):
    reply = env.client.chat.completions.create(model="fast", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert reply.model == "sim"


def test_usage_rows_are_written_with_tokens_for_every_request(env):
    started = time.time()
    for _ in range(3):
        list(env.client.chat.completions.create(model="fast", max_tokens=2, stream=True,
                                                messages=[{"role": "user", "content": "count me"}]))
    engine = store.open_engine(env.store)

    def rows():
        with engine.connect() as conn:
            return conn.execute(store.usage.select().where(store.usage.c.at >= started)).all()

    wait_until("usage rows", 30, lambda: len(rows()) == 3)
    for row in rows():
        # Tokens are known even though the client never asked for usage.
        assert (row.stream, row.status, row.completion_tokens, row.prompt_tokens) == (True, 200, 2, 2)
        assert (row.model_asked, row.model_served, row.endpoint) == ("fast", "sim", "chat")
        assert row.ttft_ms is not None and row.latency_ms >= row.ttft_ms
        assert row.replica in ("s0", "s1")
    engine.dispose()


def test_every_response_says_what_the_gateway_added(env):
    status, headers, _ = post(env.url + "/v1/chat/completions",
                              {"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
                              env.key)
    assert status == 200 and float(headers["X-Llmgw-Overhead-Ms"]) < 50
    status, headers, _ = post(env.url + "/v1/chat/completions", b"{", env.key)
    assert status == 400 and "X-Llmgw-Overhead-Ms" in headers
    assert "x-llmgw-overhead-ms" in env.client.models.with_raw_response.list().headers


def test_the_workers_parse_request_heads_with_gunicorns_c_parser(env):
    # server.py asks for it ("fast"); this checks it is the one each worker loads (at its first request's parse).
    workers = children(env.gw.proc.pid)
    assert len(workers) == 2

    def loaded(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as f:
            return "gunicorn_h1c" in f.read()

    def every_worker_has_it() -> bool:
        post(env.url + "/v1/chat/completions", {"model": "sim", "max_tokens": 1,
                                                "messages": [{"role": "user", "content": "x"}]}, env.key)
        return all(loaded(pid) for pid in workers)

    wait_until("every worker loading gunicorn_h1c", 60, every_worker_has_it)


def test_a_gateway_without_gunicorns_c_parser_refuses_to_start_saying_what_to_install(tmp_path):
    # gunicorn looks for the parser at each request: started without it, every request got a 500.
    shim = tmp_path / "shim" / "gunicorn_h1c"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('not built on this machine')\n")
    config = write_config(tmp_path / "gateway.toml", {
        "gateway.listen": f"127.0.0.1:{free_port()}", "gateway.metrics_listen": f"127.0.0.1:{free_port()}",
        "store.url": f"sqlite:///{tmp_path}/gw.db"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim.parent), ROOT])}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "gateway.py"), "--config", config], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert "gunicorn_h1c" in run.stderr and "pip install gunicorn_h1c" in run.stderr


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[]", None),
    ({"model": "sim", "messages": "hello"}, "messages"),
    ({"model": "sim", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"model": "sim", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, "max_tokens"),
    ({"model": "sim", "messages": [{"role": "user", "content": "x"}], "temperature": 7}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
])
def test_malformed_requests_get_400_in_openai_format(env, body, param):
    status, _, raw = post(env.url + "/v1/chat/completions", body, env.key)
    error = json.loads(raw)["error"]
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param


def test_max_tokens_beyond_the_models_limit(env):
    with pytest.raises(openai.BadRequestError, match="max_tokens is 5000, but sim allows at most 1000"):
        env.client.chat.completions.create(model="sim", max_tokens=5000, messages=[{"role": "user", "content": "x"}])


def test_unknown_model_is_404_with_the_list(env):
    with pytest.raises(openai.NotFoundError) as e:
        env.client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert "gpt-9" in str(e.value) and "sim-alias" in str(e.value) and "/v1/models" in str(e.value)


def test_missing_and_unknown_keys_are_401(env):
    status, _, raw = post(env.url + "/v1/chat/completions", {"model": "sim"})
    assert status == 401 and json.loads(raw)["error"]["code"] == "missing_api_key"
    bad = openai.OpenAI(base_url=env.url + "/v1", api_key="sk-llmgw-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="not known here"):
        bad.models.list()
    bad.close()


def test_wrong_method_and_unknown_path(env):
    conn = http.client.HTTPConnection("127.0.0.1", env.gw.port, timeout=5)
    conn.request("GET", "/v1/chat/completions", headers={"Authorization": f"Bearer {env.key}"})
    resp = conn.getresponse()
    assert resp.status == 405 and "Use POST" in resp.read().decode()
    conn.request("POST", "/v1/images/generations", body=b"{}", headers={"Authorization": f"Bearer {env.key}"})
    resp = conn.getresponse()
    assert resp.status == 404 and "/v1/chat/completions" in resp.read().decode()
    conn.close()


def test_oversize_body_is_refused_before_it_is_read(env):
    sock = socket.create_connection(("127.0.0.1", env.gw.port), timeout=5)
    # Only the head is sent: a gateway that waited for 40 MB of body would never answer.
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + env.key.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: 40000000\r\n\r\n")
    reply = sock.recv(65536)
    head, _, body = reply.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(65536)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413") and b"gateway.max_body_bytes" in body


def test_garbage_never_crashes_a_worker(env):
    for raw in (b"\x00\x01\x02", b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
                b"POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n"):
        sock = socket.create_connection(("127.0.0.1", env.gw.port), timeout=5)
        sock.sendall(raw)
        try:
            sock.recv(4096)
        except OSError:
            pass
        sock.close()
    status, _, body = post(env.url + "/v1/chat/completions",
                           {"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}, env.key)
    assert status == 200
    assert "Worker exiting" not in env.gw.log() and "Traceback" not in env.gw.log()


def test_revoked_key_stops_on_every_worker(env):
    engine = store.open_engine(env.store)
    record, secret = keys.create_key(engine, "soon-revoked")
    engine.dispose()
    body = {"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    wait_until("the new key to reach the workers", 30,
                lambda: all(post(env.url + "/v1/chat/completions", body, secret)[0] == 200 for _ in range(6)))
    result = CliRunner().invoke(cli, ["--store", env.store, "keys", "revoke", record.id])
    assert result.exit_code == 0
    # Workers take the revocation within a second when the machine is not loaded; fresh connections land on
    # both workers, and none may go on accepting the key.
    statuses = []
    wait_until("every worker to refuse the revoked key", 30, lambda: statuses.append(
        [post(env.url + "/v1/chat/completions", body, secret) for _ in range(20)]) or
        {s for s, _, _ in statuses[-1]} == {401})
    assert all(b"revoked" in raw for _, _, raw in statuses[-1])


def test_expired_key(env):
    engine = store.open_engine(env.store)
    # Ten seconds: every worker reloads the keys within one or two, even on a loaded machine, so each holds
    # the key before it expires (a worker that never saw it would say "not known" instead).
    _, secret = keys.create_key(engine, "brief", expires_in=10)
    engine.dispose()
    body = {"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    wait_until("the key to work", 30, lambda: post(env.url + "/v1/chat/completions", body, secret)[0] == 200)
    # (A 401 before then may be a worker that has not reloaded yet: wait for the expiry itself.)
    wait_until("the key to expire", 30, lambda: b"expired" in post(env.url + "/v1/chat/completions", body, secret)[2])
    answers = [post(env.url + "/v1/chat/completions", body, secret) for _ in range(6)]
    assert all(status == 401 and b"expired" in raw for status, _, raw in answers)


def test_health_and_ready_need_no_key(env):
    for path in ("/health", "/ready"):
        conn = http.client.HTTPConnection("127.0.0.1", env.gw.port, timeout=5)
        conn.request("GET", path)
        assert conn.getresponse().status == 200
        conn.close()


def test_landing_page_believes_forwarded_headers_only_from_trusted_proxies(env):
    headers = {"X-Forwarded-Host": "llm.example.org", "X-Forwarded-Proto": "https"}
    untrusted = http.client.HTTPConnection("127.0.0.1", env.gw.port, timeout=5)
    untrusted.request("GET", "/", headers=headers)
    page = untrusted.getresponse().read().decode()
    assert f"http://127.0.0.1:{env.gw.port}/v1" in page and "llm.example.org" not in page
    assert "the platform team" in page and "sim-alias" in page
    untrusted.close()
    trusted = http.client.HTTPConnection("127.0.0.1", env.gw.port, timeout=5, source_address=("127.0.0.2", 0))
    trusted.request("GET", "/", headers=headers)
    assert "https://llm.example.org/v1" in trusted.getresponse().read().decode()
    trusted.close()


def test_metrics_are_summed_over_workers_on_their_own_address(env):
    for _ in range(4):
        env.client.chat.completions.create(model="sim", max_tokens=1, messages=[{"role": "user", "content": "m"}])
    # A time to first token is a stream's: sent here, not left to whichever test ran before on this fixture.
    list(env.client.chat.completions.create(model="sim", max_tokens=1, stream=True,
                                            messages=[{"role": "user", "content": "m"}]))
    # The replicas' gauges come from the watcher's round after a worker first routed to their model.
    text = env.gw.metrics_once("4 requests counted and the replicas' gauges", lambda text: env.gw.metric_total(
        'llmgw_requests_total{model="sim",status="200"}', text) >= 4 and 'llmgw_endpoint_breaker_open{replica="s0"}'
        in text and 'llmgw_endpoint_metrics_stale{replica="s1"}' in text)
    for name in ("llmgw_requests_total{model=\"sim\",status=\"200\"}", "llmgw_request_duration_seconds_bucket",
                 "llmgw_ttft_seconds_bucket", "llmgw_tokens_total{direction=\"out\",model=\"sim\"}",
                 "llmgw_requests_in_flight", "llmgw_endpoint_breaker_open{replica=\"s0\"}",
                 "llmgw_endpoint_metrics_stale{replica=\"s1\"}", "llmgw_gateway_overhead_seconds_bucket"):
        assert name in text, name
    requests = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith('llmgw_requests_total{model="sim",status="200"}'))
    assert requests >= 4
    # The engines' own figures are fresh: a worker reads those of the models it routes to every second.
    env.gw.metrics_once("s0's figures fresh", lambda text: 'llmgw_endpoint_metrics_stale{replica="s0"} 0.0' in text)
    # The metrics address serves nothing else.
    conn = http.client.HTTPConnection("127.0.0.1", env.gw.metrics_port, timeout=5)
    conn.request("GET", "/v1/models")
    resp = conn.getresponse()
    assert resp.status == 404 and b"llmgw_" not in resp.read()
    conn.close()
