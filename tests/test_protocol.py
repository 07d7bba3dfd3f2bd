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
    # Bytes are read as json.loads reads them (the one decoder every message shares): a UTF-8 byte-order
    # mark or UTF-16 is taken, as it always was.
    raw = accounting.encode("admit", id=1, levels=[level], priced=True, tokens=5, cost=9)
    assert accounting.decode(b"\xef\xbb\xbf" + raw) == accounting.decode(raw.decode().encode("utf-16")) == admit


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


def test_what_this_machines_agent_finds_passes_the_deep_shapes():
    from llmgw.node import discovery
    cpu = discovery.CpuSampler()
    cpu.percent()
    register = dict(node_id="n1", agent_version="0.1", cpu=discovery.cpu_facts(), memory=discovery.memory_facts(),
                    disk=discovery.disk_facts("/"), labels={"rack": "r1", "row": 3, "spare": True},
                    engines={"sim": "0.1"}, installable={"vllm": "0.6"},
                    installs={"vllm/0.6": {"state": "installing", "bytes_done": 5, "bytes_total": 9}},
                    doctor={"failures": [], "warnings": [{"level": "warning", "area": "cpu", "message": "m", "fix": ""}]},
                    weights={"bytes": 1, "entries": 1, "fetched_bytes": 0},
                    shards=[{"node_id": "n1", "shard_id": "m-1", "state": "ready", "gpus": [0], "ready_s": 1.5,
                             "fetch": {"source": "http://m/x", "bytes_done": 3}}],
                    **discovery.gpu_facts())
    assert protocol.decode(protocol.encode("register", **register))["cpu"] == register["cpu"]
    load = {**discovery.load_facts(), "cpu_percent": cpu.percent() or 0.0,
            "shards": [{"shard_id": "m-1", "memory_rss_bytes": 1, "cpu_cores": 0.5, "waiting": 0.0, "kv_cache": 0.2}]}
    protocol.decode(protocol.encode("heartbeat", node_id="n1", seq=1, load=load, memory=register["memory"],
                                    gpus=[{"index": 0, "memory_used_bytes": 0, "utilization_percent": 3.0}]))


def beat(**fields) -> bytes:
    return json.dumps({"v": 1, "type": "heartbeat", "node_id": "n", "seq": 1, **fields}).encode()


