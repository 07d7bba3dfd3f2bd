"""PostgreSQL goes away and comes back: every role serves what it can meanwhile and catches up after.

Each test runs a PostgreSQL server of its own (tests/pgserver.py), stops it, and starts it again: a gateway
goes on routing with the keys it holds and buffers its usage rows, then writes every one; a controller
stops acting when it can no longer renew its lease, and leads again, with the node's engine untouched.
"""

import pytest

from llmgw.procs import wait_for
from tests.cluster import Agent, Controller
from tests.conftest import count_usage, make_key, post
from tests.pgserver import OwnPostgres

WAIT = 60.0
CHAT = {"model": "sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def own_pg():
    pg = OwnPostgres()
    yield pg
    pg.close()


def pending_rows(gw) -> float:
    return gw.metric_total("llmgw_usage_rows_pending")


def test_a_gateway_serves_through_a_store_outage_and_writes_every_row_when_it_returns(own_pg, make_sim, make_gateway):
    sim = make_sim(tokens_per_s=0, ttft_ms=0, default_tokens=2)
    key = make_key(own_pg.url)
    gw = make_gateway(store_url=own_pg.url, endpoints=[{"id": "sim-1", "url": sim.url, "models": ["sim"]}],
                      workers=2)
    url = gw.url + "/v1/chat/completions"
    assert [post(url, CHAT, key)[0] for _ in range(10)] == [200] * 10
    wait_for("the first rows written", WAIT, lambda: count_usage(own_pg.url) == 10)

    own_pg.stop()
    # Keys are in memory and nothing on the request path reads the store: every request is served.
    assert [post(url, CHAT, key)[0] for _ in range(20)] == [200] * 20
    wait_for("the rows waiting in the workers", WAIT, lambda: pending_rows(gw) == 20)

    own_pg.start()
    wait_for("every row written once the store is back", WAIT, lambda: count_usage(own_pg.url) == 30)
    wait_for("nothing left waiting", WAIT, lambda: pending_rows(gw) == 0)


def sim_model():
    return {"name": "simmy", "source": "/dev/null", "scaling": {"min": 1, "max": 1},
            "profiles": [{"engine": "sim", "args": ["--ttft-ms", "5", "--tokens-per-s", "0"]}]}


def test_a_controller_that_loses_its_store_stops_acting_and_leads_again_when_it_returns(tmp_path, own_pg):
    c = Controller(tmp_path, store_url=own_pg.url, models=[sim_model()], controller__lease_ttl=3.0,
                   controller__lease_renew_interval=0.3)
    n1 = None
    try:
        n1 = Agent(tmp_path, [f"127.0.0.1:{c.agent_port}"], "n1", c.issue_key("n1"))
        wait_for("one replica ready", WAIT, lambda: len(c.ready("simmy")) == 1)
        shard, engines = c.ready("simmy")[0]["shard_id"], n1.engines()

        own_pg.stop()
        # It leads until its lease would have run out in the store, then stands by: nothing it does now
        # could be checked against another controller's.
        wait_for("the controller stands by", WAIT, lambda: c.api("/api/v1/status")["role"] == "standby")
        assert "cannot renew the leader lease" in c.log()
        assert n1.engines() == engines  # standing by stops nothing on the nodes

        own_pg.start()
        wait_for("the controller leads again", WAIT, lambda: c.api("/api/v1/status")["role"] == "leader")
        wait_for("the replica known again", WAIT, lambda: [r["shard_id"] for r in c.ready("simmy")] == [shard])
        assert n1.engines() == engines  # the same engine: nothing was restarted
    finally:
        if n1 is not None:
            n1.stop()
        c.stop()



def handshakes(port: int, server_public: bytes, keypair: tuple[bytes, bytes], context, wait: float) -> str | None:
    """"ok" or "refused" for a CURVE handshake with KEYPAIR at PORT (a SUB, as a gateway dials snapshots), or
    None when neither came within WAIT seconds."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    sock = context.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, *keypair
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        if not monitor.poll(int(wait * 1000)):
            return None
        event = recv_monitor_message(monitor)["event"]
        return "ok" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "refused"
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def test_a_store_that_hangs_holds_up_no_handshake_of_a_known_key(tmp_path, own_pg):
    import tomllib

    import zmq

    from llmgw import keyfiles

    c = Controller(tmp_path, store_url=own_pg.url)
    context = zmq.Context()
    try:
        with open(c.gateway_key_file("known"), "rb") as f:
            known = tomllib.load(f)
        server = keyfiles.controller_keypair(c.values["controller.keys_dir"])[0]
        keypair = (known["public_key"].encode(), known["secret_key"].encode())
        assert handshakes(c.gateway_port, server, keypair, context, WAIT) == "ok"

        own_pg.pause()
        # An unknown key makes the ring ask the store, which hangs; the ZAP handler answers one handshake at
        # a time, and every handshake after it, a known key's too, waited for the store.
        stranger = handshakes(c.gateway_port, server, zmq.curve_keypair(), context, 10.0)
        assert stranger in ("refused", None)
        assert handshakes(c.gateway_port, server, keypair, context, 10.0) == "ok"
        assert handshakes(c.gateway_port, server, zmq.curve_keypair(), context, 10.0) == "refused"  # at once
        wait_for("the warning", WAIT, lambda: "the store did not answer within 0.5 s" in c.log())
        own_pg.resume()
        assert handshakes(c.gateway_port, server, keypair, context, WAIT) == "ok"
    finally:
        own_pg.resume()
        context.term()
        c.stop()
