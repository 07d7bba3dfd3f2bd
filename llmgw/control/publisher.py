"""Telling gateways where each model can be served: the routing snapshot, pushed over ZeroMQ PUB.

The whole snapshot (the catalog's names, aliases and limits, and the ready
replicas with their addresses) goes out whenever it changes and again every
`REPEAT` seconds. Sending it whole, and repeating it, is what makes PUB/SUB
safe here: a gateway that joined late, or missed a message across a restart,
is right again within seconds, with no request for a full copy.

Each controller start begins a new epoch; within it, versions only grow. The
socket is CURVE: a gateway subscribes with its issued key and believes only a
publisher holding the controller's secret key, so a process that binds the
port while the controller restarts is never heard (it once was, and every
gateway sent its traffic to the forger until restarted).
"""

from __future__ import annotations

import json
import os
import time

import zmq

from llmgw.control.catalog import Model
from llmgw.control.curvekeys import serve_curve
from llmgw.control.reconciler import Replica
from llmgw.wire.snapshot import TOPIC

REPEAT = 2.0


def snapshot_body(models: dict[str, Model], replicas: list[Replica], demand_port: int | None = None,
                  accountant_port: int | None = None) -> dict:
    ready = sorted((r for r in replicas if r.state == "ready" and r.url and r.model in models),
                   key=lambda r: r.shard_id)
    weights = {}
    for name, model in models.items():
        for profile in model.profiles:
            weights[(name, model.fingerprint(profile))] = profile.weight
    return {
        "models": [{"name": m.name, "aliases": list(m.aliases), "description": m.description,
                    "max_context": m.max_context, "max_output": m.max_output, "on_demand": m.min_replicas == 0}
                   for m in sorted(models.values(), key=lambda m: m.name)],
        "demand_port": demand_port,
        "accountant_port": accountant_port,
        "replicas": [{"id": r.shard_id, "url": r.url, "models": [r.model],
                      "weight": weights.get((r.model, r.profile_fp), 1.0)} for r in ready],
    }


class Publisher:
    def __init__(self, context: zmq.Context, listen: str, curve: tuple | None = None):
        """CURVE is (keypair, domain): only gateways holding an issued key may subscribe, and a gateway
        believes only a publisher that holds the controller's secret key. None: plaintext."""
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            serve_curve(self.socket, *curve)
        host, _, port = listen.rpartition(":")
        self.socket.bind(f"tcp://{host or '*'}:{port}")
        self.last_body: dict | None = None
        # A new epoch for each controller start: a gateway takes the first snapshot of a new epoch whatever
        # its version (the new controller's clock may be behind), and within an epoch only newer versions.
        self.epoch = os.urandom(8).hex()
        self.version = 0
        self.sent_at = 0.0

    def publish(self, body: dict) -> None:
        """Send BODY if it changed, or if the last send is REPEAT seconds old."""
        now = time.monotonic()
        if body == self.last_body and now - self.sent_at < REPEAT:
            return
        if body != self.last_body:
            self.version = max(self.version + 1, int(time.time() * 1000))
            self.last_body = body
        self.socket.send_multipart([TOPIC, json.dumps({"epoch": self.epoch, "version": self.version, **body}).encode()])
        self.sent_at = now

    def close(self) -> None:
        self.socket.close(0)
