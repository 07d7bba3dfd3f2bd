"""The history charts against a Prometheus of the test's own (tests/test_upstream.py's scripted server): one
that trickles its answer, one that redirects, and odd but valid answers, through `prometheus.query_range`, the
cluster page (Flask's test client) and a real gateway's worker. The real Prometheus is in tests/test_opspages.py.

What a hostile review found: headers, or a body announced as 100,000 bytes, sent a byte a second held a
signed-in admin's page for as long as the server kept on, and the worker's connection stayed open; a time of
1e999 or NaN, two series of 1e308, a value of 5e-324 and 100,000 nested `[` each made the page a 500.
"""

from __future__ import annotations

import logging
import re
import time

import pytest
import requests
from markupsafe import escape

from llmgw import settings, store
from llmgw.people import accounts, keys
from llmgw.web import prometheus, svgchart
from llmgw.web.app import GatewayApp
from tests.conftest import Gateway, wait_until
from tests.test_pages import sign_in, token
from tests.test_upstream import Scripted, ok

PASSWORD = "a long enough password"


def trickle(data: bytes, every: float = 0.2) -> list:
    """DATA a byte at a time, EVERY seconds apart, as a script for the server."""
    return [part for byte in data for part in (bytes([byte]), every)]


# Each goes on for 80 s unless the client hangs up.
TRICKLES = {
    "its body": [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n",
                 *trickle(b'{"status":"success",' + b" " * 380)],
    "its head": trickle(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Slow: " + b"a" * 350),
}


def matrix(*series: list[tuple[str, str]]) -> bytes:
    """A query_range answer of SERIES, each a list of (time, value) written into the JSON as they are:
    `1e999` and `NaN` are numbers to Python's JSON reader, as they are to some others."""
    result = ",".join('{"metric":{"model":"m%d"},"values":[%s]}' % (i, ",".join(f'[{t},"{v}"]' for t, v in points))
                      for i, points in enumerate(series))
    return ('{"status":"success","data":{"resultType":"matrix","result":[%s]}}' % result).encode()


def answered(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return ok(body, extra) if status == "200 OK" else ok(body, extra).replace(b"200 OK", status.encode(), 1)


@pytest.mark.parametrize("mode", TRICKLES)
def test_a_trickled_answer_is_cut_at_the_bound_and_its_connection_closed(mode):
    server = Scripted([TRICKLES[mode]])
    now = time.time()
    started = time.monotonic()
    with pytest.raises(prometheus.Unavailable) as e:
        prometheus.query_range(server.url, "up", now - 3600, now, 60, seconds=1)
    took = time.monotonic() - started
    server.close()
    assert f"Prometheus at {server.url} did not answer within 1 s" in str(e.value)
    assert took < 3, took
    wait_until("the server to see its client hang up", 10, lambda: server.hangups)


def test_a_redirect_or_a_refusal_nested_too_deep_is_a_sentence():
    server = Scripted([answered(b"", "301 Moved Permanently", b"Location: https://prom.example/\r\n"),
                       answered(b"[" * 60000, "400 Bad Request"), answered(b"[" * 100000)])
    now = time.time()
    said = []
    for _ in range(3):
        with pytest.raises(prometheus.Unavailable) as e:
            prometheus.query_range(server.url, "up", now - 3600, now, 60)
        said.append(str(e.value))
    server.close()
    assert "sends the pages elsewhere (301 to https://prom.example/); set monitoring.prometheus" in said[0]
    assert "is not Prometheus' query API (it answered 400)" in said[1]
    assert "is not Prometheus' query API; monitoring.prometheus is its base address" in said[2]


@pytest.fixture
def cluster_page(tmp_path):
    """A signed-in administrator's Flask client of pages whose Prometheus is a scripted server."""
    server = Scripted([])
    url = f"sqlite:///{tmp_path}/pages.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    app = GatewayApp(settings.load(None, {"store.url": url, "monitoring.prometheus": server.url}), key_source=keys)
    app.pages.testing = True
    client = app.pages.test_client()
    sign_in(client, "root@example.org", PASSWORD)
    yield client, server
    server.close()
    app.runtime.engine.dispose()
    engine.dispose()


def odd_answers(now: int) -> dict[str, tuple[bytes, str]]:
    """Answers Prometheus could give, or something in its place, with what the cluster page then says."""
    recent = [(now - 120, "2"), (now - 60, "3")]
    return {
        "a time of 1e999": (matrix([("1e999", "1"), *recent]), "drawn"),
        "a time of NaN": (matrix([("NaN", "1"), *recent]), "drawn"),
        "a time of 10**400": (matrix([("1" + "0" * 400, "1"), *recent]), "not Prometheus' query API"),
        "two series of 1e308": (matrix([(now - 60, "1e308")], [(now - 60, "1e308")]), "empty"),
        "a value of 5e-324": (matrix([(now - 60, "5e-324"), (now - 120, "0")]), "drawn"),
        "100,000 nested [": (b"[" * 100000, "not Prometheus' query API"),
    }


@pytest.mark.parametrize("mode", list(odd_answers(0)))
def test_an_odd_answer_is_drawn_or_said_never_a_500(cluster_page, mode):
    client, server = cluster_page
    body, expected = odd_answers(int(time.time()))[mode]
    server.replies = [answered(body)] * 4  # the cluster page's four charts
    page = client.get("/admin")
    history = page.data.decode().split('id="history"')[1]
    assert page.status_code == 200, mode
    if expected == "drawn":
        assert history.count("<svg") == 4 and 'class="problem"' not in history, mode
        assert "m0" in history and not re.search(r"(?i)\b(nan|inf)\b", history), mode
    elif expected == "empty":
        assert "<svg" not in history and "No request was answered in this window" in history
        assert 'class="problem"' not in history
    else:
        assert history.count('class="problem"') == 1 and escape(expected) in history and "<svg" not in history, mode


def test_a_chart_that_cannot_be_drawn_is_the_sections_sentence_and_its_traceback_is_logged(cluster_page, monkeypatch,
                                                                                            caplog):
    client, server = cluster_page
    now = int(time.time())
    server.replies = [answered(matrix([(now - 60, "1")]))] * 4

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a fault of the drawing's")

    monkeypatch.setattr(svgchart, "stacked_bars", broken)
    with caplog.at_level(logging.ERROR, "llmgw.history"):
        page = client.get("/admin")
    history = page.data.decode().split('id="history"')[1]
    assert page.status_code == 200
    assert "The chart &#34;Requests a minute, by model&#34; could not be drawn from what Prometheus at" in history
    assert history.count('class="problem"') == 1 and "<svg" not in history
    logged = [r for r in caplog.records if r.name == "llmgw.history"]
    assert logged and logged[0].exc_info and "a fault of the drawing's" in caplog.text


def test_a_trickling_prometheus_holds_a_workers_page_only_for_the_bound(tmp_path):
    """Through gunicorn's gevent worker, as the review found it: each trickle in turn, one page load each."""
    server = Scripted([TRICKLES["its body"], TRICKLES["its head"]])
    url = f"sqlite:///{tmp_path}/cluster.db"
    engine = store.open_store(url)
    accounts.create_user(engine, "root@example.org", PASSWORD, state=accounts.ACTIVE, is_admin=True)
    engine.dispose()
    gw = Gateway(tmp_path, url, workers=1, monitoring__prometheus=server.url)
    try:
        browser = requests.Session()
        browser.post(gw.url + "/login", data={"email": "root@example.org", "password": PASSWORD,
                                              "csrf_token": token(browser.get(gw.url + "/login").content)})
        for mode in TRICKLES:
            hung_up = len(server.hangups)
            started = time.monotonic()
            page = browser.get(gw.url + "/admin", timeout=60)
            took = time.monotonic() - started
            assert page.status_code == 200 and 'id="history"' in page.text, (mode, page.status_code)
            assert f"Prometheus at {server.url} did not answer within 5 s" in page.text, mode
            assert took < prometheus.QUERY_SECONDS + 5, (mode, took)
            wait_until(f"the worker to close its connection to a Prometheus trickling {mode}", 10,
                       lambda hung_up=hung_up: len(server.hangups) > hung_up)
    finally:
        gw.stop()
        server.close()
    assert len(server.requests) == 2  # the first query that fails stops the section
