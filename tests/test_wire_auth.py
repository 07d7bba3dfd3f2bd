"""Attacks on the channels between processes: each must fail against a cluster started as it ships.

A forger on the controller's host publishes routing snapshots while the
controller restarts; a node key tries the gateways' sockets and a gateway key
the agents'; a node with a valid key speaks for a shard placed on another
node. Each attack is also shown to work where the channel is left open
(plaintext), so the tests prove they can see it.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import pytest
import zmq

from llmgw.control import catalog, publisher
from llmgw.control.agentserver import AgentServer
from llmgw.control.authenticator import KeyRing
from llmgw.control.fleet import Fleet
from llmgw.control.reconciler import Replica, Replicas, plan
from llmgw.gateway import follower
from llmgw.gateway.snapshot import Snapshot
from llmgw.procs import free_port
from llmgw.wire import agent as protocol
from llmgw.wire import gateways
from tests.cluster import Controller
from tests.conftest import make_key, wait_until

MODEL = {"name": "honest", "source": "/dev/null", "scaling": {"min": 0, "max": 1},
         "profiles": [{"engine": "sim"}]}


def models_of(gateway, key) -> set[str]:
    request = urllib.request.Request(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return {m["id"] for m in json.loads(resp.read())["data"]}


def forge(port: int, seconds: float, garbage: bool = False) -> None:
    """Bind the controller's snapshot port and publish a forged snapshot for SECONDS (with GARBAGE, a
    snapshot no schema accepts as well)."""
    context = zmq.Context()
    sock = context.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    # A well-formed message: only the channel's authentication can keep it out.
    forged = gateways.encode("snapshot", epoch="forger", version=10 ** 15,
                             models=[{"name": "forged", "aliases": [], "on_demand": False}],
                             replicas=[{"id": "evil", "url": "http://127.0.0.1:9", "models": ["forged"]}])
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            sock.send_multipart([gateways.SNAPSHOT, forged])
            if garbage:
                sock.send_multipart([gateways.SNAPSHOT, b'{"type": "snapshot", "v": 1, "version": "x"}'])
            time.sleep(0.1)
    finally:
        sock.close(0)
        context.term()


@pytest.mark.parametrize("plaintext", [False, True])
def test_a_forged_snapshot_is_never_believed(tmp_path, make_gateway, plaintext):
    url = f"sqlite:///{tmp_path}/c.db"
    c = Controller(tmp_path, store_url=url, models=[MODEL], controller__plaintext=plaintext)
    keys = {"gateway__plaintext": True} if plaintext else {"gateway__key_file": c.gateway_key_file()}
    key = make_key(url)
    gw = make_gateway(store_url=url, workers=1, gateway__controller=f"127.0.0.1:{c.gateway_port}", **keys)
    try:
        wait_until("the gateway to follow the controller", 30, lambda: "honest" in models_of(gw, key))
        c.stop(signal.SIGKILL)
        forge(c.gateway_port, 4.0, garbage=plaintext)
        # The forger is heard only where the channel is open: that is what the old code did everywhere.
        assert ("forged" in models_of(gw, key)) is plaintext
        if plaintext:
            # What no schema accepts is dropped, logged and counted, never acted on.
            gw.metrics_once("a dropped message counted",
                            lambda text: gw.metric_total("llmgw_controller_messages_dropped_total", text))
            return
        # The real controller comes back with a new epoch and a clock that may be behind: believed at once.
        c.start()
        wait_until("the restarted controller's snapshot", 30, lambda: models_of(gw, key) >= {"honest"})
        assert "forged" not in models_of(gw, key)
    finally:
        c.stop()


def test_keys_open_only_their_own_sockets(tmp_path):
    c = Controller(tmp_path)
    try:
        with open(c.gateway_key_file()) as f:
            gateway_key = f.read()
        node_key = c.issue_key("n1")

        def field(text, name):
            return next(line.split('"')[1] for line in text.splitlines() if line.startswith(name + " "))

        context = zmq.Context()

        def subscriber(text):
            sock = context.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.curve_serverkey = field(text, "controller_public_key").encode()
            sock.curve_publickey = field(text, "public_key").encode()
            sock.curve_secretkey = field(text, "secret_key").encode()
            sock.setsockopt(zmq.SUBSCRIBE, gateways.SNAPSHOT)
            sock.connect(f"tcp://127.0.0.1:{c.gateway_port}")
            return sock

        with_gateway_key, with_node_key = subscriber(gateway_key), subscriber(node_key)
        # The publisher repeats every 2 s: a gateway key hears it, a node key never does.
        assert with_gateway_key.poll(15000), "a gateway key should receive snapshots"
        assert not with_node_key.poll(3000), "a node key must not open the gateways' sockets"
        assert "refused a connection with a key no gateway was issued" in c.log()
        with_gateway_key.close(0)
        with_node_key.close(0)
        context.term()
    finally:
        c.stop()


def key_of(node: str) -> str:
    """A stand-in for NODE's z85 public key, as the ZAP handler labels its messages (User-Id)."""
    return f"key-of-{node}"


