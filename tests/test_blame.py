"""Whose fault a failure is, and what each request is billed: through a real gateway in front of simulated engines.

One key's bad requests must change nothing for anyone else; a sick replica
must still leave rotation; every prompt and every delivered token is billed;
every request counts against its key's rate.
"""

import concurrent.futures
import json
import threading
import time

from llmgw import store
from llmgw.people import keys, limits
from llmgw.procs import http_status
from tests.conftest import SocketStub, make_key, open_stream, post, read_until, wait_until
from tests.test_faults import stream_events

CHAT = {"model": "sim", "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]}
# Inputs that make llama.cpp answer 500 (found by a fuzz of the real engine); the sim answers them alike.
CHOKERS = [{**CHAT, "tools": "x"},
           {**CHAT, "messages": [{"role": "user", "content": "hi", "name": {"a": 1}}]},
           {**CHAT, "messages": [{"role": "user", "content": [{"type": "text"}]}]}]


def ep(rid, url):
    return {"id": rid, "url": url, "models": ["sim"]}


def breaker_open(gw, rid) -> bool:
    return f'llmgw_endpoint_breaker_open{{replica="{rid}"}} 1.0' in gw.metrics()


def idle_replica(make_sim):
    """A replica of a model only `watch_rounds` asks for, whose breaker never opens: every round of the replica
    watcher of a worker that routed to it scrapes it, and counting its scrapes tells rounds apart."""
    sim = make_sim(model="idle", replica="idle", ttft_ms=1, tokens_per_s=0)
    return sim, {"id": "idle", "url": sim.url, "models": ["idle"]}


def watch_rounds(gw, key: str, idle, workers: int) -> None:
    """Wait until the replica watchers of WORKERS workers have scraped IDLE twice each since the call: the
    second scrape of a worker starts a round after one that began and set the gauges since. A worker reads the
    engines of the models it routes to, so IDLE's model is asked for first, on new connections, which the
    workers share out. Each read of IDLE's /metrics here is a scrape too, and is taken off."""
    for _ in range(10 * workers):
        status, _, raw = post(gw.url + "/v1/chat/completions", {**CHAT, "model": "idle"}, key)
        assert status == 200, raw
    read_again(idle, 2 * workers, "two rounds of the replica watchers")


def read_again(sim, times: int, what: str) -> None:
    """Wait until SIM's /metrics has been read TIMES more by gateways since the call; each read of it here is
    one too, and is taken off."""
    reads = 0

    def scrapes() -> float:
        nonlocal reads
        reads += 1
        return sim.metrics()["llmgw_sim_scrapes_total"] - reads

    since = scrapes()
    wait_until(what, 60, lambda: scrapes() >= since + times, interval=0.05)


def rows(url):
    engine = store.open_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(store.usage.select()).all()
    finally:
        engine.dispose()


def test_a_thousand_requests_an_engine_chokes_on_change_nothing_for_another_client(tmp_path, make_gateway, make_sim):
    sims = [make_sim(replica=f"replica-{n}", ttft_ms=1, tokens_per_s=0) for n in "ab"]
    idle, idle_ep = idle_replica(make_sim)
    url = f"sqlite:///{tmp_path}/blame.db"
    bad_key, good_key = make_key(url, "bad"), make_key(url, "good")
    # The default breaker (five failures in a row open it for ten seconds) and three attempts a request.
    gw = make_gateway(store_url=url, endpoints=[ep(s.replica, s.url) for s in sims] + [idle_ep], workers=2)
    good_statuses = []
    flooding = threading.Event()
    flooding.set()

    def good_client():
        while flooding.is_set():
            good_statuses.append(post(gw.url + "/v1/chat/completions", CHAT, good_key)[0])

    good = threading.Thread(target=good_client)
    good.start()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: post(gw.url + "/v1/chat/completions", CHOKERS[i % 3], bad_key),
                                range(1000)))
    ready_during = http_status(gw.url + "/ready")
    flooding.clear()
    good.join()
    assert good_statuses and set(good_statuses) == {200}, sorted(set(good_statuses))
    assert ready_during == 200
    # Each bad request reached one engine once: none was retried on another replica.
    seen = sum(s.metrics()["llmgw_sim_requests_total"] for s in sims)
    assert seen <= 1000 + len(good_statuses)
    for status, _, raw in answers:
        error = json.loads(raw)["error"]
        assert status in (400, 502), status
        # The engine's words (which quote the request), its address and the replica stay in the log.
        message = error["message"]
        assert "request id" in message and "json.exception" not in message and "type must be" not in message
        assert "127.0.0.1" not in message and "replica-" not in message
    watch_rounds(gw, good_key, idle, workers=2)  # the watchers set the breaker gauges
    assert not breaker_open(gw, "replica-a") and not breaker_open(gw, "replica-b")
    assert post(gw.url + "/v1/chat/completions", CHAT, good_key)[0] == 200


