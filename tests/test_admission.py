"""The admission queue: bands in order, bounded, with eviction; and with a real gateway in front of a
simulated engine that takes one request at a time."""

import concurrent.futures
import time

import gevent
import pytest

from llmgw import store
from llmgw.gateway.admission import DISPLACED, FULL, WAITED, AdmissionQueue, Refused
from llmgw.people import keys
from tests.conftest import make_key, post, wait_until


def test_waiters_go_in_band_order_then_first_come():
    queue = AdmissionQueue(size=10, wait=5)
    room = {"free": False}
    order = []

    def request(name, band):
        queue.wait_turn("m", band, lambda: room["free"])
        order.append(name)
        room["free"] = False  # it takes the one slot
        gevent.sleep(0.01)
        room["free"] = True
        queue.release("m")

    jobs = [gevent.spawn(request, name, band) for name, band in
            (("low-1", "low"), ("normal-1", "normal"), ("high-1", "high"), ("low-2", "low"), ("high-2", "high"))]
    gevent.sleep(0.05)
    room["free"] = True
    queue.release("m")
    gevent.joinall(jobs, timeout=5)
    assert order == ["high-1", "high-2", "normal-1", "low-1", "low-2"]


def test_a_full_queue_gives_the_worst_waiters_place_to_a_better_band():
    queue = AdmissionQueue(size=2, wait=5)
    outcome = {}

    def request(name, band):
        try:
            queue.wait_turn("m", band, lambda: False)
        except Refused as e:
            outcome[name] = (e.reason, e.kind)

    jobs = [gevent.spawn(request, "low", "low"), gevent.spawn(request, "normal", "normal")]
    gevent.sleep(0.01)
    assert queue.depth("m") == {"high": 0, "normal": 1, "low": 1}
    jobs.append(gevent.spawn(request, "high", "high"))  # full: the low waiter is pushed out
    jobs.append(gevent.spawn(request, "another-low", "low"))  # full, and no better than anyone: refused
    gevent.sleep(0.05)
    assert "higher admission band took its place" in outcome["low"][0] and outcome["low"][1] == DISPLACED
    assert "2 requests already wait" in outcome["another-low"][0] and outcome["another-low"][1] == FULL
    assert queue.waiting("m") == 2
    assert queue.depth("m") == {"high": 1, "normal": 1, "low": 0}
    gevent.killall(jobs)


def test_a_waiter_gives_up_after_the_queue_wait():
    queue = AdmissionQueue(size=5, wait=0.3)
    started = time.monotonic()
    with pytest.raises(Refused, match="no replica had room within 0 s") as refused:
        queue.wait_turn("m", "normal", lambda: False)
    assert refused.value.kind == WAITED
    assert 0.3 <= time.monotonic() - started < 1.0


def test_higher_bands_are_served_first_when_the_engine_is_full(tmp_path, make_sim, make_gateway):
    # The engine generates one answer at a time (about 0.5 s each) and refuses more with 429. The gateway
    # sends each replica one request at a time; the rest wait in its queue. Six low-band requests are
    # queued first, then three high-band ones: the high ones finish before every low one still waiting.
    sim = make_sim(max_concurrency=1, max_queue=0, tokens_per_s=50, ttft_ms=0, default_tokens=25)
    url = f"sqlite:///{tmp_path}/bands.db"
    # The queue's depth is shown at each read of the engine's load: every 0.1 s, for the test to watch.
    gw = make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=1,
                      routing__max_outstanding=1, gateway__queue_wait=30, routing__metrics_interval=0.1)
    engine = store.open_engine(url)
    low = keys.create_key(engine, "batch", band="low")[1]
    high = keys.create_key(engine, "interactive", band="high")[1]
    engine.dispose()
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}
    # The gateway reads new keys from the store once a second: both known before the race starts.
    for key in (low, high):
        wait_until("the gateway knowing the key", 30, lambda key=key: post(gw.url + "/v1/chat/completions", body, key)[0] == 200)
    finished = {}

    def one(name, key):
        status, _, _ = post(gw.url + "/v1/chat/completions", body, key)
        finished[name] = (time.monotonic(), status)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        jobs = [pool.submit(one, f"low-{i}", low) for i in range(6)]
        # The lows queued behind the one generating (five, then one fewer every 0.5 s: seen while four wait).
        wait_until("the lows queued", 30, lambda: gw.metric_total("llmgw_admission_queue_depth") >= 4)
        jobs += [pool.submit(one, f"high-{i}", high) for i in range(3)]
        for job in jobs:
            job.result()
    assert all(status == 200 for _, status in finished.values()), finished
    last_high = max(t for name, (t, _) in finished.items() if name.startswith("high"))
    lows_after = sum(1 for name, (t, _) in finished.items() if name.startswith("low") and t > last_high)
    assert lows_after >= 3, finished  # at most the lows already generating or first in line finish earlier


