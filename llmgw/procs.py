"""Small helpers for starting processes and waiting on them: a free port, `wait_for`, an HTTP probe."""

from __future__ import annotations

import resource
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


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit; returns the limit now in force.

    Every open stream holds two sockets in a gateway worker (client and
    engine), so the common default of 1024 caps a worker near 500 streams.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft
