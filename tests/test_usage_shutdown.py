"""A gateway whose store cannot be written when it stops: its usage rows are spooled, never lost.

PostgreSQL is reached through a relay in this process that the tests can make
hang (connections held open, nothing passed), which is how a dead store looks
from a gateway: neither an error nor an answer.
"""

import contextlib
import json
import os
import signal
import socket
import threading
import time

import sqlalchemy as sa

from llmgw import store
from llmgw.gateway import server, worker
from tests.conftest import count_usage, make_key, open_stream, post, read_until, store_url_for, wait_until, wipe

CHAT = {"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": "hello"}]}
REQUESTS = 10


class Relay:
    """A TCP relay to HOST:PORT on a free loopback port; `hang()` stops it passing anything, `flow()` resumes."""

    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.closed = False
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def hang(self) -> None:
        self.flowing.clear()

    def flow(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self.closed = True
        self.listener.close()
        for sock in self.sockets:
            _end(sock)
        self.flowing.set()  # lets the pumps find their sockets closed and end

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        self.flowing.wait()
        if self.closed:  # accepted while hung, and the relay closed since: nothing to open upstream
            client.close()
            return
        upstream = socket.create_connection(self.target)
        self.sockets += [client, upstream]
        threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
        self._pump(client, upstream)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self.flowing.wait()
                sink.sendall(data)
        except OSError:
            pass
        finally:
            # One side ended: end both, so the pump the other way, waiting in recv, ends too.
            _end(source)
            _end(sink)


def _end(sock: socket.socket) -> None:
    """Shut SOCK down, then close it. Closed alone while the other pump's thread waits in recv on it, a socket
    stays connected: PostgreSQL kept the gateway's transaction behind it open, holding its tables against a later
    test's DROP (tests/conftest.py wipe). It happened twice: once when the relay closed the sockets, once when a
    pump did, on its side's end, under the other pump's recv."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def serve(make_gateway, make_sim, url: str, spool, flush_interval=60.0, workers=2) -> object:
    sim = make_sim(replica="s")
    return make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=workers,
                        usage__flush_interval=flush_interval, usage__spool_dir=str(spool))


def send(gw, key: str) -> None:
    for _ in range(REQUESTS):
        assert post(gw.url + "/v1/chat/completions", CHAT, key)[0] == 200


def spooled_rows(spool) -> list[dict]:
    files = [spool / name for name in os.listdir(spool)]
    assert all(os.stat(f).st_mode & 0o777 == 0o600 for f in files)
    return [json.loads(line) for f in files for line in f.read_text().splitlines()]


def move_usage_table(url: str, old: str, new: str) -> None:
    engine = store.open_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {old} RENAME TO {new}"))
    engine.dispose()


def test_rows_the_store_will_not_take_at_a_stop_are_spooled_and_written_by_the_next_start(
        store_url, tmp_path, make_gateway, make_sim):
    spool = tmp_path / "spool"
    key = make_key(store_url)
    gw = serve(make_gateway, make_sim, store_url, spool)
    send(gw, key)
    # A worker may have written some already (its first flush, or a worker replaced on a loaded machine writes
    # what it holds as it goes): those are in the store. The rest must all be in the spool: none lost.
    written = count_usage(store_url)
    # The store can no longer take usage rows (as a full disk or a read-only file would have it; as root,
    # file modes stop nothing, so the table goes away instead).
    move_usage_table(store_url, "usage", "usage_away")
    try:
        assert gw.stop(signal.SIGTERM) == 0
    finally:
        move_usage_table(store_url, "usage_away", "usage")  # a table left behind would break the next wipe
    assert written < REQUESTS and len(spooled_rows(spool)) == REQUESTS - written
    assert "they are in" in gw.log()
    serve(make_gateway, make_sim, store_url, spool)
    # The file goes once its rows are committed: wait for both.
    wait_until("the spooled rows in the store, and the spool emptied", 30,
               lambda: count_usage(store_url) == REQUESTS and os.listdir(spool) == [])


def test_a_hung_store_holds_up_no_stop_and_loses_no_row(pg_url, tmp_path, make_gateway, make_sim):
    wipe(pg_url)
    direct = sa.engine.make_url(pg_url)
    relay = Relay(direct.host, direct.port or 5432)
    try:
        url = store_url_for(direct.set(port=relay.port).render_as_string(hide_password=False))
        spool = tmp_path / "spool"
        key = make_key(url)
        # One worker, known to be serving once /health answers: a worker still loading the app when the store
        # hangs blocks in its first read of the keys, before its database calls are made cooperative.
        gw = serve(make_gateway, make_sim, url, spool, flush_interval=0.2, workers=1)
        send(gw, key)
        wait_until("the first rows in the store", 30, lambda: count_usage(store_url_for(pg_url)) == REQUESTS)
        # Hung now: the flusher is stuck in a write when the stop comes.
        relay.hang()
        send(gw, key)
        started = time.monotonic()
        assert gw.stop(signal.SIGTERM, timeout=60) == 0
        took = time.monotonic() - started
        # Up to 1 s to notice, 2 s to stop the greenlets, CLOSE_WRITE_LIMIT to try the store, and room for a
        # loaded machine (17.9 s was seen under four busy processes); a worker held by the store is killed at
        # graceful_timeout instead, and its rows are lost, which the spool's count below would show.
        assert took < 3 + worker.CLOSE_WRITE_LIMIT + 20, f"the stop took {took:.1f} s:\n{gw.log()[-4000:]}"
        assert len(spooled_rows(spool)) == REQUESTS
        relay.flow()
        serve(make_gateway, make_sim, url, spool)
        wait_until("the spooled rows in the store, and the spool emptied", 30,
                   lambda: count_usage(store_url_for(pg_url)) == 2 * REQUESTS and os.listdir(spool) == [])
    finally:
        relay.close()


def test_the_master_waits_for_a_stopping_worker_to_write_its_usage():
    # The worker drains for gateway.graceful_timeout, then stops its greenlets (2 s) and writes its usage.
    assert server.USAGE_CLOSE_MARGIN >= 1 + 1 + 2 + worker.CLOSE_WRITE_LIMIT


def test_a_stopping_worker_drains_for_the_gateways_graceful_timeout_then_writes_its_streams_row(
        tmp_path, make_gateway, make_sim):
    # The master waits USAGE_CLOSE_MARGIN longer than its workers drain. A worker that read gunicorn's settings
    # before its start hook set its own graceful_timeout drained for the master's, and was killed before it
    # wrote the row of the stream it was still serving.
    url = f"sqlite:///{tmp_path}/gateway.db"
    key = make_key(url)
    sim = make_sim(replica="s", ttft_ms=1, tokens_per_s=2, default_tokens=400)  # a stream of 200 s
    gw = make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=1,
                      gateway__graceful_timeout=1)
    with open_stream(gw.port, key, {**CHAT, "max_tokens": 400}) as client:
        read_until(client, lambda received: b"tok0" in received)
        started = time.monotonic()
        assert gw.stop(signal.SIGTERM, timeout=60) == 0
        took = time.monotonic() - started
    assert count_usage(url) == 1, gw.log()[-4000:]
    assert took < 1 + server.USAGE_CLOSE_MARGIN, f"the stop took {took:.1f} s"
