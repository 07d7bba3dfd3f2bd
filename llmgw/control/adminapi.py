"""The controller's admin API, which `llmgw ctl` speaks: JSON under /api/v1, on loopback by default.

It can issue node keys, so it is never opened to the network by default, and
even on loopback it answers only requests that carry its token
(`Authorization: Bearer`, the token the controller keeps in `admin.token`
beside its CURVE keys) and name one of its own addresses in `Host`: a web page
in an operator's browser reaches loopback too, by DNS rebinding, but knows
neither. Errors are `{"error": "..."}` with a sentence that says what to do.

The routes are three blueprints: models and replicas (llmgw/control/adminmodels.py); nodes, their
logs, weights and keys (llmgw/control/adminnodes.py); fabrics and NVLink domains
(llmgw/control/adminfabrics.py). What they act on, the controller's parts, is
handed to `create_app` as one `Parts` and kept on the app, as Flask's own extensions keep theirs.
"""

from __future__ import annotations

import dataclasses
import os

from flask import Flask, request

from llmgw import apiguard, settings
from llmgw.control import adminfabrics, adminmodels, adminnodes
from llmgw.control.adminparts import Parts, error, parts
from llmgw.control.capacity import CapacityError
from llmgw.control.catalog import CatalogError
from llmgw.control.fleet import FleetError


def ensure_token(keys_dir: str) -> str:
    """The admin API's token, made on first use and kept in KEYS_DIR/admin.token (apiguard.ensure_token)."""
    return apiguard.ensure_token(apiguard.token_path(keys_dir))


@dataclasses.dataclass(frozen=True)
class Access:
    """Who the admin API answers: requests with TOKEN (kept in TOKEN_FILE) that name an allowed Host."""

    token: str
    token_file: str
    hosts: apiguard.HostCheck

    @classmethod
    def from_config(cls, cfg: settings.Config) -> "Access":
        """The token (made on the first start) and the Host names from CFG."""
        return cls(ensure_token(cfg["controller.keys_dir"]),
                   os.path.abspath(apiguard.token_path(cfg["controller.keys_dir"])),
                   apiguard.HostCheck(cfg["controller.admin_listen"], cfg["controller.admin_names"],
                                      "controller.admin_names"))


def create_app(held: Parts) -> Flask:
    app = Flask("llmgw.admin")
    app.extensions["llmgw"] = held
    app.before_request(_admitted)
    app.register_error_handler(FleetError, lambda e: error(409, str(e)))
    app.register_error_handler(CatalogError, lambda e: error(400, str(e)))
    app.register_error_handler(CapacityError, lambda e: error(400, str(e)))
    app.register_blueprint(adminmodels.bp)
    app.register_blueprint(adminnodes.bp)
    app.register_blueprint(adminfabrics.bp)
    return app


def _admitted():
    """Before every route: the Host must be ours, and the token right; a standby answers its status only."""
    # The Host first: a request by a name that is not ours is refused whatever it carries, a right token too.
    ours = parts()
    access, lease = ours.access, ours.lease
    refused = access.hosts.refusal(request.headers.get("Host"))
    if refused:
        return error(421, refused)
    if apiguard.bearer_matches(request.headers.get("Authorization"), access.token):
        if lease is None or request.path == "/api/v1/status" or lease.held():
            return None
        # A standby knows no node or replica, and a change made here would be lost on the leader's next pass.
        return error(503, f"this controller stands by; the leader is {lease.leader or 'not known yet'} (where "
                          "its agents connect): run llmgw ctl against the leader's admin API")
    if request.headers.get("Authorization"):
        message = (f"that is not this controller's admin token: use the one in {access.token_file} (on another "
                   "machine, set controller.admin_token = \"@/path/to/a/copy\" of it; it changes when the "
                   "file is removed and the controller restarts)")
    else:
        message = (f"the admin API wants its token: send Authorization: Bearer TOKEN. The controller keeps it in "
                   f"{access.token_file} (mode 0600), where llmgw ctl and the gateway's pages on its machine read "
                   "it; elsewhere, set controller.admin_token = \"@/path/to/a/copy\"")
    body, status = error(401, message)
    body.headers["WWW-Authenticate"] = 'Bearer realm="llmgw admin API"'
    return body, status
