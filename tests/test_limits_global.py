"""Limits hold across workers and gateway processes: real gateways under gunicorn, a real controller
holding the accountant, a simulated engine, requests fired at both gateways at once."""

import concurrent.futures
import json

import sqlalchemy as sa

from llmgw import rules, store
from llmgw.people import keys, limits
from tests.cluster import Controller
from tests.conftest import post, wait_until

BODY = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


def fire(urls, key, count, body=BODY, threads=32):
    """COUNT requests spread over URLS as fast as THREADS clients can send them; their statuses."""
    def one(i):
        status, headers, _ = post(urls[i % len(urls)] + "/v1/chat/completions", body, key)
        return status, headers

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(count)))


def start(tmp_path, make_sim, make_gateway, prepare, gateways=2, accountant_timeout=20.0, controller_settings=None):
    """A controller (with CONTROLLER_SETTINGS, as `controller.NAME`: value), then PREPARE(engine) (keys, limits,
    prices), then the gateways: their workers read what PREPARE made at start, so no test waits for a reload.
    PREPARE's answer comes back last."""
    sim = make_sim(tokens_per_s=0, ttft_ms=0, default_tokens=10)
    url = f"sqlite:///{tmp_path}/shared.db"
    controller = Controller(tmp_path, store_url=url,
                            **{f"controller__{k}": v for k, v in (controller_settings or {}).items()})
    engine = store.open_engine(url)
    made = prepare(engine)
    probe = limited_key("probe", rpm=1_000_000)(engine)
    endpoints = [{"id": "sim-1", "url": sim.url, "models": ["sim"]}]
    # The accountant is waited on for long: a loaded machine answers 160 admits at once in over the default
    # 0.5 s, and what is not answered in time is waived (as the test of a silent accountant shows).
    gws = [make_gateway(store_url=url, endpoints=endpoints, workers=2, limits__accountant_timeout=accountant_timeout,
                        gateway__controller=f"127.0.0.1:{controller.gateway_port}",
                        gateway__key_file=controller.gateway_key_file(f"gw{i}")) for i in range(gateways)]
    # A gateway learns where the accountant is from the controller's first snapshot; until then it waives
    # rate limits. The probe's limit is never reached: its answers say when the accountant answers.
    wait_until("every gateway to reach the accountant", 60, lambda: all(
        all("X-RateLimit-Limit-Requests" in post(gw.url + "/v1/chat/completions", BODY, probe)[1] for _ in range(10))
        for gw in gws))
    return controller, gws, engine, made


def limited_key(name, **limit):
    def prepare(engine):
        record, secret = keys.create_key(engine, name)
        limits.set_limits(engine, "key", record.id, "test", **limit)
        return secret
    return prepare


def test_a_key_limited_to_100_a_minute_gets_at_most_101_across_two_gateways(tmp_path, make_sim, make_gateway):
    controller, gws, engine, secret = start(tmp_path, make_sim, make_gateway, limited_key("limited", rpm=100))
    try:
        # 160 requests over 2 gateways x 2 workers within a few seconds: one accountant counts them
        # all, so exactly 100 are served and 60 refused. Workers counting apart would serve 160.
        results = fire([gw.url for gw in gws], secret, 160)
        statuses = [s for s, _ in results]
        assert statuses.count(200) <= 101 and statuses.count(200) >= 100, statuses
        assert statuses.count(429) == 160 - statuses.count(200)
        refused = next(h for s, h in results if s == 429)
        # A minute, and the second in which the requests of a worker's allowance may have been made.
        assert 1 <= int(refused["Retry-After"]) <= 61
        served = next(h for s, h in results if s == 200)
        assert served["X-RateLimit-Limit-Requests"] == "100"
    finally:
        engine.dispose()
        controller.stop()


