"""A replica's measured capacity: the bench's search, where the figure is kept, and how admission holds it.

The search is tried on an engine whose figures follow a closed loop's queueing (N requests run at once,
the rest wait their turn); the saved figure is followed from the store through the catalog and the
snapshot to a gateway worker's router; and a request naming its replica, as the bench's do, is tried
through a real gateway with an administrator's key and with others. `tests/test_bench.py` runs the
bench itself as an operator does, on real processes.
"""

from __future__ import annotations

import json
import random

import pytest

from llmgw import store
from llmgw.cli import benchload, ramp
from llmgw.control import capacity, catalog, publisher
from llmgw.control.reconciler import Replica
from llmgw.gateway.balancer import ReplicaState, Router
from llmgw.gateway.breaker import Breaker
from llmgw.gateway.follower import from_controller
from llmgw.gateway.snapshot import ModelSpec, ReplicaSpec, Snapshot
from llmgw.people import accounts, keys, limits
from llmgw.procs import wait_for
from llmgw.wire import gateways
from tests.conftest import make_key, post

STALE = 5.0


def queueing_engine(slots: int, ttft: float, duration: float, noise: float = 0.0, seed: int = 1,
                    rounds: bool = False):
    """What a closed loop measures of an engine running SLOTS requests at once, each taking DURATION (TTFT
    to the first token), the rest waiting in turn: past SLOTS every request waits (C - SLOTS) / SLOTS of a
    request's time, and the requests a second stay at SLOTS / DURATION. ROUNDS: as the sim does with
    requests that all take the same time, they run in lock-step rounds, and C - SLOTS of every C wait a
    whole DURATION while the others do not wait at all (the p90 sees it only past a tenth)."""
    rng = random.Random(seed)

    def measure(level: int) -> ramp.Level:
        wait = max(0, level - slots) / slots * duration
        jitter = 1 + rng.uniform(-noise, noise)
        latency = (duration + wait) * jitter
        first = ttft + wait
        if rounds:
            first = ttft + (duration if max(0, level - slots) / level > 0.1 else 0.0)
        return ramp.Level(concurrency=level, samples=max(20, 2 * level), failed=0, ttft=first * jitter,
                          tpot=0.02 * jitter, requests_per_s=level / latency, tokens_per_s=level / latency * 32)
    return measure


def search(measure, slo: ramp.SLO, most: int = 512) -> ramp.Ramp:
    found = ramp.Ramp(slo, most)
    while (level := found.next_level()) is not None:
        found.record(measure(level))
    return found


@pytest.mark.parametrize("rounds", [False, True])
@pytest.mark.parametrize("slots", [1, 2, 3, 4, 5, 7, 8, 13, 32, 50, 100, 300])
def test_the_search_finds_an_engines_capacity_within_ten_percent(slots, rounds):
    duration = 1.0
    # An SLO that a wait of 2% of a request breaks: above the engine's capacity by 5% (the search's
    # precision) every request waits 5% of one. In rounds, where the p90 misses a queue of fewer than a
    # tenth, the throughput that stopped rising is what breaks the level.
    slo = ramp.SLO(ttft=0.05 + 0.02 * duration, tpot=0.1)
    found = search(queueing_engine(slots, 0.05, duration, noise=0.005, seed=slots, rounds=rounds), slo)
    assert slots * 0.9 <= found.capacity <= slots * 1.1, [(lv.concurrency, why) for lv, why in found.levels]
    if slots < 1 / ramp.PRECISION and not rounds:
        assert found.capacity == slots  # narrowed to one request: the last level that held, not one past it
    assert len(found.levels) <= 2 * max(1, slots).bit_length() + 2  # doubling, then halving the gap


def test_not_even_one_at_a_time_is_an_answer_and_the_most_tried_is_said():
    slow = search(queueing_engine(4, ttft=3.0, duration=5.0), ramp.SLO(ttft=2.0, tpot=0.1))
    assert slow.capacity == 0 and [lv.concurrency for lv, _ in slow.levels] == [1]
    assert "not even 1 request at a time" in slow.conclusion() and "time to first token p90 was 3.000 s" in slow.conclusion()
    roomy = search(queueing_engine(1000, 0.05, 1.0), ramp.SLO(ttft=2.0, tpot=0.1), most=48)
    assert roomy.capacity == 48 and "the most this run tried" in roomy.conclusion()
    assert [lv.concurrency for lv, _ in roomy.levels] == [1, 2, 4, 8, 16, 32, 48]


