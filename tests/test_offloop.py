"""A gateway worker on SQLite serves on while its store work waits (llmgw/gateway/offloop.py)."""

import os
import signal
import sqlite3
import time

from llmgw import filemodes
from llmgw.gateway import worker
from llmgw.procs import http_status
from tests.conftest import count_usage, make_key, post, wait_until

CHAT = {"model": "sim", "max_tokens": 1, "messages": [{"role": "user", "content": "hello"}]}
REQUESTS = 5


def test_a_usage_flush_held_up_by_a_locked_store_stalls_no_request(tmp_path, make_gateway, make_sim):
    url = f"sqlite:///{tmp_path}/store.db"
    key = make_key(url)
    sim = make_sim(replica="s")
    gw = make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=1,
                      usage__flush_interval=0.2)
    # Another process writing: the worker's next flush waits for the lock (up to SQLite's busy timeout).
    holder = sqlite3.connect(filemodes.sqlite_path(url), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        assert post(gw.url + "/v1/chat/completions", CHAT, key)[0] == 200  # a row for the flush to write
        slowest = 0.0
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            started = time.monotonic()
            # On the loop, the flush held the worker for as long as the lock: no answer within 2 s.
            assert http_status(gw.url + "/health") == 200, "/health went unanswered while a flush waited"
            slowest = max(slowest, time.monotonic() - started)
        assert slowest < 0.2, f"/health took {slowest:.3f} s while a usage flush waited for the store"
        assert count_usage(url) == 0  # the flush was indeed waiting
    finally:
        holder.rollback()
        holder.close()
    wait_until("the row written once the store is free", 15, lambda: count_usage(url) == 1)


def test_a_stop_while_a_flush_waits_for_the_store_writes_each_row_once(tmp_path, make_gateway, make_sim):
    # The stop gives up waiting for the flush after CLOSE_WRITE_LIMIT, while the flush still runs in its thread:
    # the spool must wait for it, or the rows it commits would be spooled too and written again at the next start.
    # Each row is written once, in the end: by that flush, or from the spool by the next start.
    url = f"sqlite:///{tmp_path}/store.db"
    key = make_key(url)
    sim = make_sim(replica="s")
    spool = tmp_path / "spool"
    gw = make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=1,
                      usage__flush_interval=0.2, usage__spool_dir=str(spool))
    holder = sqlite3.connect(filemodes.sqlite_path(url), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        for _ in range(REQUESTS):
            assert post(gw.url + "/v1/chat/completions", CHAT, key)[0] == 200
        gw.proc.send_signal(signal.SIGTERM)
        # Held past the stop's own limit; SQLite's busy timeout (10 s) is still waiting then.
        until = time.monotonic() + worker.CLOSE_WRITE_LIMIT + 2
        while time.monotonic() < until:
            assert gw.proc.poll() is None, "the worker stopped before the store was free"
            time.sleep(0.1)
    finally:
        holder.rollback()
        holder.close()
    assert gw.stop() == 0
    # What the flush under way took was committed once the store was free; a flush writes only what was buffered
    # when it began, so the rows that came after it were spooled, not written twice: the next start writes them.
    spooled = sum(len((spool / name).read_text().splitlines()) for name in os.listdir(spool)) if spool.exists() else 0
    assert count_usage(url) + spooled == REQUESTS
    again = make_gateway(store_url=url, endpoints=[{"id": "s", "url": sim.url, "models": ["sim"]}], workers=1,
                         usage__flush_interval=0.2, usage__spool_dir=str(spool))
    wait_until("the spooled rows written by the next start", 30, lambda: not spool.exists() or os.listdir(spool) == [])
    assert again.stop() == 0
    assert count_usage(url) == REQUESTS