@pytest.mark.parametrize("data, words", [
    (beat(disk={"free_bytes": "q"}), r"heartbeat.disk.free_bytes must be an int from 0"),
    (beat(disk={"free_bytes": -1}), r"heartbeat.disk.free_bytes must be an int from 0"),
    (beat(memory={"total_bytes": 10**30}), r"heartbeat.memory.total_bytes must be an int from 0"),
    (beat(load={"load1": "1.0"}), r"heartbeat.load.load1 must be a number from 0"),
    (beat(load={"cpu_percent": 1e6}), r"heartbeat.load.cpu_percent must be a number from 0 to 100"),
    (beat(load={"shards": [{"cpu_cores": True}]}), r"heartbeat.load.shards\[0\].cpu_cores must be a number"),
    (beat(gpus=[{"index": "0"}]), r"heartbeat.gpus\[0\].index must be an int"),
    (beat(gpus=[{"index": 0}] * 1025), r"heartbeat.gpus must be an array of at most 1024 items"),
    (beat(gpus=[{"index": 0, "health": "x" * 65}]), r"heartbeat.gpus\[0\].health must be a string of at most 64"),
    (beat(engines={"sim": 1}), r"heartbeat.engines\['sim'\] must be a string"),
    (beat(engines={f"e{i}": "1" for i in range(65)}), "heartbeat.engines must be an object of at most 64 entries"),
    (beat(engines={"x" * 201: "1"}), "heartbeat.engines key 'xxx"),
    (beat(installs={"vllm/1": {"bytes_done": "lots"}}), r"heartbeat.installs\['vllm/1'\].bytes_done must be an int"),
    (beat(weights={"bytes": 1.5}), "heartbeat.weights.bytes must be an int"),
    # A node's fabric facts, which placement groups nodes by and the pages show (issue 28).
    (beat(ib_ports=[{"hca": "mlx5_0"}]), r"heartbeat.ib_ports\[0\] without port"),
    (beat(ib_ports=[{"hca": "mlx5_0", "port": 1}] * 257), "heartbeat.ib_ports must be an array of at most 256"),
    (beat(ib_ports=[{"hca": "mlx5_0", "port": 1, "rate_gbps": -4}]), r"ib_ports\[0\].rate_gbps must be a number"),
    (beat(ib_ports=[{"hca": "m", "port": 1, "counters": {"symbol_error": "many"}}]),
     r"ib_ports\[0\].counters\['symbol_error'\] must be an int"),
    (beat(ib_ports=[{"hca": "m", "port": 1, "subnet_managers": [{"guid": "0x1", "priority": 99}]}]),
     r"subnet_managers\[0\].priority must be an int from 0 to 15"),
    (beat(fabrics=[{"adapters": ["mlx5_0"]}]), r"heartbeat.fabrics\[0\] without name"),
    (beat(ib_ports=[{"hca": "m", "port": 1, "subnet_managers": [{"state": "master"}]}]),
     r"subnet_managers\[0\] without guid"),
    (beat(fabrics=[{"name": "x" * 65}]), r"heartbeat.fabrics\[0\].name must be a string of at most 64"),
    (beat(fabrics_changed="yes"), "heartbeat.fabrics_changed must be"),
    (beat(gpus=[{"index": 0, "nvlink": {"1": "NV18"}}]), r"heartbeat.gpus\[0\].nvlink\['1'\] must be an int"),
    (beat(gpus=[{"index": 0, "nvlink_domain": "u" * 201}]), r"gpus\[0\].nvlink_domain must be a string"),
    (b'{"v": 1, "type": "fabric_test_reply", "node_id": "n", "request_id": "r", "gbps": -1}',
     "fabric_test_reply.gbps must be a number from 0"),
    (json.dumps({"v": 1, "type": "fabric_test_reply", "node_id": "n", "request_id": "r", "output": "x" * 20001}).encode(),
     "fabric_test_reply.output must be a string of at most 20000"),
    (b'{"v": 1, "type": "register", "node_id": "n", "agent_version": "x", "labels": {"rack": [1]}}',
     r"register.labels\['rack'\] must be a string .* or must be a number .* or must be bool"),
    (b'{"v": 1, "type": "register", "node_id": "n", "agent_version": "x", "cpu": {"count": 0}}',
     "register.cpu.count must be an int from 1"),
    (b'{"v": 1, "type": "register", "node_id": "n", "agent_version": "x", "doctor": {"failures": [{}]}}',
     r"register.doctor.failures\[0\] without message"),
    (b'{"v": 1, "type": "register", "node_id": "n", "agent_version": "x", "shards": [{"shard_id": "s"}]}',
     r"register.shards\[0\] without state"),
    (b'{"v": 1, "type": "shard_status", "node_id": "n", "shard_id": "s", "state": "ready", "ready_s": -1}',
     "shard_status.ready_s must be a number from 0"),
    (beat(load={"load1": 1.0}).replace(b"1.0", b"NaN"), "NaN is not a number JSON has"),
    (beat(load={"load1": 1.0}).replace(b"1.0", b"-Infinity"), "-Infinity is not a number JSON has"),
    (beat(later=json.loads("[" * 17 + "]" * 17)), "nested more than 16 levels deep"),
    (beat(later="x" * protocol.LARGEST), "more than the 16777216 any message here takes"),
])
def test_a_nodes_facts_are_checked_all_the_way_down(data, words):
    with pytest.raises(protocol.ProtocolError, match=words):
        protocol.decode(data)


def test_facts_a_newer_agent_adds_inside_an_object_are_let_by():
    message = protocol.decode(beat(disk={"free_bytes": 1, "inodes_free": 7}, gpus=[{"index": 0, "fan": "loud"}]))
    assert message["disk"]["inodes_free"] == 7 and message["gpus"][0]["fan"] == "loud"


@pytest.mark.parametrize("channel, data", [
    (accounting, b'{"v": 1, "op": "settle", "r": 1, "tokens": 1, "cost": NaN}'),
    (gateways, b'{"v": 1, "type": "demand", "model": "m", "at": Infinity}'),
])
def test_no_channel_reads_nan_or_infinity(channel, data):
    with pytest.raises(channel.ProtocolError, match="is not a number JSON has"):
        channel.decode(data)


def test_the_bounded_shapes():
    from llmgw.wire.schema import Either, MapOf, Num, ProtocolError, Str, check
    for good in (0, 0.5, 10):
        check(good, Num(0, 10), "x")
    for bad in (-0.1, 10.5, float("nan"), float("inf"), True, "1", None):
        with pytest.raises(ProtocolError, match="x must be a number from 0 to 10"):
            check(bad, Num(0, 10), "x")
    check({"a": 1}, MapOf(Str(1), Num(0, 1), 1), "m")
    for bad, words in (({"a": 1, "b": 1}, "at most 1 entries"), ({"ab": 1}, "m key 'ab'"), ([], "must be an object"),
                       ({"a": 2}, r"m\['a'\] must be a number")):
        with pytest.raises(ProtocolError, match=words):
            check(bad, MapOf(Str(1), Num(0, 1), 1), "m")
    check("s", Either((Num(0, 1), Str(1))), "e")
    with pytest.raises(ProtocolError, match="e must be a number .* or must be a string"):
        check([], Either((Num(0, 1), Str(1))), "e")