def test_a_loose_slo_stops_where_concurrency_no_longer_buys_throughput():
    # Every request waits past the engine's 6 slots, but an SLO of a minute never notices: the search stops
    # because 16 at once served no more than 8 did, and reports a level that still brought throughput.
    found = search(queueing_engine(6, 0.05, 1.0), ramp.SLO(ttft=60.0, tpot=1.0))
    assert 6 <= found.capacity < 12
    assert "the requests added mostly waited" in found.why


def test_a_failed_request_breaks_its_level_and_says_what_failed():
    level = ramp.Level(8, 10, 1, 0.1, 0.02, 5.0, 100.0, failure="HTTP 502 upstream_error")
    assert ramp.judge(level, ramp.SLO(2.0, 0.1), None) == "1 of 11 requests failed: HTTP 502 upstream_error"
    tpot = ramp.Level(8, 10, 0, 0.1, 0.25, 5.0, 100.0)
    assert ramp.judge(tpot, ramp.SLO(2.0, 0.1, 99), None) == "time per output token p99 was 250.0 ms, over the SLO's 100 ms"


def test_a_level_is_timed_from_the_streams_tokens_and_no_prompt_is_cached(make_sim):
    sim = make_sim(model="m", ttft_ms=20, tokens_per_s=100)
    level = benchload.measure(benchload.Target(sim.url, "k", "m", "r", 10, 5, 30), 2, 4, 90)
    assert (level.concurrency, level.samples, level.failed) == (2, 4, 0), level
    assert 0.02 <= level.ttft < 1.0 and 0.009 < level.tpot < 0.2 and level.tokens_per_s > 0
    figures = sim.metrics()
    assert figures["llmgw_sim_requests_total"] == 6  # each client's first request is sent, not measured
    assert figures["vllm:prefix_cache_hits_total"] == 0  # every prompt starts where no other did
    with pytest.raises(benchload.Refused, match=r"refused the bench's request \(404\): The model `other`"):
        benchload.measure(benchload.Target(sim.url, "k", "other", "r", 10, 5, 30), 1, 3, 90)
    sim.stop()
    down = benchload.measure(benchload.Target(sim.url, "k", "m", "r", 10, 5, 30), 1, 3, 90)
    assert down.failed == 1 and "the connection to the gateway failed" in down.failure
    assert "1 of 1 requests failed" in ramp.judge(down, ramp.SLO(2.0, 0.1), None)


# --- the limit a gateway worker holds a replica to ------------------------------------------------------


def state(limit=None, rid="r") -> ReplicaState:
    return ReplicaState(ReplicaSpec(rid, f"http://{rid}", ("m",), max_in_flight=limit), Breaker(5, 10))


def test_a_measured_limit_counts_every_gateways_requests_and_replaces_max_outstanding():
    r = state(limit=4)
    assert r.limit == 4
    r.outstanding = 3
    assert not r.full(0.0, STALE, per_worker=1)  # measured: routing.max_outstanding no longer applies
    r.outstanding = 4
    assert r.full(0.0, STALE, per_worker=0)
    # Others' requests, as the engine last reported them beyond ours, count too.
    r.outstanding = 1
    r.record_metrics({"running": 3.0, "waiting": 1.0}, 100.0)
    assert r.in_flight(100.5, STALE) == 4.0 and r.full(100.5, STALE, 0)
    assert not r.full(106.0, STALE, 0)  # stale figures: only our own
    unmeasured = state()
    unmeasured.outstanding = 50
    assert unmeasured.limit is None and not unmeasured.full(0.0, STALE, 0)  # today's behaviour: no limit
    assert unmeasured.full(0.0, STALE, 50)  # or routing.max_outstanding of this worker's own


