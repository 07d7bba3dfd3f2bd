"""`llmgw ctl model add` says what will happen to the model it added, against a real controller: a model with
replicas to keep starts now; an on-demand one (scaling.min = 0) starts only at its first request, and ctl
said "shows it starting" for it too, sending operators to look for a replica that was never coming."""

import json
import re
import urllib.request

import pytest

from tests.cluster import Controller


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    c = Controller(tmp_path_factory.mktemp("ctl-on-demand"))
    yield c
    c.stop()


def add(controller, tmp_path, name: str, scaling: str):
    model = tmp_path / f"{name}.toml"
    model.write_text(f'name = "{name}"\nsource = "/dev/null"\nscaling = {scaling}\n'
                     '[[profiles]]\nengine = "sim"\n')
    return controller.ctl("model", "add", "-f", str(model))


def test_an_on_demand_model_is_said_to_start_at_its_first_request(controller, tmp_path):
    added = add(controller, tmp_path, "lazy", '{min = 0, max = 1, idle_timeout = "30m"}')
    assert added.returncode == 0, added.stderr
    said = " ".join(added.stderr.split())
    assert "starting" not in said
    assert "on demand (scaling.min = 0): nothing starts now" in said and "The first request for it starts" in said
    assert re.search(r"waits up to gateway\.load_wait \(120 s in this configuration\) and then gets 503", said)
    assert "stops after 30 minutes without requests" in said and "llmgw ctl scale lazy --min 1" in said
    assert controller.replicas("lazy") == []  # and indeed nothing started


def test_an_on_demand_model_without_an_idle_timeout_names_the_default(controller, tmp_path):
    said = " ".join(add(controller, tmp_path, "lazier", "{min = 0, max = 1}").stderr.split())
    assert "stops after 15 minutes without requests" in said


def test_a_model_with_replicas_to_keep_is_said_to_be_starting(controller, tmp_path):
    added = add(controller, tmp_path, "eager", "{min = 1, max = 1}")
    assert added.returncode == 0 and "`llmgw ctl replicas --model eager` shows it starting" in added.stderr


def test_a_stopped_model_is_not_offered_and_a_request_for_it_is_told_so_at_once(controller, tmp_path, make_gateway):
    # A model scaled to no replica (max = 0) was published as on demand: the chat page offered it as
    # "starts when asked", and a request for it waited gateway.load_wait for a start that never came.
    import time

    from tests.conftest import make_key, post, wait_until

    assert add(controller, tmp_path, "parked", "{min = 0, max = 0}").returncode == 0
    url = controller.values["store.url"]
    key = make_key(url, "stopped-test")
    gw = make_gateway(store_url=url, workers=1, gateway__controller=f"127.0.0.1:{controller.gateway_port}",
                      gateway__key_file=controller.gateway_key_file("gw-stopped"), gateway__load_wait=60)

    def listed():
        status, _, body = post(gw.url + "/v1/chat/completions", {"model": "parked", "max_tokens": 2,
                                                                 "messages": [{"role": "user", "content": "hi"}]}, key)
        return status, body

    wait_until("the gateway to hear the catalog", 60, lambda: b"catalog_unknown" not in listed()[1])
    asked = time.monotonic()
    status, body = listed()
    assert status == 503 and b"model_stopped" in body and b"llmgw ctl scale parked --max 1" in body
    assert time.monotonic() - asked < 30  # not gateway.load_wait
    req = urllib.request.Request(gw.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert "parked" not in [m["id"] for m in json.loads(resp.read())["data"]]


def test_a_model_with_no_replica_ready_says_what_it_waits_for():
    # The chat page wakes a model and says what it waits for: a node, its download, its engine.
    from llmgw.control import catalog, publisher
    from llmgw.control.reconciler import Replica
    from llmgw.gateway.follower import from_controller
    from llmgw.gateway.snapshot import Snapshot
    from llmgw.web import chatpage
    from llmgw.wire import gateways

    def model(name, scaling):
        return catalog.parse_model({"name": name, "source": "/m", "scaling": scaling, "profiles": [{"engine": "sim"}]})

    models = {m.name: m for m in (model("big", {"min": 1}), model("lazy", {"min": 0, "max": 1}),
                                  model("busy", {"min": 1}), model("served", {"min": 1}))}
    replicas = [Replica("b1", "big", "n1", "pending"),
                Replica("b2", "big", "n2", "fetching", fetch={"bytes_done": 512 << 20, "bytes_total": 2 << 30}),
                Replica("u1", "busy", "n1", "starting"),
                Replica("s1", "served", "n1", "ready", url="http://10.0.0.5:8001"),
                Replica("s2", "served", "n2", "fetching")]
    body = publisher.snapshot_body(models, replicas)
    snapshot = from_controller(gateways.decode(gateways.encode("snapshot", epoch="e", version=1, **body)),
                               Snapshot(version=0, models={}, replicas={}))
    said = {name: chatpage.status(spec, name == "served") for name, spec in snapshot.models.items()}
    assert said == {"big": "downloading its weights: 25% of 2 GiB", "lazy": "starts when asked",
                    "busy": "its engine is starting", "served": ""}
