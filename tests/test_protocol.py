import json

import pytest

from llmgw.wire import accounting, gateways
from llmgw.wire import agent as protocol


def test_round_trip_leaves_absent_fields_absent():
    data = protocol.encode("register", node_id="n1", agent_version="0.1", gpus=None, labels={"rack": "r1"})
    message = protocol.decode(data)
    assert message["v"] == protocol.VERSION and message["labels"] == {"rack": "r1"}
    assert "gpus" not in message  # not known is not "no GPUs"


def test_unknown_fields_from_a_newer_peer_are_kept_and_ignored():
    data = json.dumps({"v": 7, "type": "heartbeat", "node_id": "n1", "seq": 3, "quantum_flux": 1}).encode()
    assert protocol.decode(data)["quantum_flux"] == 1


@pytest.mark.parametrize("data, words", [
    (b"{", "not JSON"),
    (b"[]", "not a JSON object"),
    (b'{"v": 1, "type": "teleport"}', "unknown message type"),
    (b'{"type": "heartbeat", "node_id": "n", "seq": 1}', "no protocol version"),
    (b'{"v": 1, "type": "heartbeat", "node_id": "n"}', "heartbeat without seq"),
    (b'{"v": 1, "type": "heartbeat", "node_id": "n", "seq": true}', "must be int, not a boolean"),
    (b'{"v": 1, "type": "register", "node_id": 5, "agent_version": "x"}', "register.node_id must be str"),
])
def test_bad_messages_are_refused_with_the_reason(data, words):
    with pytest.raises(protocol.ProtocolError, match=words):
        protocol.decode(data)


def test_an_accounting_message_is_checked_to_the_last_number():
    level = ["key:k", 10, None, 1000, "month"]
    admit = accounting.decode(accounting.encode("admit", id=1, levels=[level], priced=True, tokens=5, cost=9))
    assert admit["levels"] == [level] and admit["v"] == accounting.VERSION
    assert "r" not in accounting.decode(accounting.encode("admitted", id=1, ok=True, r=None, status={}))


@pytest.mark.parametrize("fields, words", [
    ({"v": 2}, "protocol version 2 is not one this peer reads"),
    ({"op": ["admit"]}, "unknown message type"),
    ({"levels": [["key:k", 10, None, 1000]]}, r"admit.levels\[0\] must be an array of 5 items"),
    ({"levels": [["key:k", 10, None, 1000, "week"]]}, r"admit.levels\[0\]\[4\] must be one of day, month"),
    ({"levels": [["key:k", -1, None, None, "day"]]}, r"admit.levels\[0\]\[1\] must be an int from 0"),
    ({"levels": [["key:k", None, None, None, "day"]] * 65}, "at most 64 items"),
    ({"tokens": 10**12}, "admit.tokens must be an int from 0 to"),
    ({"cost": -1}, "admit.cost must be an int from 0 to"),
    ({"priced": 1}, "admit.priced must be bool"),
])
def test_a_bad_accounting_message_is_refused_with_the_reason(fields, words):
    message = {"v": 1, "op": "admit", "id": 1, "levels": [], "priced": True, "tokens": 1, "cost": 1, **fields}
    with pytest.raises(accounting.ProtocolError, match=words):
        accounting.decode(json.dumps(message).encode())


def documented(title: str) -> str:
    """The part of docs/protocol.md under the first-level heading TITLE."""
    with open("docs/protocol.md", encoding="utf-8") as f:
        doc = f.read()
    parts = doc.split("\n# ")
    return next(part for part in parts if part.lstrip("# ").startswith(title))


@pytest.mark.parametrize("title, messages", [("The agent protocol", protocol.MESSAGES),
                                             ("The accountant protocol", accounting.MESSAGES),
                                             ("The gateway protocol", gateways.MESSAGES)])
def test_every_message_is_documented(title, messages):
    doc = documented(title)
    for kind, fields in messages.items():
        assert f"### `{kind}`" in doc, kind
        section = doc.split(f"### `{kind}`")[1].split("\n### ")[0]
        for field in fields:
            assert f"| `{field}` |" in section, f"{kind}.{field}"
    assert doc.count("\n### ") == len(messages), "a message documented that the schema does not have"


def test_a_gateway_message_is_checked_before_anything_acts_on_it():
    snapshot = gateways.encode("snapshot", epoch="e", version=1, models=[{"name": "m"}], replicas=[])
    assert gateways.decode(snapshot)["models"] == [{"name": "m"}]
    for bad, words in [({"type": "snapshot", "v": 2, "epoch": "e", "version": 1, "models": [], "replicas": []},
                        "version 2"),
                       ({"type": "snapshot", "v": 1, "epoch": "e", "version": -1, "models": [], "replicas": []},
                        "version must be an int"),
                       ({"type": "snapshot", "v": 1, "epoch": "e", "version": 1, "models": [{"aliases": []}],
                         "replicas": []}, "without name"),
                       ({"type": "demand", "v": 1, "model": ["x"]}, "model must be a string")]:
        with pytest.raises(gateways.ProtocolError, match=words):
            gateways.decode(json.dumps(bad).encode())


def test_a_gateway_of_the_first_version_never_hears_leading_and_a_new_one_keeps_its_replicas():
    import time

    import zmq

    from llmgw.control.publisher import Publisher
    from llmgw.gateway.follower import with_leader
    from llmgw.gateway.snapshot import ReplicaSpec, Snapshot
    from llmgw.procs import free_port

    context = zmq.Context()
    port = free_port()
    publisher = Publisher(context, f"127.0.0.1:{port}")
    old, new = context.socket(zmq.SUB), context.socket(zmq.SUB)
    try:
        for sock, topics in ((old, (gateways.SNAPSHOT, gateways.KEYS)),
                             (new, (gateways.SNAPSHOT, gateways.KEYS, gateways.LEADING))):
            sock.setsockopt(zmq.LINGER, 0)
            for topic in topics:  # what each version's follower subscribes to
                sock.setsockopt(zmq.SUBSCRIBE, topic)
            sock.connect(f"tcp://127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while not new.poll(100):  # a SUB hears only what is sent after it joined
            assert time.monotonic() < deadline
            publisher.leading_sent_at = 0.0
            publisher.publish_leading(7445, 7446)
        topic, body = new.recv_multipart()
        assert topic == gateways.LEADING
        assert not old.poll(500), "a gateway of the first version must not receive what it cannot read"
        message = gateways.decode(body)
        assert "replicas" not in message
        current = Snapshot(version=5, models={}, replicas={"r1": ReplicaSpec("r1", "http://10.0.0.9:8000", ("m",))},
                           demand="10.0.0.1:7445", accountant="10.0.0.1:7446", epoch="old")
        moved = with_leader(message, current, "10.0.0.2")
        assert (moved.demand, moved.accountant) == ("10.0.0.2:7445", "10.0.0.2:7446")
        assert (moved.replicas, moved.epoch, moved.version) == (current.replicas, "old", 5)
    finally:
        old.close(0)
        new.close(0)
        publisher.close()
        context.term()
