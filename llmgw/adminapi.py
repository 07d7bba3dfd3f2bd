"""The controller's admin API, which `llmgw ctl` speaks: JSON under /api/v1, on loopback by default.

It can issue node keys, so it is never opened to the network by default;
anyone who can reach it can make a node. Errors are `{"error": "..."}` with a
sentence that says what to do.
"""

from __future__ import annotations

import re
import time

from flask import Flask, jsonify, request
from sqlalchemy.engine import Engine

from llmgw import __version__, curvekeys, store
from llmgw.agentserver import KeyRing
from llmgw.fleet import STATES, Fleet, FleetError

NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def create_app(fleet: Fleet, engine: Engine, ring: KeyRing | None, controller_public: bytes | None,
               plaintext: bool) -> Flask:
    app = Flask("llmgw.admin")

    def error(status: int, message: str):
        return jsonify({"error": message}), status

    @app.errorhandler(FleetError)
    def fleet_error(e):
        return error(409, str(e))

    @app.get("/api/v1/status")
    def status():
        nodes = fleet.describe(time.monotonic())
        counts = {state: sum(1 for n in nodes if n["state"] == state) for state in STATES}
        return jsonify({"version": __version__, "plaintext": plaintext, "nodes": counts})

    @app.get("/api/v1/nodes")
    def nodes():
        return jsonify({"nodes": fleet.describe(time.monotonic())})

    @app.post("/api/v1/nodes/<node_id>/cordon")
    def cordon(node_id):
        fleet.set_cordon(node_id, True)
        _remember_cordon(engine, node_id, True)
        return jsonify({"node_id": node_id, "cordoned": True})

    @app.post("/api/v1/nodes/<node_id>/uncordon")
    def uncordon(node_id):
        fleet.set_cordon(node_id, False)
        _remember_cordon(engine, node_id, False)
        return jsonify({"node_id": node_id, "cordoned": False})

    @app.delete("/api/v1/nodes/<node_id>")
    def remove(node_id):
        fleet.remove(node_id, time.monotonic())
        return jsonify({"node_id": node_id, "removed": True})

    @app.post("/api/v1/node-keys")
    def issue_key():
        body = request.get_json(silent=True) or {}
        node_id = body.get("node_id")
        if not isinstance(node_id, str) or not NODE_ID.match(node_id):
            return error(400, "node_id must be a name of letters, digits, '.', '_' or '-', such as gpu-01")
        if ring is None:
            return error(409, "this controller runs with controller.plaintext: agents use no keys")
        public, secret = curvekeys.issue_node_key(engine, node_id)
        ring.replace(curvekeys.authorised_keys(engine))
        return jsonify({"node_id": node_id, "key_file": curvekeys.node_key_file(node_id, public, secret,
                                                                                 controller_public)})

    return app


def _remember_cordon(engine: Engine, node_id: str, cordoned: bool) -> None:
    with engine.begin() as conn:
        conn.execute(store.node_settings.delete().where(store.node_settings.c.node_id == node_id))
        conn.execute(store.node_settings.insert().values(node_id=node_id, cordoned=cordoned, updated_at=time.time()))


def cordoned_nodes(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        rows = conn.execute(store.node_settings.select().where(store.node_settings.c.cordoned.is_(True))).all()
    return {row.node_id for row in rows}