def test_a_budget_is_overspent_by_at_most_one_request(tmp_path, make_sim, make_gateway):
    def prepare(engine):
        # One unit per output token, nothing for input: a request answering 10 tokens costs 10 units.
        limits.set_price(engine, "sim", "0", "1000000", "test")
        return limited_key("budgeted", budget=rules.parse_money("95"), period="day")(engine)

    controller, gws, engine, secret = start(tmp_path, make_sim, make_gateway, prepare)
    try:
        # 40 requests at once against a budget of 95 units: requests in flight hold their estimated
        # cost, so admissions stop once spent + held reaches 95. At most 10 are served (the tenth
        # crosses from 90 to 100), so the overspend is at most one request's 10 units.
        results = fire([gw.url for gw in gws], secret, 40)
        statuses = [s for s, _ in results]
        assert statuses.count(200) == 10 and statuses.count(429) == 30, statuses
        wait_until("usage rows to be written", 10, lambda: _spent(engine) >= 100 * rules.MICROS)
        assert _spent(engine) == 100 * rules.MICROS  # 95 + 5: less than one request over
        status, headers, body = post(gws[0].url + "/v1/chat/completions", BODY, secret)
        error = json.loads(body)["error"]
        assert status == 429 and error["code"] == "budget_exhausted" and "daily budget of this key" in error["message"]
        assert int(headers["Retry-After"]) <= 86400
    finally:
        engine.dispose()
        controller.stop()


def _spent(engine) -> int:
    """What was spent, besides the probe that waited for the accountant."""
    probe = sa.select(store.api_keys.c.id).where(store.api_keys.c.name == "probe")
    query = (sa.select(sa.func.coalesce(sa.func.sum(store.usage.c.cost_micros), 0))
             .where(sa.or_(store.usage.c.key_id.is_(None), store.usage.c.key_id.not_in(probe))))
    with engine.connect() as conn:
        return conn.execute(query).scalar()


def test_without_a_controller_the_masters_accountant_is_shared_by_its_workers(tmp_path, make_sim, make_gateway):
    sim = make_sim(tokens_per_s=0, ttft_ms=0)
    url = f"sqlite:///{tmp_path}/alone.db"
    engine = store.open_store(url)
    record, secret = keys.create_key(engine, "ten", models=["sim"])
    limits.set_limits(engine, "key", record.id, "test", rpm=10)
    other, other_secret = keys.create_key(engine, "elsewhere", models=["another-model"])
    gw = make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=3)
    try:
        # Three workers, one pool: 10 served of 30, whichever worker each landed on.
        statuses = [s for s, _ in fire([gw.url], secret, 30, threads=10)]
        assert statuses.count(200) == 10 and statuses.count(429) == 20
        assert "the accountant for this gateway's limits is on 127.0.0.1:" in gw.log()
        # An allowlist refuses a model the key may not use, saying which it may.
        status, _, body = post(gw.url + "/v1/chat/completions", BODY, other_secret)
        error = json.loads(body)["error"]
        assert status == 403 and error["code"] == "model_not_allowed" and "another-model" in error["message"]
    finally:
        engine.dispose()


def test_a_silent_accountant_waives_rate_limits_and_refuses_budgets(tmp_path, make_sim, make_gateway):
    def prepare(engine):
        limits.set_price(engine, "sim", "0", "1", "test")
        return limited_key("rated", rpm=1)(engine), limited_key("budgeted", budget=rules.parse_money("100"))(engine)

    controller, (gw,), engine, (rated_secret, budgeted_secret) = start(tmp_path, make_sim, make_gateway, prepare,
                                                                       gateways=1, accountant_timeout=0.5)
    try:
        assert post(gw.url + "/v1/chat/completions", BODY, rated_secret)[0] == 200
        waived = gw.settled_total(UNAVAILABLE)  # the probe's, while the gateway had no snapshot yet
        controller.stop()
        # Rate limits protect capacity and are let through; money is not spent unchecked.
        assert [post(gw.url + "/v1/chat/completions", BODY, rated_secret)[0] for _ in range(3)] == [200] * 3
        status, headers, body = post(gw.url + "/v1/chat/completions", BODY, budgeted_secret)
        assert status == 503 and json.loads(body)["error"]["code"] == "limits_unavailable"
        assert gw.settled_total(UNAVAILABLE) == waived + 4
    finally:
        engine.dispose()
        controller.stop()


