"""Engines that fail, stall, die and come back; clients that leave; a gateway that stops."""

import json
import signal
import socket
import threading
import time

import openai
import pytest

from llmgw.procs import free_port, http_status
from tests.conftest import Sim, count_usage, make_key, open_stream, post, read_until, wait_until

CHAT = {"model": "sim", "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]}


def setup(tmp_path, make_gateway, endpoints, workers=1, **settings):
    url = f"sqlite:///{tmp_path}/faults.db"
    key = make_key(url)
    gw = make_gateway(store_url=url, endpoints=endpoints, workers=workers, **settings)
    return gw, key, url


def ep(rid, url):
    return {"id": rid, "url": url, "models": ["sim"]}


def dead_url():
    return f"http://127.0.0.1:{free_port()}"


def stream_events(url, key, body, timeout=30):
    """Every SSE `data:` payload of a streamed answer, read with a raw socket."""
    payload = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=timeout)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(payload)).encode() +
                 b"\r\nConnection: close\r\n\r\n" + payload)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head, [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]


def test_engine_down_is_502_saying_what_to_do(tmp_path, make_gateway):
    gw, key, _ = setup(tmp_path, make_gateway, [ep("gone", dead_url())])
    status, headers, raw = post(gw.url + "/v1/chat/completions", CHAT, key)
    error = json.loads(raw)["error"]
    assert status == 502 and error["code"] == "upstream_error"
    assert "could not be reached" in error["message"] and "Try again" in error["message"]
    # The replica and its address are the operator's to know (the log has them), not the client's.
    assert "gone" not in error["message"] and "127.0.0.1" not in error["message"]


def test_a_model_with_no_replica_is_503_with_retry_after(tmp_path, make_gateway):
    # Known to the catalog ([[models]]) but served by no endpoint.
    gw, key, _ = setup(tmp_path, make_gateway, [], models=[{"name": "sim"}])
    status, headers, raw = post(gw.url + "/v1/chat/completions", CHAT, key)
    assert status == 503 and headers["Retry-After"] == "5"
    assert "has no replica running" in json.loads(raw)["error"]["message"]
    unknown = post(gw.url + "/v1/chat/completions", {**CHAT, "model": "other"}, key)
    assert unknown[0] == 404  # a name nobody configured is a different mistake
    assert http_status(gw.url + "/ready") == 503


def test_a_failed_attempt_is_retried_on_another_replica(tmp_path, make_gateway, make_sim):
    good = make_sim(replica="good", ttft_ms=1, tokens_per_s=0)
    # 503 says the replica cannot serve now (llama.cpp loading its model), not that the request is wrong.
    loading = make_sim(replica="loading", loading=True)
    gw, key, _ = setup(tmp_path, make_gateway, [ep("dead", dead_url()), ep("loading", loading.url),
                                               ep("good", good.url)], breaker__failures=1000,
                       routing__affinity_prefix_bytes=0)
    for _ in range(20):
        status, _, raw = post(gw.url + "/v1/chat/completions", CHAT, key)
        assert status == 200 and json.loads(raw)["system_fingerprint"] == "sim-good"
    gw.metrics_once("the retries counted", lambda text: gw.metric_total("llmgw_upstream_retries_total", text))


def test_breaker_opens_and_a_probe_closes_it(tmp_path, make_gateway, make_sim):
    good = make_sim(replica="good", ttft_ms=1, tokens_per_s=0)
    port = free_port()
    flaky = Sim(replica="flaky", port=port, loading=True)
    try:
        gw, key, _ = setup(tmp_path, make_gateway, [ep("flaky", flaky.url), ep("good", good.url)],
                           breaker__failures=3, breaker__cooldown=1.0, routing__affinity_prefix_bytes=0)
        for _ in range(30):
            assert post(gw.url + "/v1/chat/completions", CHAT, key)[0] == 200
        # Three failures (each retried on the good replica) opened the breaker; nothing more was sent there.
        assert gw.settled_total('llmgw_upstream_retries_total{reason="status"}') == 3
        wait_until("the breaker gauge", 30, lambda: 'llmgw_endpoint_breaker_open{replica="flaky"} 1.0' in gw.metrics())
        # The replica is mended; the probe after the cooldown brings it back.
        flaky.stop()
        flaky = Sim(replica="flaky", port=port, ttft_ms=1, tokens_per_s=0)
        wait_until("the probe to close the breaker", 30,
                   lambda: 'llmgw_endpoint_breaker_open{replica="flaky"} 0.0' in gw.metrics())
        served = {json.loads(post(gw.url + "/v1/chat/completions", CHAT, key)[2])["system_fingerprint"]
                  for _ in range(30)}
        assert served == {"sim-good", "sim-flaky"}
    finally:
        flaky.stop()


