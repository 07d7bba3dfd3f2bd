"""The accountant on the wire: one thread, one ZeroMQ ROUTER, every gateway worker a DEALER.

One thread owns the `Accountant`, so every admit and settle is applied in the
order it arrives and no lock is needed: two workers asking for the last slot
of a limit are answered one after the other. Messages are JSON:

    admit   {"op": "admit", "id": N, "levels": [[counter, rpm, tpm, budget, period], ...],
             "priced": bool, "tokens": estimate, "cost": estimated micro-units}
            -> {"id": N, "ok": true, "r": reservation, "status": {...}}
             | {"id": N, "ok": false, "limit": "rpm", "counter": ..., "retry_after": s, "message": ...}
    settle  {"op": "settle", "r": reservation, "tokens": n, "cost": micro-units, "budgets": [[counter, period]]}
            (no answer)
    status  {"op": "status", "id": N, "levels": [...]} -> {"id": N, "status": {...}}

The controller runs it (`controller.accountant_listen`); a gateway without a
controller runs its own in the gunicorn master, so its workers still share one.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import zmq

from llmgw.control.accountant import Accountant, Refused
from llmgw.control.curvekeys import serve_curve

log = logging.getLogger("llmgw.accountserver")

SWEEP_EVERY = 60.0


def _status(accountant: Accountant, levels) -> dict:
    return {name: list(pair) for name, pair in accountant.status(levels).items()}


def handle(accountant: Accountant, msg: dict) -> dict | None:
    """The answer to MSG, or None when it needs none (or cannot be read)."""
    op = msg.get("op")
    if op == "settle":
        accountant.settle(int(msg["r"]), int(msg.get("tokens") or 0), int(msg.get("cost") or 0), msg.get("budgets"))
        return None
    if op == "admit":
        levels = msg["levels"]
        result = accountant.admit(levels, bool(msg.get("priced")), int(msg.get("tokens") or 0),
                                  int(msg.get("cost") or 0))
        if isinstance(result, Refused):
            return {"id": msg["id"], "ok": False, "limit": result.limit, "counter": result.counter,
                    "retry_after": result.retry_after, "message": result.message,
                    "status": _status(accountant, levels)}
        return {"id": msg["id"], "ok": True, "r": result.id, "status": _status(accountant, levels)}
    if op == "status":
        return {"id": msg["id"], "status": _status(accountant, msg["levels"])}
    return None


class AccountServer:
    """The accountant's thread. `start()` binds (so the port is known at once) and serves until `stop()`."""

    def __init__(self, accountant: Accountant, listen: str, context: zmq.Context | None = None,
                 curve: tuple | None = None):
        """CONTEXT is the caller's (whose authenticator admits gateway keys); CURVE is (keypair, domain), or
        None for plaintext."""
        self.accountant = accountant
        self.own_context = context is None
        self.context = context or zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            serve_curve(self.socket, *curve)
        host, _, port = listen.rpartition(":")
        host = host or "*"
        if port in ("", "0"):
            self.port = self.socket.bind_to_random_port(f"tcp://{host}")
        else:
            self.socket.bind(f"tcp://{host}:{port}")
            self.port = int(port)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="accountant", daemon=True)

    def start(self) -> "AccountServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.socket.close(0)
        if self.own_context:
            self.context.destroy(linger=0)

    def _serve(self) -> None:
        sock = self.socket
        swept = time.monotonic()
        while not self.stopping.is_set():
            if sock.poll(200):
                while True:
                    try:
                        identity, payload = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except ValueError:
                        continue  # not two frames: not one of ours
                    try:
                        answer = handle(self.accountant, json.loads(payload))
                    except (ValueError, KeyError, TypeError) as e:
                        log.warning("ignored a message the accountant cannot read: %s", e)
                        continue
                    if answer is not None:
                        sock.send_multipart([identity, json.dumps(answer).encode()])
            if time.monotonic() - swept > SWEEP_EVERY:
                swept = time.monotonic()
                if self.accountant.forget_stale():
                    log.info("forgot reservations never settled (their gateway went away)")