UNAVAILABLE = "llmgw_accountant_unavailable_total"


def test_every_request_is_priced_limited_or_not(tmp_path, make_sim, make_gateway):
    # sim answers 10 completion tokens; at 2 units a million output tokens that is 20 micro-units.
    sim = make_sim(tokens_per_s=0, ttft_ms=0, default_tokens=10)
    url = f"sqlite:///{tmp_path}/priced.db"
    engine = store.open_store(url)
    limits.set_price(engine, "sim", "0", "2", "test")
    _, secret = keys.create_key(engine, "free-running")  # nothing limits it
    gw = make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=1)
    try:
        assert post(gw.url + "/v1/chat/completions", {**BODY, "max_tokens": None}, secret)[0] == 200
        wait_until("the usage row", 10, lambda: _spent(engine) > 0)
        assert _spent(engine) == 20
    finally:
        engine.dispose()


def test_personal_use_is_limited_a_person_at_a_time_and_turned_off_in_seconds(tmp_path, make_sim, make_gateway):
    # The Go version's `auth.personal`: limits on what a person does on their own, or personal use turned off
    # so that people use the gateway only through their projects. Through a real controller's keys message.
    import subprocess
    import sys

    from llmgw.people import accounts

    def prepare(engine):
        limits.set_limits(engine, "personal", "", "test", rpm=3)
        ayse = accounts.create_user(engine, "ayse@example.org", "a long enough password", state="active")
        deniz = accounts.create_user(engine, "deniz@example.org", "a long enough password", state="active")
        return {"laptop": keys.create_key(engine, "laptop", None, user_id=ayse.id)[1],
                "phone": keys.create_key(engine, "phone", None, user_id=ayse.id)[1],
                "deniz": keys.create_key(engine, "deniz", None, user_id=deniz.id)[1],
                "project": keys.create_key(engine, "ci", user_id=ayse.id)[1]}

    controller, gws, engine, made = start(tmp_path, make_sim, make_gateway, prepare, gateways=1)
    url = gws[0].url + "/v1/chat/completions"
    try:
        # Three a minute for ayse on her own, whichever personal key she uses; deniz and her project key apart.
        statuses = [post(url, BODY, made[k])[0] for k in ("laptop", "phone", "laptop", "phone")]
        assert statuses == [200, 200, 200, 429]
        assert post(url, BODY, made["deniz"])[0] == 200 and post(url, BODY, made["project"])[0] == 200

        store_url = f"sqlite:///{tmp_path}/shared.db"
        cli = [sys.executable, "-m", "llmgw", "--store", store_url]
        off = subprocess.run([*cli, "limits", "set", "--scope", "personal", "--disabled", "yes"],
                             capture_output=True, text=True, timeout=60)
        assert off.returncode == 0 and "turned off" in off.stderr, off.stderr
        wait_until("personal keys refused", 30, lambda: post(url, BODY, made["deniz"])[0] == 403)
        status, _, body = post(url, BODY, made["deniz"])
        assert json.loads(body)["error"]["code"] == "personal_use_off"
        assert "use a key of one of your projects" in json.loads(body)["error"]["message"]
        assert post(url, BODY, made["project"])[0] == 200
        refused = subprocess.run([*cli, "keys", "create", "another", "--for", "deniz@example.org"],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "personal use is turned off here" in refused.stderr
        shown = subprocess.run([*cli, "limits", "show"], capture_output=True, text=True, timeout=60).stdout
        assert "each person on their own" in shown and "3 requests/min; turned off" in shown

        on = subprocess.run([*cli, "limits", "set", "--scope", "personal", "--disabled", "no"],
                            capture_output=True, text=True, timeout=60)
        assert on.returncode == 0, on.stderr
        # Served again, or held to the three a minute that the waits above may have spent.
        wait_until("personal keys taken again", 30, lambda: post(url, BODY, made["deniz"])[0] in (200, 429))
    finally:
        engine.dispose()
        controller.stop()