def test_requests_that_outlast_the_first_byte_timeout_change_nothing_for_another_client(tmp_path, make_gateway,
                                                                                      make_sim):
    # A long answer, not streamed, starts only when it ends: 400 tokens at 50 a second outlast
    # timeouts.first_byte = 1. Six of them opened the replica's breaker, each retried on every replica.
    sims = [make_sim(replica=f"replica-{n}", ttft_ms=1, tokens_per_s=50) for n in "ab"]
    idle, idle_ep = idle_replica(make_sim)
    url = f"sqlite:///{tmp_path}/slow.db"
    slow_key, good_key = make_key(url, "slow"), make_key(url, "good")
    gw = make_gateway(store_url=url, endpoints=[ep(s.replica, s.url) for s in sims] + [idle_ep], workers=1,
                      timeouts__first_byte=1.0)
    slow = {**CHAT, "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write"}]}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: post(gw.url + "/v1/chat/completions", slow, slow_key), range(12)))
    assert [status for status, _, _ in answers] == [504] * 12
    assert {json.loads(raw)["error"]["code"] for _, _, raw in answers} == {"upstream_timeout"}
    # Each reached one engine once: none was retried on the other replica.
    assert sum(s.metrics()["llmgw_sim_requests_total"] for s in sims) == 12
    assert http_status(gw.url + "/ready") == 200
    assert [post(gw.url + "/v1/chat/completions", CHAT, good_key)[0] for _ in range(10)] == [200] * 10
    watch_rounds(gw, good_key, idle, workers=1)  # the watcher sets the breaker gauges
    assert not breaker_open(gw, "replica-a") and not breaker_open(gw, "replica-b")
    assert gw.settled_total("llmgw_upstream_retries_total") == 0


def test_a_sick_replica_still_leaves_rotation_through_its_health_check(tmp_path, make_gateway, make_sim):
    # A sick engine fails every request and its health check (as vLLM's does once its engine died).
    good = make_sim(replica="good", ttft_ms=1, tokens_per_s=0)
    sick = make_sim(replica="sick", ttft_ms=1, tokens_per_s=0, fail_rate=1.0)
    url = f"sqlite:///{tmp_path}/sick.db"
    key = make_key(url)
    gw = make_gateway(store_url=url, endpoints=[ep("sick", sick.url), ep("good", good.url)], workers=1,
                      breaker__failures=2, breaker__cooldown=60.0, routing__affinity_prefix_bytes=0)
    failed = []

    def sick_is_out():
        status, _, raw = post(gw.url + "/v1/chat/completions", CHAT, key)
        if status != 200:
            failed.append(json.loads(raw)["error"]["code"])
        return breaker_open(gw, "sick")

    wait_until("the sick replica's breaker to open", 60, sick_is_out, interval=0.2)
    # Its failures went to the client as they came (not retried elsewhere), each one an engine error.
    assert set(failed) <= {"engine_error"} and sick.metrics()["llmgw_sim_requests_total"] == len(failed)
    assert [post(gw.url + "/v1/chat/completions", CHAT, key)[0] for _ in range(20)] == [200] * 20
    assert http_status(gw.url + "/ready") == 200


def test_an_unavailable_replica_is_tried_elsewhere_and_struck(tmp_path, make_gateway, make_sim):
    good = make_sim(replica="good", ttft_ms=1, tokens_per_s=0)
    loading = make_sim(replica="loading", loading=True)  # 503 "Loading model", as llama.cpp answers while it loads
    url = f"sqlite:///{tmp_path}/loading.db"
    key = make_key(url)
    gw = make_gateway(store_url=url, endpoints=[ep("loading", loading.url), ep("good", good.url)], workers=1,
                      breaker__failures=2, breaker__cooldown=60.0, routing__affinity_prefix_bytes=0)
    assert [post(gw.url + "/v1/chat/completions", CHAT, key)[0] for _ in range(20)] == [200] * 20
    gw.metrics_once("the retries counted", lambda text: 'llmgw_upstream_retries_total{reason="status"}' in text)
    wait_until("the breaker gauge", 30, lambda: breaker_open(gw, "loading"))


def keyed_gateway(tmp_path, make_gateway, sim, name="billed", priced=True, **limit):
    """A one-worker gateway in front of SIM, with a key named NAME held to LIMIT (rpm=, tpm=), and the model
    priced 1 and 2 micro-dollars a prompt and a completion token when PRICED: (gateway, secret, store URL)."""
    url = f"sqlite:///{tmp_path}/{name}.db"
    engine = store.open_store(url)
    try:
        if priced:
            limits.set_price(engine, "sim", "1", "2", "test")
        record, secret = keys.create_key(engine, name)
        if limit:
            limits.set_limits(engine, "key", record.id, "test", **limit)
    finally:
        engine.dispose()
    return make_gateway(store_url=url, endpoints=[ep("s", sim.url)], workers=1), secret, url