def test_a_full_replica_is_passed_over_while_another_has_room():
    snapshot = Snapshot(version=1, models={"m": ModelSpec("m")},
                        replicas={"a": ReplicaSpec("a", "http://a", ("m",), max_in_flight=2),
                                  "b": ReplicaSpec("b", "http://b", ("m",))})
    router = Router(snapshot, 5, 10.0, STALE, 1.25, seed=3)
    assert router.limited("m") and router.has_room("m", 0.0)
    router.states["a"].outstanding = 2
    assert all(router.pick("m", 0.0, None, set()).spec.id == "b" for _ in range(50))
    only_a = Snapshot(version=2, models=snapshot.models, replicas={"a": snapshot.replicas["a"]})
    router.apply(only_a)
    assert not router.has_room("m", 0.0)
    assert router.pick("m", 0.0, None, set()).spec.id == "a"  # let through by the queue: the engine queues it
    router.apply(Snapshot(version=3, models=snapshot.models, replicas={"b": snapshot.replicas["b"]}))
    assert not router.limited("m")  # nothing measured, no max_outstanding: no request ever waits for room
    assert router.replica_for("m", "b") is router.states["b"] and router.replica_for("x", "b") is None


# --- from the bench's result to the gateways ---------------------------------------------------------------


MODEL = {"name": "m", "source": "/m", "profiles": [{"name": "cpu", "engine": "sim"}, {"name": "gpu", "engine": "vllm"}]}


def test_a_saved_capacity_survives_a_restart_and_reaches_the_replicas_of_its_profile(tmp_path):
    engine = store.open_store(f"sqlite:///{tmp_path}/s.db")
    cat = catalog.Catalog(engine, [MODEL])
    model = cat.models()["m"]
    cpu, gpu = model.fingerprint(model.profiles[0]), model.fingerprint(model.profiles[1])
    saved = cat.save_capacity("m", cpu, 6, {"ttft_s": 0.2, "replica": "m-1", "unknown": "dropped"})
    assert saved.profile == "cpu" and saved.measured == {"ttft_s": 0.2, "replica": "m-1"}
    again = catalog.Catalog(engine, [MODEL])  # a controller started again on the store
    assert again.limits() == {("m", cpu): 6}
    replicas = [Replica("m-1", "m", "n1", "ready", cpu, url="http://10.0.0.1:1", address="10.0.0.1"),
                Replica("m-2", "m", "n1", "ready", cpu, url="http://10.0.0.1:2", address="10.0.0.1"),
                Replica("m-3", "m", "n2", "ready", gpu, url="http://10.0.0.2:1", address="10.0.0.2")]
    body = publisher.snapshot_body(again.models(), replicas, limits=again.limits())
    assert [r.get("max_in_flight") for r in body["replicas"]] == [6, 6, None]  # absent where not measured
    message = gateways.decode(gateways.encode("snapshot", epoch="e", version=1, **body))
    snapshot = from_controller(message, Snapshot(version=0, models={}, replicas={}))
    assert {rid: r.max_in_flight for rid, r in snapshot.replicas.items()} == {"m-1": 6, "m-2": 6, "m-3": None}
    # Measuring again replaces; a measurement of a profile edited since is kept but not used.
    again.save_capacity("m", cpu, 5, {})
    edited = {**MODEL, "profiles": [{"name": "cpu", "engine": "sim", "args": ["--ttft-ms", "9"]}]}
    later = catalog.Catalog(engine, [edited])
    assert later.capacities[("m", "cpu")].max_in_flight == 5 and later.limits() == {}
    assert later.capacities[("m", "cpu")].to_dict(later.current_fingerprint("m", "cpu"))["current"] is False
    assert later.forget_capacity("m") == 1 and catalog.Catalog(engine, [edited]).capacities == {}
    engine.dispose()