def curve_server(fleet, replicas, nodes=("victim", "rogue")):
    """An agent server whose ring holds a key for each of NODES; its `handle` is called as `poll` would."""
    context = zmq.Context()
    ring = KeyRing({key_of(n).encode(): n for n in nodes})
    return context, ring, AgentServer(context, f"127.0.0.1:{free_port()}", fleet, ring, zmq.curve_keypair(),
                                      replicas=replicas)


ADDRESS = {"victim": "10.0.0.1", "rogue": "10.6.6.6"}  # where each node's connection comes from


def placed(replicas, shard_id: str, model: str, node: str) -> None:
    """Record SHARD_ID as the controller's placement plan does: sent to NODE, not yet reported."""
    replicas.items[shard_id] = Replica(shard_id, model, node, "pending")


def test_a_node_speaks_only_for_its_own_shards():
    fleet, replicas = Fleet(15, 60), Replicas()
    context, _, server = curve_server(fleet, replicas)
    try:
        for node in ("victim", "rogue"):
            server.handle(node.encode(), key_of(node), protocol.encode("register", node_id=node, agent_version="t"),
                          ADDRESS[node])
        placed(replicas, "m-1", "m", "victim")
        server.handle(b"victim", key_of("victim"), protocol.encode(
            "shard_status", node_id="victim", shard_id="m-1", state="ready", model="m", url="http://10.0.0.1:8000"),
            ADDRESS["victim"])
        # A node holding a valid key claims the victim's shard, with its own address.
        server.handle(b"rogue", key_of("rogue"), protocol.encode(
            "shard_status", node_id="rogue", shard_id="m-1", state="ready", model="m", url="http://10.6.6.6:8000"),
            ADDRESS["rogue"])
        server.handle(b"rogue", key_of("rogue"), protocol.encode(
            "shard_status", node_id="rogue", shard_id="m-1", state="stopped", model="m"), ADDRESS["rogue"])
        (replica,) = replicas.snapshot()
        assert (replica.node_id, replica.url, replica.state) == ("victim", "http://10.0.0.1:8000", "ready")
        assert server.refused == {"not_its_own": 2}
        # An ack for a request sent to the victim is not the rogue's to give.
        waiter = {"event": __import__("threading").Event(), "reply": None, "node": "victim"}
        server.waiting["r1"] = waiter
        server.handle(b"rogue", key_of("rogue"), protocol.encode("ack", node_id="rogue", request_id="r1", ok=True),
                      ADDRESS["rogue"])
        assert not waiter["event"].is_set() and server.refused["not_its_own"] == 3
        server.handle(b"victim", key_of("victim"), protocol.encode("ack", node_id="victim", request_id="r1", ok=True),
                      ADDRESS["victim"])
        assert waiter["event"].is_set()
        metrics = "".join(f"{s.name}{s.labels} {s.value}\n" for fam in server.collect() for s in fam.samples)
        assert "llmgw_agent_messages_refused_total{'why': 'not_its_own'} 3" in metrics
    finally:
        server.close()
        context.term()