def test_every_replica_out_of_rotation_is_503_with_retry_after(tmp_path, make_gateway):
    gw, key, _ = setup(tmp_path, make_gateway, [ep("gone", dead_url())], breaker__failures=2,
                       breaker__cooldown=30.0)
    assert post(gw.url + "/v1/chat/completions", CHAT, key)[0] == 502
    assert post(gw.url + "/v1/chat/completions", CHAT, key)[0] == 502
    status, headers, raw = post(gw.url + "/v1/chat/completions", CHAT, key)
    assert status == 503 and headers["Retry-After"] == "30"
    assert "in rotation" in json.loads(raw)["error"]["message"]
    assert http_status(gw.url + "/ready") == 503


def test_ready_follows_the_replicas(tmp_path, make_gateway):
    gw, key, _ = setup(tmp_path, make_gateway, [ep("gone", dead_url())], breaker__failures=1, breaker__cooldown=60.0)
    assert http_status(gw.url + "/ready") == 200
    post(gw.url + "/v1/chat/completions", CHAT, key)
    assert http_status(gw.url + "/ready") == 503


def test_engine_dying_mid_stream_ends_it_with_an_error_event(tmp_path, make_gateway, make_sim):
    dying = make_sim(replica="dying", ttft_ms=1, tokens_per_s=50, die_after=1)
    gw, key, url = setup(tmp_path, make_gateway, [ep("dying", dying.url)])
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=20)
    started = time.monotonic()
    received = []
    with pytest.raises(openai.APIError, match="failed"):
        for chunk in client.chat.completions.create(model="sim", max_tokens=10, stream=True,
                                                    messages=[{"role": "user", "content": "x"}]):
            received.append(chunk)
    assert received and time.monotonic() - started < 5  # tokens came, then an error; no hang
    client.close()
    wait_until("the usage row", 30, lambda: count_usage(url, status=502) == 1)


def test_client_disconnect_closes_the_engines_request_within_a_second(tmp_path, make_gateway, make_sim):
    # Twenty tokens a second: the engine notices a closed connection on its next write, 50 ms later.
    slow = make_sim(replica="slow", ttft_ms=1, tokens_per_s=20, default_tokens=200)
    gw, key, url = setup(tmp_path, make_gateway, [ep("slow", slow.url)])
    sock = open_stream(gw.port, key, {**CHAT, "max_tokens": 200}, timeout=10)
    read_until(sock, lambda received: b"tok0" in received)
    assert slow.metrics()["vllm:num_requests_running"] == 1
    sock.close()
    left = time.monotonic()
    wait_until("the engine to see its client leave", 10,
               lambda: slow.metrics()["vllm:num_requests_running"] == 0)
    assert time.monotonic() - left < 1.0
    assert slow.metrics()["llmgw_sim_cancelled_total"] == 1
    wait_until("the usage row", 30, lambda: count_usage(url, status=499) == 1)


def test_a_client_that_leaves_before_a_whole_answer_cancels_it(tmp_path, make_gateway, make_sim):
    # The engine takes ten seconds to begin its answer. The request used to stay in flight, the engine
    # working for nobody, until it answered or timeouts.first_byte passed.
    slow = make_sim(replica="slow", ttft_ms=10_000)
    gw, key, url = setup(tmp_path, make_gateway, [ep("slow", slow.url)])
    body = json.dumps(CHAT).encode()
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                 + body)
    wait_until("the engine to have the request", 10, lambda: slow.metrics()["vllm:num_requests_running"] == 1)
    sock.close()
    left = time.monotonic()
    wait_until("the request to end as one whose client left", 10, lambda: count_usage(url, status=499) == 1)
    assert time.monotonic() - left < 3.0
    # The gateway holds nothing for it: a request that comes now is served at once by the same worker.
    assert slow.metrics()["vllm:num_requests_running"] in (0, 1)


def test_a_client_that_sends_its_next_request_during_a_stream_has_not_left(tmp_path, make_gateway, make_sim):
    # Its socket turns readable mid-stream, as a client's that hung up does: the stream is still served whole,
    # and the next request after it.
    slow = make_sim(replica="slow", ttft_ms=1, tokens_per_s=50, default_tokens=10)
    gw, key, url = setup(tmp_path, make_gateway, [ep("slow", slow.url)])
    sock = open_stream(gw.port, key, {**CHAT, "max_tokens": 10})
    received = read_until(sock, lambda received: b"tok0" in received)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    received = read_until(sock, lambda received: received.count(b"HTTP/1.1 200") == 2 and b"\r\n\r\n" in
                          received.rsplit(b"HTTP/1.1 200", 1)[1], received)
    stream, health = received.split(b"HTTP/1.1 200", 2)[1:]
    assert b"tok9" in stream and b"data: [DONE]" in stream and b"Content-Length: 0" in health
    sock.close()
    assert slow.metrics()["llmgw_sim_cancelled_total"] == 0
    wait_until("the usage row", 30, lambda: count_usage(url, status=200) == 1)


