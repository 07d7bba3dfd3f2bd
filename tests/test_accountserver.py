"""The accountant's socket against whatever a peer may send: nothing malformed stops it, and no peer settles
what another admitted, twice, or below zero."""

import json

import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest

from llmgw.control.accountant import Accountant
from llmgw.control.accountserver import AccountServer
from llmgw.procs import wait_for
from llmgw.wire import accounting

WAIT = 30.0  # seconds: generous, for a loaded machine


@pytest.fixture
def server():
    server = AccountServer(Accountant(), "127.0.0.1:0").start()
    yield server
    server.stop()


@pytest.fixture
def dealer(server):
    context = zmq.Context()
    made = []

    def connect():
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(WAIT * 1000))
        sock.connect(f"tcp://127.0.0.1:{server.port}")
        made.append(sock)
        return sock

    yield connect
    for sock in made:
        sock.close(0)
    context.term()


def ask(sock, op, **fields) -> dict:
    sock.send(accounting.encode(op, **fields))
    return accounting.decode(sock.recv())


def message(**fields) -> bytes:
    return json.dumps(fields).encode()


LEVEL = ["key:k", 100, 1000, 1000, "month"]
ADMIT = {"v": 1, "op": "admit", "id": 1, "levels": [LEVEL], "priced": True, "tokens": 10, "cost": 10}


def admit_with(**changed) -> bytes:
    return json.dumps({**ADMIT, **changed}).encode()


def level_with(i, value) -> bytes:
    level = list(LEVEL)
    level[i] = value
    return admit_with(levels=[level])


MALFORMED = [
    b"[", b"", b"null", b"[]", b"42", b'"admit"', b"\xff\xfe{}", b"[" * 100_000, b"{" * 100_000,
    b'{"op":"settle"}', b'{"op":"admit","levels":"x"}', message(op="settle", r=1, tokens=-5, cost=-10**9),
    message(v=1, op="settle", r=1, tokens=-5, cost=-10**9), b'{"v":1,"op":"settle","r":1,"tokens":' + b"9" * 5000 + b',"cost":1}',
    b'{"v":1,"op":"settle","r":1,"tokens":1e400,"cost":1}', admit_with(pad="x" * 70_000),
    admit_with(op="teleport"), admit_with(op=["admit"]), admit_with(op=None), admit_with(op="admitted"),
    admit_with(op="status_reply"), admit_with(v=None), admit_with(v="1"), admit_with(v=2), admit_with(v=True),
    admit_with(v=1.0), admit_with(id=None), admit_with(id=-1), admit_with(id="1"), admit_with(id=2**60),
    admit_with(id=True), admit_with(levels="x"), admit_with(levels=[LEVEL] * 65), admit_with(levels=[LEVEL[:4]]),
    admit_with(levels=[LEVEL + [1]]), admit_with(levels=[{"counter": "key:k"}]), level_with(0, 5),
    level_with(0, "k" * 1000), level_with(1, "ten"), level_with(1, -1), level_with(2, 1.5), level_with(3, True),
    level_with(3, 10**30), level_with(4, "week"), level_with(4, None), admit_with(priced="yes"),
    admit_with(tokens=-1), admit_with(tokens=10**10), admit_with(cost=-1), admit_with(cost=10**16),
    message(v=1, op="status", levels="x"), message(v=1, op="status", levels=[]),
    message(v=1, op="settle", r="1", tokens=1, cost=1), message(v=1, op="settle", r=None, tokens=1, cost=1),
    message(v=1, op="settle", r=1, tokens=1.5, cost=1),
]


def test_fifty_malformed_frames_are_dropped_and_counted_and_the_next_admit_is_answered(server, dealer):
    assert len(set(MALFORMED)) == len(MALFORMED) >= 50
    sock = dealer()
    for frame in MALFORMED:
        sock.send(frame)
    sock.send_multipart([b"two", b"frames"])  # the ROUTER sees three
    wait_for("every malformed frame counted", WAIT, lambda: server.dropped["malformed"] == len(MALFORMED) + 1)
    answer = ask(sock, "admit", id=7, levels=[LEVEL], priced=True, tokens=10, cost=10)
    assert answer["op"] == "admitted" and answer["id"] == 7 and answer["ok"] and answer["r"] >= 1
    assert server.thread.is_alive() and server.dropped == {"malformed": len(MALFORMED) + 1, "settle": 0, "error": 0,
                                                             "standby": 0}
    registry = CollectorRegistry()
    registry.register(server)
    assert f'llmgw_accountant_dropped_messages_total{{why="malformed"}} {len(MALFORMED) + 1}.0' in \
        generate_latest(registry).decode()


def test_an_unforeseen_failure_is_logged_and_counted_and_the_thread_serves_on(server, dealer, caplog):
    real = server.accountant.status
    server.accountant.status = lambda levels: 1 / 0
    sock = dealer()
    sock.send(accounting.encode("status", id=1, levels=[]))
    # the thread counts before it logs, so wait for the line itself rather than read it as the count moves
    wait_for("the failure counted and logged", WAIT,
             lambda: server.dropped["error"] == 1 and "ZeroDivisionError" in caplog.text)
    server.accountant.status = real
    assert ask(sock, "status", id=2, levels=[LEVEL]) == {"v": 1, "op": "status_reply", "id": 2,
                                                         "status": {"rpm": [100, 100], "tpm": [1000, 1000],
                                                                    "budget": [1000, 1000]}}


def test_a_budget_cannot_be_refunded_nor_another_gateways_request_settled(server, dealer):
    first, second = dealer(), dealer()
    spent = server.accountant.spent
    r = ask(first, "admit", id=1, levels=[LEVEL], priced=True, tokens=10, cost=900)["r"]
    first.send(accounting.encode("settle", r=r, tokens=10, cost=900))
    ask(first, "status", id=2, levels=[])  # one DEALER's messages are taken in order: the settle is done
    assert spent("key:k", "month") == 900

    # A negative settle would hand the budget back; it is not even a message.
    r = ask(first, "admit", id=3, levels=[LEVEL], priced=True, tokens=10, cost=50)["r"]
    first.send(message(v=1, op="settle", r=r, tokens=0, cost=-900))
    wait_for("the negative settle dropped", WAIT, lambda: server.dropped["malformed"] == 1)
    # Another connection cannot settle it, at any price, nor can anyone settle it twice.
    second.send(accounting.encode("settle", r=r, tokens=0, cost=0))
    wait_for("the foreign settle refused", WAIT, lambda: server.dropped["settle"] == 1)
    assert spent("key:k", "month") == 900 and server.accountant.reserved  # still held for the first
    first.send(accounting.encode("settle", r=r, tokens=10, cost=50))
    first.send(accounting.encode("settle", r=r, tokens=10, cost=50))
    wait_for("the second settle refused", WAIT, lambda: server.dropped["settle"] == 2)
    assert spent("key:k", "month") == 950 and not server.accountant.reserved
    refused = ask(second, "admit", id=4, levels=[["key:k", None, None, 950, "month"]], priced=True, tokens=1, cost=1)
    assert refused["op"] == "refused" and refused["limit"] == "budget" and refused["ok"] is False
