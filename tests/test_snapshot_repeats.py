"""The routing snapshot at a fleet's size: made again only when something in it may have changed, repeated as the
same bytes, and a repeat a gateway holds dropped after its first bytes."""

import json
import threading

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import store
from llmgw.control import catalog
from llmgw.control.fleet import NodeView, node_facts
from llmgw.control.publisher import Publisher, snapshot_body
from llmgw.control.reconciler import Replicas, plan, whole
from llmgw.gateway.follower import follow
from llmgw.procs import free_port, wait_for
from llmgw.wire import gateways

GiB = 1024 ** 3


def body(**fields):
    return {"models": [], "demand_port": None, "accountant_port": None, "replicas": [], "unhealthy": [], **fields}


def test_only_the_controllers_own_beginning_is_read_short():
    message = gateways.encode("snapshot", epoch="e1", version=17, **body())
    assert gateways.snapshot_version(message) == ("e1", 17)
    assert gateways.snapshot_version(memoryview(message)) == ("e1", 17)
    reordered = json.dumps({"v": 1, "type": "snapshot", "version": 17, "epoch": "e1"}).encode()
    assert gateways.snapshot_version(reordered) is None  # read whole, as any other writer's
    assert gateways.snapshot_version(b'{"v":1,"type":"snapshot","epoch":"a\\"","version":9,') is None
    assert gateways.snapshot_version(message.replace(b'"v":1', b'"v":2')) is None
    assert gateways.snapshot_version(b"") is None


def test_a_held_snapshot_is_dropped_unread_and_a_newer_or_another_epochs_is_read():
    context = zmq.Context()
    port = free_port()
    pub = context.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    heard: list = []
    held = {"epoch": "e1", "version": 10}
    threading.Thread(target=follow, daemon=True,
                     args=([f"127.0.0.1:{port}"], None, lambda m, host: heard.append((m["epoch"], m["version"])),
                           None, None, context),
                     kwargs={"snapshot_held": lambda: (held["epoch"], held["version"])}).start()
    try:
        def send(epoch, version, payload=b""):
            pub.send_multipart([gateways.SNAPSHOT, payload or gateways.encode("snapshot", epoch=epoch,
                                                                              version=version, **body())])

        # A SUB hears only what is sent after it joined: send until the first newer snapshot arrives.
        wait_for("the follower to hear a newer snapshot", 30, lambda: send("e1", 11) or heard)
        send("e1", 10)  # the version held: dropped unread
        send("e1", 9)  # older: dropped unread too, as the worker would ignore it once read
        send("e2", 1)  # another epoch (a restarted controller): read, whatever its version
        # Unreadable beyond its first bytes, but held: never read, so never counted as broken.
        send("e1", 10, b'{"v":1,"type":"snapshot","epoch":"e1","version":10,' + b"x" * 100)
        send("e1", 12)
        wait_for("the next newer one", 30, lambda: heard[-1] == ("e1", 12))
        assert [h for h in heard if h != ("e1", 11)] == [("e2", 1), ("e1", 12)]
    finally:
        pub.close(0)  # the follower's thread runs on, daemon, its context left open for it


def test_a_repeat_is_the_same_bytes_and_a_change_a_new_version(monkeypatch):
    context = zmq.Context()
    publisher = Publisher(context, f"127.0.0.1:{free_port()}")
    sent = []
    monkeypatch.setattr(publisher.socket, "send_multipart", lambda frames: sent.append(frames[1]))
    try:
        publisher.repeat()  # nothing published yet: nothing to repeat
        publisher.publish(body())
        publisher.publish(body())  # unchanged and within REPEAT: nothing sent
        publisher.repeat()
        assert len(sent) == 1
        publisher.sent_at -= 60
        publisher.repeat()
        assert len(sent) == 2 and sent[1] is sent[0]  # the bytes sent before, not encoded again
        publisher.publish(body(demand_port=5))
        assert gateways.snapshot_version(sent[2])[1] > gateways.snapshot_version(sent[0])[1]
        # A new term: the same body again is sent newer, so a gateway that followed another leader meanwhile
        # (holding this epoch's last version, with the other's addresses) reads it.
        publisher.forget()
        publisher.publish(body(demand_port=5))
        assert gateways.snapshot_version(sent[3])[1] > gateways.snapshot_version(sent[2])[1]
    finally:
        publisher.close()
        context.term()


def _node(node_id):
    return NodeView(node_id, "ready", 0.0, 0.0, node_facts(
        {"engines": {"sim": "1"}, "engines_probed": True, "memory": {"total_bytes": 64 * GiB},
         "gpus": [{"index": i, "class": "h100-80g", "health": "ok"} for i in range(2)]}, {}))


STATES = ("starting", "fetching", "ready", "unhealthy", "failed", "stopped")


@pytest.fixture(scope="module")
def store_engine(tmp_path_factory):
    engine = store.open_store(f"sqlite:///{tmp_path_factory.mktemp('catalog')}/s.db")
    yield engine
    engine.dispose()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("report", "pass", "forget", "register", "add", "remove", "clear")),
                          st.integers(0, 7), st.sampled_from(STATES), st.integers(0, 2)), max_size=30))
def test_whatever_changes_a_replica_moves_the_revision_the_loop_reads(store_engine, steps):
    """The loop makes the snapshot again only when the catalog's or the replicas' revision moved: any step that
    changes the snapshot must move one of them."""
    with store.writing(store_engine) as conn:
        conn.execute(store.catalog_models.delete())
    cat = catalog.Catalog(store_engine, [])
    replicas = Replicas()
    nodes = [_node(f"n{i}") for i in range(3)]

    def model(i):
        return {"name": f"m{i}", "source": "/m.gguf", "scaling": {"min": 1, "max": 2},
                "profiles": [{"engine": "sim", "gpu_class": "h100-80g", "gpus": 1}]}

    def seen():
        return cat.revision, replicas.revision

    def made():
        return snapshot_body(cat.models(), whole(replicas.snapshot()), 1, 2, cat.limits())

    now = 0.0
    for kind, i, state, n in steps:
        before, revision = made(), seen()
        now += 1.0
        shards = sorted(replicas.items.values(), key=lambda r: r.shard_id)
        if kind == "report" and shards:
            r = shards[i % len(shards)]
            replicas.report(r.node_id, {"shard_id": r.shard_id, "model": r.model, "state": state,
                                        "url": f"http://127.0.0.1:{9000 + i}", "context": 100 * (i + 1)},
                            now, address="127.0.0.1")
        elif kind == "pass":
            plan(cat.models(), nodes, replicas, now)
        elif kind == "forget":
            replicas.forget_node(f"n{n}")
        elif kind == "register":
            replicas.registered(f"n{n}", [], now + 100, address="127.0.0.1")
        elif kind == "add":
            cat.add(model(i % 3))
        elif kind == "remove" and f"m{i % 3}" in cat.models():
            cat.remove(f"m{i % 3}")
        else:
            replicas.clear()
        if made() != before:
            assert seen() != revision, (kind, before, made())