def test_what_a_node_says_of_its_engines_health_is_bounded_and_about_its_own_shards_only():
    # Engine health's fields (an unhealthy state takes a replica out of every gateway's rotation; restarts and
    # their reason reach a metric, `llmgw ctl replicas` and the cluster page), said by a node whose key leaked.
    from llmgw.cli.tables import printable

    fleet, replicas = Fleet(15, 60), Replicas()
    context, _, server = curve_server(fleet, replicas)

    def say(node: str, **status) -> None:
        server.handle(node.encode(), key_of(node), protocol.encode("shard_status", node_id=node, shard_id="m-1",
                                                                    model="m", **status), ADDRESS[node])

    try:
        for node in ("victim", "rogue"):
            server.handle(node.encode(), key_of(node), protocol.encode("register", node_id=node, agent_version="t"),
                          ADDRESS[node])
        placed(replicas, "m-1", "m", "victim")
        say("victim", state="ready", url="http://10.0.0.1:8000")
        # Another node calls the victim's replica unhealthy, restarted, or stopped: none of it is taken.
        say("rogue", state="unhealthy", url="http://10.6.6.6:8000", detail="hung", restarts=99,
            restart_reason="it hung")
        (replica,) = replicas.snapshot()
        assert (replica.state, replica.restarts, replica.restart_reason) == ("ready", 0, None)
        assert replicas.restarted == {} and server.refused == {"not_its_own": 1}
        # Its own node's count only rises: saying fewer later takes none back from the metric.
        hostile = "\x1b[2J\x1b]0;owned\x07 stopped answering\nERROR fake log line"
        say("victim", state="unhealthy", url="http://10.0.0.1:8000", restarts=3, restart_reason=hostile)
        say("victim", state="ready", url="http://10.0.0.1:8000", restarts=1)
        (replica,) = replicas.snapshot()
        assert replica.restarts == 3 and replicas.restarted == {"m": 3}
        # Past the wire's bounds, a message is dropped whole: over a million restarts, a reason of a megabyte.
        say("victim", state="ready", url="http://10.0.0.1:8000", restarts=10**6 + 1)
        say("victim", state="ready", url="http://10.0.0.1:8000", restart_reason="x" * (1 << 20))
        (replica,) = replicas.snapshot()
        assert replica.restarts == 3 and replica.restart_reason == hostile and server.refused["malformed"] == 2
        # Where an operator reads the reason, a terminal is told nothing to do (ctl prints it so).
        assert "\x1b" not in printable(replica.restart_reason) and "\n" not in printable(replica.restart_reason)
    finally:
        server.close()
        context.term()


