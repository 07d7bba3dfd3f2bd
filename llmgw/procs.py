"""Small helpers for starting processes and waiting on them: a free port, `wait_for`, an HTTP probe."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status URL answers with, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        e.close()
        return e.code
    except (OSError, ValueError):
        return None


def wait_for(what: str, limit: float, done, alive=lambda: True, interval: float = 0.1) -> None:
    """Poll DONE until it is true; raise TimeoutError naming WHAT after LIMIT seconds,
    or RuntimeError as soon as ALIVE says the process it waits on has died."""
    deadline = time.monotonic() + limit
    while True:
        if done():
            return
        if not alive():
            raise RuntimeError(f"{what}: the process exited before it was ready")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"gave up waiting for {what} after {limit:.0f} s")
        time.sleep(interval)
