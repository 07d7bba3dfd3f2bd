import json

import pytest

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


def test_every_message_is_documented():
    with open("docs/protocol.md", encoding="utf-8") as f:
        doc = f.read()
    for kind, fields in protocol.MESSAGES.items():
        assert f"### `{kind}`" in doc, kind
        for field in fields:
            assert f"`{field}`" in doc, f"{kind}.{field}"