@pytest.mark.parametrize("limit,figures,says", [
    (0, {}, "a level of 0"), (True, {}, "max_in_flight is a whole number"), (gateways.MAX_IN_FLIGHT + 1, {}, "from 1"),
    (4, {"ttft_s": -1}, "ttft_s is a number, 0 or more"), (4, {"tokens_per_s": float("nan")}, "tokens_per_s"),
    (4, {"gateway": "x" * 3000}, "gateway is a text"),
])
def test_a_measurement_out_of_bounds_is_refused_saying_which_figure(tmp_path, limit, figures, says):
    engine = store.open_store(f"sqlite:///{tmp_path}/s.db")
    cat = catalog.Catalog(engine, [MODEL])
    model = cat.models()["m"]
    with pytest.raises(capacity.CapacityError, match=says):
        cat.save_capacity("m", model.fingerprint(model.profiles[0]), limit, figures)
    with pytest.raises(capacity.CapacityError, match="filed under the wrong profile"):
        cat.save_capacity("m", "0123456789ab", 4, {})
    assert capacity.read_all(engine) == {}
    engine.dispose()


# --- who may name the replica a request goes to --------------------------------------------------------


def people(store_url: str) -> tuple[str, str, str]:
    """Keys of an administrator, of a person who is not one, and of a project."""
    engine = store.open_store(store_url)
    try:
        admin = accounts.create_user(engine, "ops@example.com", "a long passphrase", state="active", is_admin=True)
        person = accounts.create_user(engine, "dev@example.com", "a long passphrase", state="active")
    finally:
        engine.dispose()
    return (make_key(store_url, "bench", project=None, user_id=admin.id),
            make_key(store_url, "dev", project=None, user_id=person.id), make_key(store_url, "app"))


def test_only_an_administrators_key_may_choose_the_replica(tmp_path, make_sim, make_gateway):
    a, b = (make_sim(model="m", replica=name, ttft_ms=1, tokens_per_s=0) for name in ("a", "b"))
    store_url = f"sqlite:///{tmp_path}/gw.db"
    gw = make_gateway(store_url, workers=1, endpoints=[{"id": "a", "url": a.url, "models": ["m"]},
                                                       {"id": "b", "url": b.url, "models": ["m"]}])
    admin_key, person_key, project_key = people(store_url)
    chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    url = gw.url + "/v1/chat/completions"
    wait_for("the gateway reading the new keys", 30, lambda: post(url, chat, admin_key)[0] == 200)
    for _ in range(8):
        status, _, raw = post(url, chat, admin_key, headers={"X-Llmgw-Replica": "b"})
        assert status == 200 and json.loads(raw)["system_fingerprint"] == "sim-b"
    assert a.metrics()["llmgw_sim_requests_total"] <= 1  # only the first, unpinned, could have gone there
    for key in (person_key, project_key):
        status, _, raw = post(url, chat, key, headers={"X-Llmgw-Replica": "b"})
        error = json.loads(raw)["error"]
        assert status == 403 and error["code"] == "replica_choice_not_allowed", raw
        assert "Only an administrator's key may choose a replica" in error["message"]
    status, _, raw = post(url, chat, admin_key, headers={"X-Llmgw-Replica": "c"})
    assert status == 404 and json.loads(raw)["error"]["code"] == "replica_not_found"
    assert "`llmgw ctl replicas --model m` lists the ready ones" in json.loads(raw)["error"]["message"]
    assert post(url, chat, person_key)[0] == 200  # without the header, anyone's request is routed as ever


def test_a_refused_choice_of_replica_counts_against_the_keys_rate(tmp_path, make_sim, make_gateway):
    # A key limited to 2 a minute that names a replica is refused each time, and each refusal counts: it
    # cannot probe (or load the gateway) past its rate by asking for what it may not have.
    sim = make_sim(model="m", replica="a", ttft_ms=1, tokens_per_s=0)
    store_url = f"sqlite:///{tmp_path}/gw.db"
    engine = store.open_store(store_url)
    record, secret = keys.create_key(engine, "two-a-minute")
    limits.set_limits(engine, "key", record.id, "test", rpm=2)
    engine.dispose()
    gw = make_gateway(store_url, workers=1, endpoints=[{"id": "a", "url": sim.url, "models": ["m"]}])
    chat = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    statuses = [post(gw.url + "/v1/chat/completions", chat, secret, headers={"X-Llmgw-Replica": "a"})[0]
                for _ in range(2)]
    assert statuses == [403, 403]
    assert post(gw.url + "/v1/chat/completions", chat, secret)[0] == 429
