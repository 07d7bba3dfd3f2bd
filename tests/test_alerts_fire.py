"""The alerts that one event fires, on a real Prometheus with the shipped rules, scraping a real gateway.

EngineDiedOnRequest and GuardJudgeUnavailableFailOpen count in labelled counters, whose series a
gateway exports only from their first count, at that count. Their rules were `increase(...) > 0`,
which needs an earlier sample: they all but never fired, while promtool's tests, fed series that started
at 0, passed. Here the real thing breaks (an engine exits holding a request; a judge nobody
serves, with guard.fail = open) and each test waits for its alert on Prometheus' own API.

A worker makes a series at its first count and adds the count at its next fold, up to FOLD_EVERY
later (llmgw/gateway/metrics.py): a scrape in between sees the series at 0 first, and then the old
rule fired too. That is about one scrape in fifteen at 15 s; here, scraping every second, it was
one in two, and the tests passed on the old rules as often. So Prometheus is held still (SIGSTOP)
while the gateway counts, and first scrapes the series at its count, as it mostly does in service.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal

import pytest
import yaml

from llmgw import store
from llmgw.procs import free_port, wait_for
from tests.conftest import ROOT, Gateway, Sim, make_key, post
from tests.promstack import Prometheus

RULE_FILES = sorted(glob.glob(os.path.join(ROOT, "deploy", "monitoring", "*-rules.yml")))
WAIT = 60.0  # seconds for a state a loaded machine reaches in a few


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A gateway with two models, `doomed` (its engine exits on its first request) and `open` (guarded by
    `judge-dead`, whose replica's port nobody listens on, with fail = open), and a Prometheus that loads the
    bundle's rule files as shipped and scrapes the gateway as job llmgw-gateway every second."""
    tmp = tmp_path_factory.mktemp("alerts")
    url = f"sqlite:///{tmp}/gw.db"
    store.open_store(url).dispose()
    key = make_key(url)  # held from the gateway's start, not a keys.refresh_interval later
    sims = [Sim(model="doomed", replica="doomed", ttft_ms=1, tokens_per_s=0, die_after=1),
            Sim(model="open", replica="open", ttft_ms=1)]
    stops = [sim.stop for sim in sims]
    try:
        endpoints = [{"id": s.replica, "url": s.url, "models": [s.replica]} for s in sims]
        endpoints.append({"id": "judge-dead", "url": f"http://127.0.0.1:{free_port()}", "models": ["judge-dead"]})
        models = [{"name": "doomed"}, {"name": "open", "guard": {"model": "judge-dead", "fail": "open"}},
                  {"name": "judge-dead", "role": "guard"}]
        gw = Gateway(tmp, url, endpoints=endpoints, models=models, workers=1)
        stops.append(gw.stop)
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": RULE_FILES,
                  "scrape_configs": [{"job_name": "llmgw-gateway",
                                      "static_configs": [{"targets": [f"127.0.0.1:{gw.metrics_port}"]}]}]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom = Prometheus(tmp, str(tmp / "prometheus.yml"))
        stops.append(prom.stop)
        # As in service, Prometheus has scraped the gateway before anything is counted.
        wait_for("the gateway scraped", WAIT, lambda: prom.value('up{job="llmgw-gateway"}') == 1, interval=0.2)
        yield gw, prom, key
    finally:
        for stop in reversed(stops):
            stop()


@contextlib.contextmanager
def unscraped(prom: Prometheus):
    """Prometheus stopped where it stands (SIGSTOP) for the block, and then let go on."""
    prom.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for("Prometheus stopped", WAIT, lambda: prom.state() == "T")
        yield
    finally:
        prom.proc.send_signal(signal.SIGCONT)


def counted(gw: Gateway, series: str) -> float:
    """SERIES' total in the gateway's exposition once its first count is folded in, and all of it."""
    gw.metrics_once(f"{series} counted", lambda text: gw.metric_total(series, text) > 0)
    return gw.settled_total(series)


def firing(prom: Prometheus, name: str) -> list[dict]:
    """The labels of NAME's alerts that fire now."""
    return [a["labels"] for a in prom.alerts(name) if a["state"] == "firing"]


def first_sample(prom: Prometheus, series: str) -> float:
    """The earliest value Prometheus holds of SERIES (one series) in the last minute."""
    (found,) = prom.query(f"{series}[1m]")
    return float(found["values"][0][1])


def ask(gw: Gateway, key: str, model: str) -> tuple[int, dict]:
    status, _, raw = post(gw.url + "/v1/chat/completions",
                          {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, key)
    return status, json.loads(raw)


def test_an_engine_that_dies_on_a_request_fires_engine_died_on_request(stack):
    gw, prom, key = stack
    with unscraped(prom):
        status, answer = ask(gw, key, "doomed")
        assert status == 502 and answer["error"]["code"] == "engine_died", answer
        assert counted(gw, "llmgw_engine_deaths_on_request_total") == 1
    wait_for("EngineDiedOnRequest firing", WAIT, lambda: firing(prom, "EngineDiedOnRequest"), interval=0.2,
             alive=lambda: prom.proc.poll() is None)
    (labels,) = firing(prom, "EngineDiedOnRequest")
    assert labels["model"] == "doomed" and labels["severity"] == "warning", labels
    # What increase() alone cannot see: the series began at the death's own count.
    assert first_sample(prom, 'llmgw_engine_deaths_on_request_total{model="doomed"}') == 1


def test_a_judge_away_with_fail_open_fires_guard_judge_unavailable_fail_open(stack):
    gw, prom, key = stack
    with unscraped(prom):
        status, answer = ask(gw, key, "open")
        assert status == 200, answer  # passed unjudged
        unjudged = counted(gw, "llmgw_guard_unavailable_total")
    wait_for("GuardJudgeUnavailableFailOpen firing", WAIT, lambda: firing(prom, "GuardJudgeUnavailableFailOpen"),
             interval=0.2, alive=lambda: prom.proc.poll() is None)
    (labels,) = firing(prom, "GuardJudgeUnavailableFailOpen")
    assert labels["judge"] == "judge-dead" and labels["fail"] == "open", labels
    assert first_sample(prom, 'llmgw_guard_unavailable_total{judge="judge-dead"}') == unjudged
