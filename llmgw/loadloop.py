"""Closed-loop load: a fixed number of clients, each sending its next request as soon as its last is answered.

Closed loop rather than a fixed arrival rate, because what is measured is how
a server behaves with N requests in flight: by Little's law the requests a
second are then N over the mean latency, and nothing piles up unseen in the
client. Used by `bench/loadgen.py` (under gevent's monkey-patching, where the
threads are greenlets) and by `llmgw ctl bench` (plain threads, each with its
own connection).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def closed_loop(concurrency: int, one: Callable[[], bool]) -> float:
    """Run CONCURRENCY clients, each calling ONE() again as soon as it returns, until it returns False;
    the seconds until the last client stopped. ONE does its own counting, under a lock of its own where
    its clients are threads."""
    def client() -> None:
        while one():
            pass

    started = time.perf_counter()
    threads = [threading.Thread(target=client, name=f"load-{i}", daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def percentile(values, p: float):
    """The P-th percentile of VALUES by nearest rank (one of the values themselves); None for none."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]
