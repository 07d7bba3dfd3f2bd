"""The gateway's metrics counted in each worker and folded into prometheus-client's files (llmgw/gateway/metrics.py):
the same series as the library's own objects give, at /metrics within a fold interval, and none lost at a stop."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from llmgw.gateway import metrics
from llmgw.gateway.metrics import FOLD_EVERY, LATENCY_BUCKETS, CounterTally, GatewayMetrics, HistogramTally, tallied
from tests.conftest import make_key, post, wait_until

CHAT = {"model": "sim", "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]}
SERVED = 'llmgw_requests_total{model="sim",status="200"}'
REQUESTS = "llmgw_requests_total"


def samples(registry: CollectorRegistry, name: str) -> list[str]:
    """The exposition's lines of NAME, without it, and without the _created stamps that differ by their clock."""
    return [line[len(name):] for line in generate_latest(registry).decode().splitlines()
            if line.startswith(name) and "_created" not in line]


def test_a_folded_histogram_has_the_samples_observe_gives():
    # The tally adds to the library's own bucket values; an upgrade that renamed them would fail here.
    registry = CollectorRegistry()
    direct = Histogram("direct", "d", ["model"], buckets=LATENCY_BUCKETS, registry=registry)
    folded = tallied(Histogram("folded", "d", ["model"], buckets=LATENCY_BUCKETS, registry=registry), HistogramTally)
    for figure in (0, 0.005, 0.0051, 0.3, 1, 900, 900.5, 5000):  # on the bounds, between them, past the last
        direct.labels("m").observe(figure)
        folded.labels("m").observe(figure)
    assert samples(registry, "folded") != samples(registry, "direct")  # nothing there until the fold
    folded.fold()
    assert samples(registry, "folded") == samples(registry, "direct")
    folded.fold()  # nothing more counted: nothing added twice
    assert samples(registry, "folded") == samples(registry, "direct")


def test_a_tallied_counter_refuses_what_the_library_refuses_where_it_is_called():
    counter = tallied(Counter("c", "c", ["model", "status"], registry=None), CounterTally)
    with pytest.raises(ValueError):
        counter.labels("only one")  # the wrong labels: refused at the first labels() call, as before
    with pytest.raises(ValueError, match="only goes up"):
        counter.labels("m", "200").inc(-1)


def test_every_counter_and_histogram_is_tallied_but_the_set_gauges_and_the_usage_threads_counters():
    metrics = GatewayMetrics()
    folded = {getattr(m, "metric", getattr(m, "target", None))._name for m in metrics.folded}
    assert {"llmgw_requests", "llmgw_request_duration_seconds", "llmgw_requests_in_flight",
            "llmgw_accountant_unavailable", "llmgw_controller_messages_dropped"} <= folded
    assert not {"llmgw_endpoint_breaker_open", "llmgw_pool_saturation", "llmgw_usage_rows_pending",
                "llmgw_usage_write_failures", "llmgw_usage_rows_dropped"} & folded
    # The usage writer counts from its own thread on SQLite (offloop.py): the library's locked values, not tallies.
    direct = {name for name, m in vars(metrics).items() if isinstance(m, (Counter, Histogram))}
    assert direct == {"usage_failures", "usage_dropped"}


def serving(tmp_path, make_gateway, make_sim):
    sim = make_sim(replica="s", ttft_ms=1, tokens_per_s=0)
    url = f"sqlite:///{tmp_path}/metrics.db"
    key = make_key(url)
    gw = make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=1)
    return gw, key


def test_a_scrape_while_a_worker_creates_its_files_reads_the_others(tmp_path):
    # A booting worker's file exists, empty, before it is mapped: the library's own collect raised on it (a 500).
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    written = MmapedDict(str(tmp_path / "counter_1.db"))
    written.write_value(mmap_key("llmgw_x_total", "llmgw_x_total", [], [], ""), 3.0, 0.0)
    written.close()
    (tmp_path / "counter_2.db").write_bytes(b"")
    families = list(metrics._Known(str(tmp_path)).collect())
    assert [(s.name, s.value) for f in families for s in f.samples] == [("llmgw_x_total", 3.0)]


def test_a_workers_counts_reach_metrics_within_the_fold_interval(tmp_path, make_gateway, make_sim):
    gw, key = serving(tmp_path, make_gateway, make_sim)
    assert [post(gw.url + "/v1/chat/completions", CHAT, key)[0] for _ in range(5)] == [200] * 5
    served = time.monotonic()
    # Polled, not slept: the fold comes within FOLD_EVERY; the margin is for a busy machine's scheduling.
    gw.metrics_once("5 requests counted", lambda text: gw.metric_total(SERVED, text) == 5, limit=FOLD_EVERY + 4)
    assert time.monotonic() - served < FOLD_EVERY + 4
    text = gw.metrics()
    assert 'llmgw_request_duration_seconds_count{model="sim"} 5.0' in text
    assert 'llmgw_requests_in_flight{model="sim"} 0.0' in text


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGQUIT])
def test_a_worker_stopped_right_after_requests_has_them_all_counted(tmp_path, make_gateway, make_sim, sig):
    # SIGTERM stops it gracefully, SIGQUIT at once (gunicorn's quick shutdown): either way the worker folds
    # what it counted at its exit, and the master, still serving, sums it with the replacement's.
    gw, key = serving(tmp_path, make_gateway, make_sim)
    (pid,) = map(int, re.findall(r"Booting worker with pid: (\d+)", gw.log()))
    assert gw.settled_total(SERVED) == 0  # the baseline, and the worker's first folds are behind it
    assert [post(gw.url + "/v1/chat/completions", CHAT, key)[0] for _ in range(20)] == [200] * 20
    os.kill(pid, sig)
    wait_until("the replacement worker", 60, lambda: gw.log().count("Booting worker with pid") == 2)
    assert gw.settled_total(SERVED) == 20
    assert gw.metric_total('llmgw_request_duration_seconds_count{model="sim"}') == 20


def test_a_refusal_is_counted_under_the_model_it_named_when_the_catalog_holds_it(tmp_path, make_gateway, make_sim):
    # A new user's 400s for a model that exists were all counted as model="unknown", and their dashboards
    # showed no errors for the model they were using.
    gw, key = serving(tmp_path, make_gateway, make_sim)
    hello = [{"role": "user", "content": "hi"}]
    refused = [("/v1/messages", {"model": "sim", "messages": hello}),  # Anthropic's max_tokens is required
               ("/v1/responses", {"model": "sim", "input": "hi", "max_output_tokens": "many"}),
               ("/v1/chat/completions", {"model": "sim", "messages": hello, "max_tokens": "many"}),
               # A name the catalog does not hold is never a label: the client chose it.
               ("/v1/messages", {"model": "client-chosen-name", "messages": hello}),
               ("/v1/chat/completions", {"model": "another-client-name", "messages": hello})]
    assert [post(gw.url + path, body, key)[0] for path, body in refused] == [400, 400, 400, 400, 404]
    text = gw.metrics_once("the refusals counted", lambda text: gw.metric_total(REQUESTS, text) == 5)
    assert 'llmgw_requests_total{model="sim",status="400"} 3.0' in text
    assert 'llmgw_requests_total{model="unknown",status="400"} 1.0' in text
    assert 'llmgw_requests_total{model="unknown",status="404"} 1.0' in text
    assert "client-chosen-name" not in text and "another-client-name" not in text
