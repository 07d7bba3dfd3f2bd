"""What every route of the controller's admin API shares: the controller's parts it acts on, kept on the
app (llmgw/control/adminapi.py makes it), and how an error is answered.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flask import current_app, jsonify
from sqlalchemy.engine import Engine

from llmgw.control.authenticator import KeyRing
from llmgw.control.catalog import Catalog
from llmgw.control.fleet import Fleet
from llmgw.control.loop import ReconcileReport
from llmgw.control.reconciler import Replicas
from llmgw.egress import Egress


@dataclasses.dataclass
class Parts:
    """What the admin API reads and acts on: the controller's own objects, made by controller.py."""

    fleet: Fleet
    engine: Engine
    catalog: Catalog
    replicas: Replicas
    report: ReconcileReport  # what the reconcile passes found, and how to ask for one now
    ask_node: Callable[..., Any]  # (node_id, kind, fields, timeout): a node's reply, or None
    access: Any  # adminapi.Access: its token and the Host names it answers to
    egress: Egress  # where a model's source may be checked
    plaintext: bool
    ring: KeyRing | None  # the nodes' keys (None: plaintext)
    controller_public: bytes | None
    gateway_ring: KeyRing | None = None
    lease: Any = None  # llmgw/control/lease.py: a standby answers its status only
    scaler: Any = None  # llmgw/control/autoscale.py: what load scaling sees and decided
    maps: Any = None  # llmgw/control/fabricmaps.py: each fabric's last scan


def parts() -> Parts:
    """The Parts of the app serving this request."""
    return current_app.extensions["llmgw"]


def error(status: int, message: str):
    return jsonify({"error": message}), status
