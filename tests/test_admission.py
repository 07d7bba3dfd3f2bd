"""The admission queue: bands in order, bounded, with eviction; and with a real gateway in front of a
simulated engine that takes one request at a time."""

import concurrent.futures
import time

import gevent
import pytest

from llmgw import store
from llmgw.gateway.admission import AdmissionQueue, Refused
from llmgw.people import keys
from tests.conftest import post


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
            outcome[name] = e.reason

    jobs = [gevent.spawn(request, "low", "low"), gevent.spawn(request, "normal", "normal")]
    gevent.sleep(0.01)
    jobs.append(gevent.spawn(request, "high", "high"))  # full: the low waiter is pushed out
    jobs.append(gevent.spawn(request, "another-low", "low"))  # full, and no better than anyone: refused
    gevent.sleep(0.05)
    assert "higher admission band took its place" in outcome["low"]
    assert "2 requests already wait" in outcome["another-low"]
    assert queue.waiting("m") == 2
    gevent.killall(jobs)


def test_a_waiter_gives_up_after_the_queue_wait():
    queue = AdmissionQueue(size=5, wait=0.3)
    started = time.monotonic()
    with pytest.raises(Refused, match="no replica had room within 0 s"):
        queue.wait_turn("m", "normal", lambda: False)
    assert 0.3 <= time.monotonic() - started < 1.0


def test_higher_bands_are_served_first_when_the_engine_is_full(tmp_path, make_sim, make_gateway):
    # The engine generates one answer at a time (about 0.2 s each) and refuses more with 429. The gateway
    # sends each replica one request at a time; the rest wait in its queue. Six low-band requests are
    # queued first, then three high-band ones: the high ones finish before every low one still waiting.
    sim = make_sim(max_concurrency=1, max_queue=0, tokens_per_s=50, ttft_ms=0, default_tokens=10)
    url = f"sqlite:///{tmp_path}/bands.db"
    gw = make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=1,
                      routing__max_outstanding=1, gateway__queue_wait=30)
    engine = store.open_engine(url)
    low = keys.create_key(engine, "batch", band="low")[1]
    high = keys.create_key(engine, "interactive", band="high")[1]
    engine.dispose()
    time.sleep(2.5)
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}]}
    finished = {}

    def one(name, key):
        status, _, _ = post(gw.url + "/v1/chat/completions", body, key)
        finished[name] = (time.monotonic(), status)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        jobs = [pool.submit(one, f"low-{i}", low) for i in range(6)]
        time.sleep(0.4)  # the lows are queued (one generating)
        jobs += [pool.submit(one, f"high-{i}", high) for i in range(3)]
        for job in jobs:
            job.result()
    assert all(status == 200 for _, status in finished.values()), finished
    last_high = max(t for name, (t, _) in finished.items() if name.startswith("high"))
    lows_after = sum(1 for name, (t, _) in finished.items() if name.startswith("low") and t > last_high)
    assert lows_after >= 3, finished  # at most the lows already generating or first in line finish earlier