def test_first_byte_timeout_is_504(tmp_path, make_gateway, make_sim):
    stalled = make_sim(replica="stalled", ttft_ms=5000)
    gw, key, _ = setup(tmp_path, make_gateway, [ep("stalled", stalled.url)], timeouts__first_byte=0.5,
                       routing__attempts=1)
    started = time.monotonic()
    status, _, raw = post(gw.url + "/v1/chat/completions", CHAT, key)
    assert status == 504 and "timed out" in json.loads(raw)["error"]["message"]
    assert time.monotonic() - started < 2


def test_idle_timeout_ends_a_stalled_stream(tmp_path, make_gateway, make_sim):
    stalled = make_sim(replica="stalled", ttft_ms=1, tokens_per_s=100, stall_after_tokens=2)
    gw, key, _ = setup(tmp_path, make_gateway, [ep("stalled", stalled.url)], timeouts__idle=0.5)
    started = time.monotonic()
    head, events = stream_events(gw.url, key, {**CHAT, "max_tokens": 10})
    assert head.startswith(b"HTTP/1.1 200")
    assert b"tok1" in events[1] and b"timed out" in events[-2] and events[-1] == b"[DONE]"
    assert time.monotonic() - started < 2


def test_an_engine_reading_a_long_prompt_is_waited_for_while_it_sends_only_comments(tmp_path, make_gateway,
                                                                                    make_sim):
    # llama.cpp sends its headers at once, then a `:` line every 30 s while it reads a long prompt: a coding
    # agent's 4,000 tokens took a busy CPU over two minutes, and the gateway ended the stream after the first
    # comment and 60 s of timeouts.idle. Until the first event, the wait is the first byte's.
    slow = make_sim(replica="slow", ttft_ms=4000, keepalive_ms=1500, tokens_per_s=100)
    gw, key, _ = setup(tmp_path, make_gateway, [ep("slow", slow.url)], timeouts__idle=1.0, timeouts__first_byte=20,
                       routing__attempts=1)
    head, events = stream_events(gw.url, key, {**CHAT, "max_tokens": 3})
    assert head.startswith(b"HTTP/1.1 200")
    assert b"tok2" in b"".join(events) and not any(b"timed out" in e for e in events), events
    # Once the answer has begun, silence is timeouts.idle's again.
    stalled = make_sim(replica="stalled", ttft_ms=1, keepalive_ms=100, tokens_per_s=100, stall_after_tokens=2)
    (tmp_path / "second").mkdir(mode=0o700)
    gw2, key2, _ = setup(tmp_path / "second", make_gateway, [ep("stalled", stalled.url)], timeouts__idle=0.5,
                         timeouts__first_byte=20)
    started = time.monotonic()
    _, events = stream_events(gw2.url, key2, {**CHAT, "max_tokens": 10})
    assert b"timed out" in events[-2] and time.monotonic() - started < 5


def test_total_timeout_ends_a_slow_stream(tmp_path, make_gateway, make_sim):
    slow = make_sim(replica="slow", ttft_ms=1, tokens_per_s=5)
    gw, key, _ = setup(tmp_path, make_gateway, [ep("slow", slow.url)], timeouts__idle=5.0, timeouts__total=1.0)
    started = time.monotonic()
    _, events = stream_events(gw.url, key, {**CHAT, "max_tokens": 50})
    assert b"timed out" in events[-2] and 0.9 < time.monotonic() - started < 2.5


def test_connect_timeout(tmp_path, make_gateway, make_sim):
    # A listener that never accepts, its queue already full: connecting hangs rather than failing.
    blackhole = socket.socket()
    blackhole.bind(("127.0.0.1", 0))
    blackhole.listen(0)
    fillers = []
    for _ in range(4):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(blackhole.getsockname())
        fillers.append(s)
    good = make_sim(replica="good", ttft_ms=1, tokens_per_s=0)
    url = f"http://127.0.0.1:{blackhole.getsockname()[1]}"
    gw, key, _ = setup(tmp_path, make_gateway, [ep("hole", url), ep("good", good.url)], timeouts__connect=0.3,
                       breaker__failures=1000, routing__affinity_prefix_bytes=0)
    try:
        # Each request tries one of the two first at random (neither is busier), so 6 missed the hole one run in
        # 64; 30 miss it once in a billion.
        for _ in range(30):
            started = time.monotonic()
            status, _, raw = post(gw.url + "/v1/chat/completions", CHAT, key)
            assert status == 200 and time.monotonic() - started < 1.5
        gw.metrics_once("the retries counted", lambda text: 'llmgw_upstream_retries_total{reason="connect"}' in text)
    finally:
        for s in fillers:
            s.close()
        blackhole.close()


