"""The admin API's fabrics and NVLink domains (llmgw/control/fabricview.py): what `/admin/fabrics`,
`/admin/nvlink` and scripts read; each fabric's map (llmgw/control/fabricmaps.py); and a fabric test between
two nodes (llmgw/control/fabrictest.py)."""

from __future__ import annotations

import time

from flask import Blueprint, jsonify, request

from llmgw.control import fabrictest, fabricview
from llmgw.control.adminnodes import NODE_ID
from llmgw.control.adminparts import error, parts

DEFAULT_SECONDS, MOST_SECONDS = 3, 30

bp = Blueprint("fabrics", __name__)


@bp.get("/api/v1/fabrics")
def fabrics():
    nodes = parts().fleet.describe(time.monotonic())
    return jsonify({"fabrics": fabricview.fabrics(nodes), "problems": fabricview.problems(nodes)})


@bp.get("/api/v1/fabrics/<path:fabric_id>/topology")
def topology(fabric_id):
    """FABRIC_ID's last map (its leaf switches, the hosts on each), scanned now where it has none."""
    ours = parts()
    if ours.maps is None:
        return error(404, "this controller keeps no fabric maps")
    if ours.maps.get(fabric_id) is None:
        ours.maps.scan(ours.fleet.describe(time.monotonic()), ours.ask_node, fabric_id=fabric_id)
    found = ours.maps.get(fabric_id)
    if found is None:
        return error(404, f"no ready node with an active port on fabric {fabric_id!r} scans fabrics; "
                          "`GET /api/v1/fabrics` lists the fabrics and their nodes")
    if "error" in found:
        return error(502, f"fabric {fabric_id} could not be mapped: {found['error']}")
    return jsonify({"fabric": fabric_id, "scanned_at": found["at"], "by": found["node"], **found["map"]})


@bp.get("/api/v1/nvlink")
def nvlink():
    return jsonify({"domains": fabricview.nvlink(parts().fleet.describe(time.monotonic()))})


@bp.post("/api/v1/fabric-test")
def fabric_test():
    """Body: {a, b, fabric (optional), seconds (1-30, default 3)}. Answers when every rail was tested: for
    a fabric of eight rails at 30 s, several minutes."""
    body = request.get_json(silent=True)
    if not isinstance(body, dict) or not all(isinstance(body.get(k), str) and NODE_ID.match(body[k]) for k in "ab"):
        return error(400, "send {\"a\": NODE, \"b\": NODE}: the two nodes to test between, as `llmgw ctl nodes` names them")
    if body["a"] == body["b"]:
        return error(400, "a fabric test runs between two nodes: name two")
    seconds = body.get("seconds", DEFAULT_SECONDS)
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not 1 <= seconds <= MOST_SECONDS:
        return error(400, f"seconds is how long each rail is tested, 1 to {MOST_SECONDS}")
    fabric = body.get("fabric")
    if fabric is not None and (not isinstance(fabric, str) or not 0 < len(fabric) <= 64):
        return error(400, "fabric is the name a node declares it under ([[fabrics]])")
    ours = parts()
    try:
        result = fabrictest.run(ours.fleet.describe(time.monotonic()), body["a"], body["b"], fabric, seconds,
                                ours.ask_node)
    except fabrictest.TestRefused as e:
        return error(409, str(e))
    return jsonify(result)
