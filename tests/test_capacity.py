"""A replica's measured capacity: where the figure is kept, and how admission holds it.

The saved figure is followed from the store through the catalog and the
snapshot to a gateway worker's router; and a request naming its replica, as the bench's do, is tried
through a real gateway with an administrator's key and with others. `tests/test_bench.py` runs the
bench itself as an operator does, on real processes.
"""

from __future__ import annotations

import json

import pytest

from llmgw import store
from llmgw.control import capacity, catalog, publisher
from llmgw.control.reconciler import Replica
from llmgw.gateway.balancer import ReplicaState, Router
from llmgw.gateway.breaker import Breaker
from llmgw.gateway.follower import from_controller
from llmgw.gateway.snapshot import ModelSpec, ReplicaSpec, Snapshot
from llmgw.people import accounts
from llmgw.procs import wait_for
from llmgw.wire import gateways
from tests.conftest import make_key, post

STALE = 5.0


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
    replicas = [Replica("m-1", "m", "n1", "ready", cpu, url="http://a"), Replica("m-2", "m", "n1", "ready", cpu,
                url="http://b"), Replica("m-3", "m", "n2", "ready", gpu, url="http://c")]
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