def status_of(gateway, key) -> int:
    request = urllib.request.Request(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_key_made_now_works_on_its_first_request_on_a_gateway_of_its_own(tmp_path, make_gateway):
    # Without a controller, each worker reads the store's key revision once a second; the request waits for it.
    from llmgw import store
    from llmgw.people import keys

    url = f"sqlite:///{tmp_path}/alone.db"
    gw = make_gateway(store_url=url, workers=2)
    engine = store.open_engine(url)
    try:
        _, secret = keys.create_key(engine, "fresh")
        assert [status_of(gw, secret) for _ in range(6)] == [200] * 6
    finally:
        engine.dispose()


def test_a_revoked_key_stops_on_every_worker_of_every_gateway_within_a_second(tmp_path, make_gateway):
    # Keys reach gateways from the controller; no worker polls the store for them.
    from llmgw import store
    from llmgw.people import keys

    url = f"sqlite:///{tmp_path}/c.db"
    c = Controller(tmp_path, store_url=url)
    gws = [make_gateway(store_url=url, workers=2, gateway__controller=f"127.0.0.1:{c.gateway_port}",
                        gateway__key_file=c.gateway_key_file(f"gw{i}")) for i in range(2)]
    try:
        engine = store.open_engine(url)
        record, secret = keys.create_key(engine, "soon-gone")
        # A key made after the workers started works on its first request on every worker (no worker reads the
        # store: its request waits for the push). It was refused for up to a second.
        assert [status_of(g, secret) for g in gws for _ in range(8)] == [200] * 16
        # A key of the same shape that was never made is refused, after that wait; one of another shape at once.
        started = time.monotonic()
        assert status_of(gws[0], "sk-llmgw-" + "x" * 43) == 401 and time.monotonic() - started >= 1.5
        started = time.monotonic()
        assert status_of(gws[0], "not-a-key") == 401 and time.monotonic() - started < 1.0
        keys.revoke_key(engine, record.id)
        revoked_at = time.monotonic()
        wait_until("the revocation on every worker", 10,
                   lambda: all(status_of(g, secret) == 401 for g in gws for _ in range(8)), interval=0.02)
        took = time.monotonic() - revoked_at
        print(f"revocation reached every worker of 2 gateways in {took:.3f} s")
        # The aim is 1 s; a busy 2-core machine may stretch it, never past 2 s.
        assert took < 2.0, took
        engine.dispose()
    finally:
        c.stop()


def test_a_gateway_key_is_issued_only_for_a_proper_name_and_opens_only_with_the_token(tmp_path):
    from llmgw import keyfiles

    c = Controller(tmp_path)
    try:
        bad = c.ctl("gateway-key", "issue", "../../etc/passwd")
        assert bad.returncode != 0 and "such as gw-01" in bad.stderr
        path = c.gateway_key_file("gw-ok")
        assert keyfiles.read_gateway_key_file(path)["gateway"] == "gw-ok"
        # Without the admin API's token nobody is issued a key, however well-formed the ask.
        request = urllib.request.Request(f"http://127.0.0.1:{c.admin_port}/api/v1/gateway-keys", method="POST",
                                         data=json.dumps({"name": "sneaky"}).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401
        refused.value.close()
    finally:
        c.stop()


def test_a_session_whose_key_was_revoked_or_replaced_is_refused_and_counted():
    # A CURVE session stays authenticated once open: the old code went on obeying it after its key was
    # issued again, since it looked only at the name the key had been issued to.
    fleet, replicas = Fleet(15, 60), Replicas()
    context, ring, server = curve_server(fleet, replicas, nodes=("victim",))
    try:
        server.handle(b"old", key_of("victim"), protocol.encode("register", node_id="victim", agent_version="t"),
                      ADDRESS["victim"])
        placed(replicas, "m-1", "m", "victim")
        server.handle(b"old", key_of("victim"), protocol.encode(
            "shard_status", node_id="victim", shard_id="m-1", state="ready", model="m", url="http://10.0.0.1:8000"),
            ADDRESS["victim"])
        assert [r.shard_id for r in replicas.snapshot()] == ["m-1"]
        ring.replace({b"key-issued-again": "victim"})
        server.forget_revoked()  # what the loop's next poll does
        # Forgotten with its replicas: none of its prompts go to a session nobody vouches for now.
        assert "victim" not in fleet.nodes and replicas.snapshot() == []
        server.handle(b"old", key_of("victim"), protocol.encode("heartbeat", node_id="victim", seq=1))
        server.handle(b"old", key_of("victim"), protocol.encode("register", node_id="victim", agent_version="t"))
        assert server.refused == {"revoked": 2} and "victim" not in fleet.nodes
        metrics = "".join(f"{s.name}{s.labels} {s.value}\n" for fam in server.collect() for s in fam.samples)
        assert "llmgw_agent_messages_refused_total{'why': 'revoked'} 2" in metrics
        # The node's new key opens a session of its own.
        server.handle(b"new", "key-issued-again", protocol.encode("register", node_id="victim", agent_version="t"))
        assert "victim" in fleet.nodes
    finally:
        server.close()
        context.term()


BAD_FACTS = {
    "a string for free bytes": protocol.encode("heartbeat", node_id="rogue", seq=2, disk={"free_bytes": "q"}),
    "NaN": protocol.encode("heartbeat", node_id="rogue", seq=3, memory={"total_bytes": float("nan")}),
    "negative memory": protocol.encode("heartbeat", node_id="rogue", seq=4, memory={"available_bytes": -1}),
    "a huge array": protocol.encode("heartbeat", node_id="rogue", seq=5, gpus=[{"index": 0}] * 100_000),
    "a long string": protocol.encode("heartbeat", node_id="rogue", seq=6, gpus=[{"index": 0, "class": "x" * 10**5}]),
    # Stored as it came, it broke the admin API's JSON for every node (too deep to write out again).
    "deep nesting": b'{"v":1,"type":"heartbeat","node_id":"rogue","seq":7,"later":' + b"[" * 985 + b"]" * 985 + b"}",
    "a bad registration": protocol.encode("register", node_id="rogue", agent_version="t", cpu={"count": "all"}),
}


def test_a_node_with_a_valid_key_sending_bad_facts_is_refused_and_the_others_are_still_placed():
    fleet, replicas = Fleet(15, 60), Replicas()
    context, _, server = curve_server(fleet, replicas)
    facts = {"engines": {"sim": "1"}, "engines_probed": True, "memory": {"total_bytes": 64 << 30},
             "disk": {"free_bytes": 100 << 30}}
    try:
        for node in ("victim", "rogue"):
            server.handle(node.encode(), key_of(node), protocol.encode("register", node_id=node, agent_version="t",
                                                                       **facts))
        for attack in BAD_FACTS.values():
            server.handle(b"rogue", key_of("rogue"), attack)
        assert server.refused == {"malformed": len(BAD_FACTS)}
        assert fleet.nodes["rogue"].status == {}  # nothing it sent was taken
        json.dumps([view.to_dict() for view in fleet.describe(time.monotonic())])
        # A pass reads every node's disk and memory for a download; with "q" held as the rogue's free
        # bytes, the old code raised there, and placed nothing for any model on any node.
        models = {name: catalog.parse_model({"name": name, "source": f"http://mirror/{name}.gguf",
                                             "size_bytes": 1 << 30, "profiles": [{"engine": "sim"}]})
                  for name in ("a", "b")}
        actions, unplaced = plan(models, fleet.describe(time.monotonic()), replicas, time.monotonic())
        assert sorted(a.model for a in actions) == ["a", "b"] and unplaced == {}
    finally:
        server.close()
        context.term()


ROGUE_MODELS = {
    # Needs eight H100s: no node here has one.
    "big": catalog.parse_model({"name": "big", "source": "/dev/null", "profiles": [
        {"engine": "sim", "gpus": 8, "gpu_class": "h100-80g"}]}),
    "small": catalog.parse_model({"name": "small", "source": "/dev/null", "profiles": [{"engine": "sim"}]}),
}


def shard(shard_id: str, model: str, url: str, **fields) -> dict:
    return {"shard_id": shard_id, "state": "ready", "model": model, "engine": "sim", "url": url,
            "profile_fp": ROGUE_MODELS[model].fingerprint(ROGUE_MODELS[model].profiles[0]), **fields}


def test_a_rogue_node_gets_nothing_published_in_or_out_of_the_adoption_window():
    # A third node with an issued key has not come back yet: the controller is settling, the window in which
    # a node may bring back replicas placed before it started.
    fleet = Fleet(15, 60, started=time.monotonic(), expected={"victim", "rogue", "late"})
    replicas = Replicas()
    context, _, server = curve_server(fleet, replicas, nodes=("victim", "rogue", "late"))
    server.claims.models = lambda: ROGUE_MODELS
    sent = []
    server.send = lambda identity, kind, **fields: sent.append((identity, kind, fields))
    facts = {"engines": {"sim": "1"}, "engines_probed": True, "gpus": []}
    try:
        assert fleet.settling(time.monotonic())
        server.handle(b"rogue", key_of("rogue"), protocol.encode("register", node_id="rogue", agent_version="t", shards=[
            shard("big-1", "big", "http://10.9.9.9:8000"),  # a model it cannot run, at another address
            shard("big-2", "big", "http://10.6.6.6:8000"),  # a model it cannot run, at its own address
            shard("small-1", "small", "http://10.9.9.9:8000"),  # a model it can run, at another address
            shard("small-2", "small", "http://127.0.0.1:8000"),  # the gateways' own machine
            shard("small-3", "small", "http://10.6.6.6.nip.io:8000"),  # a name, which could point anywhere
        ], **facts), ADDRESS["rogue"])
        assert replicas.snapshot() == [] and server.refused == {"not_its_own": 5}
        # Each of those engines is told to stop: no controller accounts for it.
        assert sorted(f["shard_id"] for _, kind, f in sent if kind == "stop_shard") == \
            ["big-1", "big-2", "small-1", "small-2", "small-3"]
        # What a restarted controller must still take in its window: an engine on the node's own address,
        # of a model its profile would place there.
        server.handle(b"victim", key_of("victim"), protocol.encode(
            "register", node_id="victim", agent_version="t", shards=[shard("small-9", "small", "http://10.0.0.1:81")],
            **facts), ADDRESS["victim"])
        assert [(r.shard_id, r.node_id, r.address) for r in replicas.snapshot()] == [("small-9", "victim", "10.0.0.1")]

        # The window closes a lost_after (60 s here) after the start, once every expected node is back; from
        # then on only placed shards are taken.
        server.handle(b"late", key_of("late"), protocol.encode("register", node_id="late", agent_version="t", **facts),
                      "10.0.0.3")
        fleet.started -= 61  # a minute later
        assert not fleet.adopting(time.monotonic())
        server.handle(b"rogue", key_of("rogue"), protocol.encode(
            "shard_status", node_id="rogue", **shard("small-4", "small", "http://10.6.6.6:8000")), ADDRESS["rogue"])
        assert [r.shard_id for r in replicas.snapshot()] == ["small-9"]
        # A shard this controller placed on the rogue is its own to report, on its own address only.
        placed(replicas, "small-5", "small", "rogue")
        server.handle(b"rogue", key_of("rogue"), protocol.encode(
            "shard_status", node_id="rogue", **shard("small-5", "small", "http://10.9.9.9:8000")), ADDRESS["rogue"])
        server.handle(b"rogue", key_of("rogue"), protocol.encode(
            "shard_status", node_id="rogue", **shard("small-5", "small", "http://10.6.6.6:8000")), ADDRESS["rogue"])
        body = publisher.snapshot_body(ROGUE_MODELS, replicas.snapshot())
        assert sorted((r["id"], r["url"], r["address"]) for r in body["replicas"]) == [
            ("small-5", "http://10.6.6.6:8000", "10.6.6.6"), ("small-9", "http://10.0.0.1:81", "10.0.0.1")]
        assert server.refused == {"not_its_own": 7}

        # A node's messages from another address than it registered from are not taken: it must register again.
        sent.clear()
        server.handle(b"rogue", key_of("rogue"), protocol.encode("heartbeat", node_id="rogue", seq=1), "10.9.9.9")
        assert [kind for _, kind, _ in sent] == ["register_again"]
    finally:
        server.close()
        context.term()


def test_a_gateway_dials_no_replica_off_its_node():
    body = {"version": 1, "models": [{"name": "m"}], "replicas": [
        {"id": "on", "url": "http://10.0.0.1:8000", "models": ["m"], "address": "10.0.0.1"},
        {"id": "off", "url": "http://10.9.9.9:8000", "models": ["m"], "address": "10.0.0.1"},
        {"id": "loop", "url": "http://127.0.0.1:8000", "models": ["m"], "address": "::1"},
        {"id": "named", "url": "http://evil.example:8000", "models": ["m"], "address": "10.0.0.1"},
        {"id": "unsaid", "url": "http://169.254.169.254:80", "models": ["m"]}]}
    empty = Snapshot(version=0, models={}, replicas={})
    # A controller on this machine: its loopback nodes are this machine's.
    assert sorted(follower.from_controller(body, empty, "127.0.0.1").replicas) == ["loop", "on"]
    # A controller elsewhere: 127.0.0.1 there is not 127.0.0.1 here.
    assert sorted(follower.from_controller(body, empty, "10.0.0.9").replicas) == ["on"]


def test_a_node_fails_only_its_own_placed_model_and_says_a_bounded_amount():
    fleet, replicas = Fleet(15, 60), Replicas()
    context, _, server = curve_server(fleet, replicas)
    try:
        server.handle(b"rogue", key_of("rogue"), protocol.encode("register", node_id="rogue", agent_version="t"),
                      ADDRESS["rogue"])
        placed(replicas, "small-1", "small", "rogue")
        server.handle(b"rogue", key_of("rogue"), protocol.encode(
            "shard_status", node_id="rogue", shard_id="small-1", state="failed", model="victim",
            detail="victim's weights are corrupt: remove it from the catalog", last_output=["x" * 4000] * 1000),
            ADDRESS["rogue"])
        # The failure is the placed model's, whatever the node calls it, and only its last lines are kept.
        assert set(replicas.failures) == {"small"} and "victim" not in replicas.retry_at
        kept = replicas.failures["small"].last_output
        assert len(kept) == 50 and {len(line) for line in kept} == {500}
    finally:
        server.close()
        context.term()


def test_a_node_listing_many_refused_shards_writes_a_bounded_log(caplog):
    fleet, replicas = Fleet(15, 60), Replicas()
    context, _, server = curve_server(fleet, replicas)
    server.send = lambda *args, **fields: None
    try:
        with caplog.at_level("WARNING", logger="llmgw.agentserver"):
            for i in range(5):
                server.handle(b"rogue", key_of("rogue"), protocol.encode("register", node_id="rogue", agent_version="t",
                              shards=[shard(f"s-{i}-{j}", "small", "http://10.9.9.9:8000") for j in range(200)]),
                              ADDRESS["rogue"])
        lines = [r for r in caplog.records if "refused what node rogue said" in r.getMessage()]
        assert server.refused["not_its_own"] == 1000 and len(lines) == 20
    finally:
        server.close()
        context.term()


def test_one_replica_cannot_shrink_its_models_context():
    model = catalog.parse_model({"name": "m", "source": "/m", "max_context": 16384, "profiles": [{"engine": "sim"}]})
    honest = Replica("m-1", "m", "a", "ready", url="http://10.0.0.1:1", context=8192)
    rogue = Replica("m-2", "m", "b", "ready", url="http://10.6.6.6:1", context=1)
    (row,) = publisher.snapshot_body({"m": model}, [honest, rogue])["models"]
    assert row["max_context"] == 8192  # what llama.cpp serves of the 16,384 asked; not the rogue's 1


def test_a_rogue_agent_with_a_valid_key_gets_no_replica_from_a_real_controller(tmp_path):
    models = [{"name": "big", "source": "/dev/null", "profiles": [{"engine": "sim", "gpus": 1, "gpu_class": "h100-80g"}]},
              {"name": "small", "source": "/dev/null", "scaling": {"min": 0, "max": 1}, "profiles": [{"engine": "sim"}]}]
    fingerprint = {m["name"]: (lambda parsed: parsed.fingerprint(parsed.profiles[0]))(catalog.parse_model(m))
                   for m in models}
    # A node may bring back replicas for lost_after (6 s) after the controller starts: the rogue's first
    # registration comes in that window, its second after it.
    c = Controller(tmp_path, models=models, controller__unreachable_after=3.0, controller__lost_after=6.0)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        text = c.issue_key("rogue")
        c.stop()
        c.start()  # which now expects the rogue, the one node with an issued key

        def field(name):
            return next(line.split('"')[1] for line in text.splitlines() if line.startswith(name + " "))

        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey = field("controller_public_key").encode()
        sock.curve_publickey = field("public_key").encode()
        sock.curve_secretkey = field("secret_key").encode()
        sock.connect(f"tcp://127.0.0.1:{c.agent_port}")

        def register(*shards) -> list[dict]:
            """Register as the rogue listing SHARDS; the controller's replies, up to its `registered`."""
            sock.send(protocol.encode("register", node_id="rogue", agent_version="t", engines={"sim": "1"},
                                      engines_probed=True, gpus=[], shards=[
                                          {"state": "ready", "engine": "sim", "profile_fp": fingerprint[s["model"]], **s}
                                          for s in shards]))
            replies = []
            while not replies or replies[-1]["type"] != "registered":
                assert sock.poll(30000), f"the controller did not answer the registration: {replies}"
                replies.append(protocol.decode(sock.recv()))
            return replies

        assert c.api("/api/v1/status")["adopting"]
        replies = register({"shard_id": "big-1", "model": "big", "url": "http://10.9.9.9:8000"},
                           {"shard_id": "big-2", "model": "big", "url": "http://127.0.0.1:8000"},
                           {"shard_id": "small-1", "model": "small", "url": "http://10.9.9.9:8000"},
                           # A rank of a replica over several nodes pointing the others at another machine; one
                           # whose id is not its group's; one without the seal of a rank placed there.
                           {"shard_id": "small-g-r0", "model": "small", "url": "http://127.0.0.1:8000",
                            "group": "small-g", "rank": 0, "ranks": 2, "master": "10.9.9.9:29500"},
                           {"shard_id": "small-3", "model": "small", "group": "small-g", "rank": 1, "ranks": 2},
                           {"shard_id": "small-h-r1", "model": "small", "group": "small-h", "rank": 1, "ranks": 2})
        assert c.replicas() == []
        assert sorted(r["shard_id"] for r in replies if r["type"] == "stop_shard") == [
            "big-1", "big-2", "small-1", "small-3", "small-g-r0", "small-h-r1"]
        log = c.log()
        assert "big could not have been placed there" in log and "is not on the node's own address" in log
        assert "the address its ranks meet at, 10.9.9.9:29500, is not on the node's own address" in log
        assert "small-3 does not read as rank 1 of 2 of the replica small-g" in log
        assert "small-h-r1 does not carry the seal of rank 1 of small-h on rogue" in log
        # Out of the window: a shard this controller did not place is refused, whatever it looks like.
        wait_until("the adoption window to close", 30, lambda: not c.api("/api/v1/status")["adopting"])
        replies = register({"shard_id": "small-2", "model": "small", "url": "http://127.0.0.1:8000"})
        assert c.replicas() == [] and [r["shard_id"] for r in replies if r["type"] == "stop_shard"] == ["small-2"]
        assert "this controller did not place small-2" in c.log()
        assert 'llmgw_agent_messages_refused_total{why="not_its_own"} 7.0' in c.metrics()
    finally:
        sock.close(0)
        context.term()
        c.stop()