def test_every_prompt_of_a_list_is_billed(tmp_path, make_gateway, make_sim):
    sim = make_sim(replica="s", ttft_ms=1, tokens_per_s=0)
    gw, key, url = keyed_gateway(tmp_path, make_gateway, sim)
    status, _, raw = post(gw.url + "/v1/completions", {"model": "sim", "prompt": ["tell me a story"] * 300,
                                                        "max_tokens": 16}, key)
    answer = json.loads(raw)
    # The engine served 300 choices and spoke of the first prompt only (3 prompt, 16 completion tokens).
    assert status == 200 and len(answer["choices"]) == 300 and answer["usage"]["completion_tokens"] == 16
    wait_until("the usage row", 30, lambda: len(rows(url)) == 1)
    row = rows(url)[0]
    assert row.prompt_tokens >= 300 and row.completion_tokens >= 300 * 10
    assert row.cost_micros >= row.prompt_tokens + 2 * row.completion_tokens - 1


def test_a_stream_the_client_cut_bills_what_was_delivered(tmp_path, make_gateway, make_sim):
    sim = make_sim(replica="s", ttft_ms=1, tokens_per_s=100)
    gw, key, url = keyed_gateway(tmp_path, make_gateway, sim)
    sock = open_stream(gw.port, key, {**CHAT, "max_tokens": 2000})
    received = read_until(sock, lambda received: received.count(b"data: ") >= 190)
    sock.close()
    wait_until("the usage row", 30, lambda: len(rows(url)) == 1)
    row = rows(url)[0]
    delivered = received.count(b'"content": "tok')
    assert row.status == 499 and delivered >= 190
    assert delivered <= row.completion_tokens < 2000 and row.prompt_tokens >= 1 and row.cost_micros > 0


def test_requests_for_unknown_models_count_against_the_rate(tmp_path, make_gateway, make_sim):
    sim = make_sim(replica="s", ttft_ms=1, tokens_per_s=0)
    gw, secret, _ = keyed_gateway(tmp_path, make_gateway, sim, "rated", priced=False, rpm=3)
    unknown = {**CHAT, "model": "no-such-model"}
    assert [post(gw.url + "/v1/chat/completions", unknown, secret)[0] for _ in range(3)] == [404] * 3
    status, headers, raw = post(gw.url + "/v1/chat/completions", unknown, secret)
    assert status == 429 and json.loads(raw)["error"]["code"] == "rate_limit_exceeded"
    assert post(gw.url + "/v1/chat/completions", CHAT, secret)[0] == 429


class LingeringEngine(SocketStub):
    """An engine that sends its whole stream, `[DONE]` included, then holds the connection a while
    before ending the body, as an engine busy tidying up does."""

    EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    EVENTS = (EVENT, b"data: [DONE]\n\n")
    END = b"0\r\n\r\n"  # the body's end, after the hold

    def hold(self, conn) -> None:
        time.sleep(3)

    def answer(self, conn):
        try:
            if (head := self.read_head(conn)) is None:
                return
            if not head.startswith(b"POST"):
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for event in self.EVENTS:
                conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
            self.hold(conn)
            conn.sendall(self.END)
        except OSError:
            pass
        finally:
            conn.close()


class StuckAfterItsError(LingeringEngine):
    """An engine that reports a failure mid-stream, then holds the connection until the gateway hangs up
    (10 s at most) before its `[DONE]`, as an engine stuck after its error does."""

    EVENTS = (LingeringEngine.EVENT, b'data: {"error": {"message": "out of memory", "code": 500}}\n\n')
    END = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"

    def hold(self, conn) -> None:
        conn.settimeout(10)
        conn.recv(1)  # b"" when the gateway hangs up


def hung_up(tmp_path, make_gateway, engine: SocketStub, until: bytes, path: str = "/v1/chat/completions"):
    """(what the client read, its usage row's status) for a stream from ENGINE whose client hangs up as soon
    as it has read UNTIL."""
    url = f"sqlite:///{tmp_path}/hung-up.db"
    key = make_key(url)
    try:
        gw = make_gateway(store_url=url, endpoints=[ep("s", engine.url)], workers=1)
        sock = open_stream(gw.port, key, CHAT, path=path)
        received = read_until(sock, lambda received: until in received)
        sock.close()
        wait_until("the usage row", 30, lambda: len(rows(url)) == 1)
        return received, rows(url)[0].status
    finally:
        engine.close()


def test_a_client_that_leaves_right_after_done_was_served(tmp_path, make_gateway):
    assert hung_up(tmp_path, make_gateway, LingeringEngine(), b"[DONE]")[1] == 200


def test_a_client_that_hangs_up_on_an_engines_error_event_is_accounted_a_502(tmp_path, make_gateway):
    # The gateway ends the client's stream with the engine's failure and reads no more of the engine: had it
    # read on, the client leaving on the error would be counted as leaving (499), not as the engine failing.
    received, status = hung_up(tmp_path, make_gateway, StuckAfterItsError(), b"event: error", "/v1/messages")
    assert b"engine failed while answering" in received and status == 502


def test_an_engine_killed_mid_stream_ends_it_with_an_error_and_done(tmp_path, make_gateway, make_sim):
    dying = make_sim(replica="dying", ttft_ms=1, tokens_per_s=50, die_after=1)
    url = f"sqlite:///{tmp_path}/dying.db"
    key = make_key(url)
    gw = make_gateway(store_url=url, endpoints=[ep("dying", dying.url)], workers=1)
    _, events = stream_events(gw.url, key, {**CHAT, "max_tokens": 10})
    error = json.loads(events[-2])["error"]
    assert events[-1] == b"[DONE]" and error["code"] == "upstream_error" and "request id" in error["message"]
    assert "127.0.0.1" not in error["message"] and "dying" not in error["message"]
    wait_until("the usage row", 30, lambda: len(rows(url)) == 1)
    row = rows(url)[0]
    assert row.status == 502 and row.completion_tokens >= 1  # what was delivered before it died



def streamed(url, body, key) -> list[bytes]:
    """The `data:` payloads of a stream, read whole."""
    status, _, raw = post(url, {**body, "stream": True}, key)
    assert status == 200
    return [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]


def test_every_choice_is_billed(tmp_path, make_gateway, make_sim):
    # llama.cpp's whole answer to n=4 reports the first choice's 30 tokens (billed 30, not 120); its
    # stream reports each choice apart (n=3 of 15 tokens was billed 15 of 45: only the last report was kept).
    sim = make_sim(replica="s", ttft_ms=1, tokens_per_s=0)
    gw, key, url = keyed_gateway(tmp_path, make_gateway, sim)
    write = {"model": "sim", "messages": [{"role": "user", "content": "Write"}], "n": 4, "max_tokens": 30}
    status, _, raw = post(gw.url + "/v1/chat/completions", write, key)
    assert status == 200 and len(json.loads(raw)["choices"]) == 4
    assert streamed(gw.url + "/v1/completions", {"model": "sim", "prompt": "Write", "n": 3, "max_tokens": 15},
                    key)[-1] == b"[DONE]"
    wait_until("the usage rows", 30, lambda: len(rows(url)) == 2)
    assert sorted((r.stream, r.prompt_tokens, r.completion_tokens) for r in rows(url)) == [(False, 1, 120),
                                                                                           (True, 1, 45)]


def test_prompts_dense_in_tokens_are_billed_exactly(tmp_path, make_gateway, make_sim):
    # Digits run at a token each with its space: six bytes a token assumed, twenty copies of a 599-token
    # prompt were billed 2,000. The sim makes a token of each word: 300 here.
    sim = make_sim(replica="s", ttft_ms=1, tokens_per_s=0)
    gw, key, url = keyed_gateway(tmp_path, make_gateway, sim)
    digits = " ".join(str(j % 10) for j in range(300))
    status, _, raw = post(gw.url + "/v1/completions", {"model": "sim", "prompt": [digits] * 20, "max_tokens": 1}, key)
    assert status == 200 and json.loads(raw)["usage"]["prompt_tokens"] == 300  # the first prompt's alone
    assert streamed(gw.url + "/v1/completions", {"model": "sim", "prompt": [digits] * 5, "max_tokens": 1},
                    key)[-1] == b"[DONE]"
    wait_until("the usage rows", 30, lambda: len(rows(url)) == 2)
    assert sorted((r.stream, r.prompt_tokens, r.completion_tokens) for r in rows(url)) == [(False, 6000, 20),
                                                                                           (True, 1500, 5)]


def test_the_reservation_counts_every_choice(tmp_path, make_gateway, make_sim):
    sim = make_sim(replica="s", ttft_ms=1, tokens_per_s=0)
    gw, secret, _ = keyed_gateway(tmp_path, make_gateway, sim, "reserved", priced=False, tpm=1000)
    assert post(gw.url + "/v1/chat/completions", {**CHAT, "max_tokens": 100}, secret)[0] == 200
    # Twenty answers of up to 100 tokens may spend 2,000 tokens: more than what is left of a minute's 1,000
    # (an empty window takes any one request, so one came first).
    status, _, raw = post(gw.url + "/v1/chat/completions", {**CHAT, "n": 20, "max_tokens": 100}, secret)
    assert status == 429 and json.loads(raw)["error"]["code"] == "tokens_limit_exceeded"