def test_the_queue_its_refusals_and_the_pools_saturation_are_in_the_gateways_metrics(tmp_path, make_sim, make_gateway):
    # The engine generates one answer at a time (6 s each) and the gateway sends it one request at a
    # time, with room for one more to wait: a normal request generates, a second waits, a high-band one
    # takes the waiting one's place, and a normal one finds the queue full.
    sim = make_sim(max_concurrency=1, max_queue=0, tokens_per_s=10, ttft_ms=0, default_tokens=60)
    url = f"sqlite:///{tmp_path}/queue.db"
    normal, high = make_key(url, "normal"), make_key(url, "interactive", band="high")  # read at the start
    gw = make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=1,
                      routing__max_outstanding=1, gateway__queue_size=1, gateway__queue_wait=60)
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}
    answers = {}

    def one(name, key):
        answers[name] = post(gw.url + "/v1/chat/completions", body, key, timeout=120)

    def series(text):
        return f'{text} ' in gw.metrics() or f'{text}\n' in gw.metrics()

    # A worker shows the pools of the models it routes to: one short answer first.
    assert post(gw.url + "/v1/chat/completions", {**body, "max_tokens": 1}, normal)[0] == 200
    wait_until("the gateway reading the engine", 30, lambda: series('llmgw_pool_saturation{model="sim"} 0.0'))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = pool.submit(one, "first", normal)
        wait_until("the first generating", 30, lambda: sim.metrics()["vllm:num_requests_running"] == 1)
        waiting = pool.submit(one, "waiting", normal)
        wait_until("one normal request waiting", 30,
                   lambda: series('llmgw_admission_queue_depth{band="normal",model="sim"} 1.0'))
        # One in flight and one queued on a replica that holds one: twice its healthy limit.
        wait_until("the pool at twice its limit", 30, lambda: series('llmgw_pool_saturation{model="sim"} 2.0'))
        jumped = pool.submit(one, "high", high)
        waiting.result()
        assert answers["waiting"][0] == 429 and b"higher admission band" in answers["waiting"][2]
        one("full", normal)
        assert answers["full"][0] == 429 and b"already wait" in answers["full"][2]
        first.result()
        jumped.result()
    assert answers["first"][0] == 200 and answers["high"][0] == 200
    assert gw.settled_total("llmgw_admission_rejected_total") == 2
    metrics = gw.metrics()
    assert 'llmgw_admission_rejected_total{band="normal",model="sim",reason="displaced"} 1.0' in metrics
    assert 'llmgw_admission_rejected_total{band="normal",model="sim",reason="full"} 1.0' in metrics
    assert 'llmgw_admission_rejected_total{band="high"' not in metrics
    wait_until("the queue empty again", 30,
               lambda: series('llmgw_admission_queue_depth{band="high",model="sim"} 0.0')
               and series('llmgw_pool_saturation{model="sim"} 0.0'))