def test_graceful_stop_finishes_streams_and_writes_every_usage_row(tmp_path, make_gateway, make_sim):
    sim = make_sim(replica="s", ttft_ms=1, tokens_per_s=10)
    gw, key, url = setup(tmp_path, make_gateway, [ep("s", sim.url)], workers=2, usage__flush_interval=60.0)
    quick = {**CHAT, "max_tokens": 1}
    for _ in range(25):
        assert post(gw.url + "/v1/chat/completions", quick, key)[0] == 200
    result = {}
    streamer = threading.Thread(target=lambda: result.update(
        events=stream_events(gw.url, key, {**CHAT, "max_tokens": 15})[1]))
    streamer.start()
    wait_until("the stream under way", 30, lambda: sim.metrics().get("vllm:num_requests_running", 0) >= 1)
    assert gw.stop(signal.SIGTERM) == 0
    streamer.join(10)
    assert result["events"][-1] == b"[DONE]" and len(result["events"]) == 17
    # Nothing had been flushed on the timer (60 s); every row was written on the way out.
    assert count_usage(url) == 26


def test_engines_at_capacity_are_429_with_retry_after_when_the_request_cannot_wait(tmp_path, make_gateway, make_sim):
    full = [make_sim(replica=f"full{i}", ttft_ms=1, tokens_per_s=2, max_concurrency=1, max_queue=0)
            for i in range(2)]
    # No time to wait in the admission queue (gateway.queue_wait 0): refused at once.
    gw, key, _ = setup(tmp_path, make_gateway, [ep(s.replica, s.url) for s in full], breaker__failures=1,
                       routing__affinity_prefix_bytes=0, gateway__queue_wait=0)
    hogs = [threading.Thread(target=post, args=(s.url + "/v1/chat/completions", {**CHAT, "max_tokens": 8}))
            for s in full]
    for t in hogs:
        t.start()
    wait_until("both engines full", 30, lambda: all(s.metrics()["vllm:num_requests_running"] == 1 for s in full))
    status, headers, raw = post(gw.url + "/v1/chat/completions", CHAT, key)
    assert status == 429 and headers["Retry-After"] == "2"
    assert "at capacity" in json.loads(raw)["error"]["message"]
    for t in hogs:
        t.join()
    # Being full is not failing: no breaker opened, so both serve again.
    assert post(gw.url + "/v1/chat/completions", CHAT, key)[0] == 200
    assert 'llmgw_endpoint_breaker_open{replica="full0"} 0.0' in gw.metrics()


def test_a_request_for_a_full_engine_waits_its_turn(tmp_path, make_gateway, make_sim):
    full = make_sim(replica="full", ttft_ms=1, tokens_per_s=10, max_concurrency=1, max_queue=0)
    gw, key, _ = setup(tmp_path, make_gateway, [ep(full.replica, full.url)], gateway__queue_wait=10)
    hog = threading.Thread(target=post, args=(full.url + "/v1/chat/completions", {**CHAT, "max_tokens": 8}))
    hog.start()
    wait_until("the engine full", 30, lambda: full.metrics()["vllm:num_requests_running"] == 1)
    started = time.monotonic()
    status, _, _ = post(gw.url + "/v1/chat/completions", {**CHAT, "max_tokens": 1}, key)
    assert status == 200 and time.monotonic() - started > 0.3  # it waited for the hog, then was served
    hog.join()


def test_a_request_an_engine_dies_of_is_not_sent_to_the_next(tmp_path, make_gateway, make_sim):
    # A query of death: sent on after the engine died holding it, one request took down every replica it was
    # retried on (routing.attempts of them).
    sims = [make_sim(replica=f"d{i}", ttft_ms=1, tokens_per_s=0, die_after=1) for i in range(3)]
    gw, key, url = setup(tmp_path, make_gateway, [ep(f"d{i}", s.url) for i, s in enumerate(sims)],
                         routing__attempts=3)
    status, _, raw = post(gw.url + "/v1/chat/completions", CHAT, key)
    error = json.loads(raw)["error"]
    assert status == 502 and error["code"] == "engine_died" and "not sent to another replica" in error["message"]
    # The gateway sees the connection drop before the engine's process is reaped: wait for that one exit.
    wait_until("the engine that took the request to exit", 30, lambda: sum(s.proc.poll() is None for s in sims) < 3)
    assert sum(s.proc.poll() is None for s in sims) == 2
    assert gw.settled_total('llmgw_engine_deaths_on_request_total{model="sim"}') == 1
    wait_until("the usage row", 30, lambda: count_usage(url, status=502) == 1)
