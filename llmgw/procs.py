"""Small helpers for starting processes and waiting on them: a free port, `wait_for`, an HTTP probe."""

from __future__ import annotations

import itertools
import random
import resource
import socket
import time
import urllib.error
import urllib.request

# Ports are handed out below the kernel's ephemeral range: a port bound there and let go can be taken as
# the local end of any outgoing connection before the server it was chosen for binds it (seen under load,
# as "Address already in use"). Each process walks the range from its own random start, so two processes
# choosing at once rarely meet, and one never hands the same port out twice in a row.
LOWEST_PORT = 10_000
_offsets = itertools.count(random.randrange(1 << 16))  # next() on a count is atomic: threads share it


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on HOST that nothing holds now and that no outgoing connection will be given."""
    span = _ephemeral_low() - LOWEST_PORT
    if span >= 1000:
        for _ in range(200):
            port = LOWEST_PORT + next(_offsets) % span
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # a machine whose ephemeral range leaves no room below it
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
