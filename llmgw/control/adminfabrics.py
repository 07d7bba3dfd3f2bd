"""The admin API's fabrics and NVLink domains (llmgw/control/fabricview.py): what `/admin/fabrics`,
`/admin/nvlink` and scripts read; and a fabric test between two nodes (llmgw/control/fabrictest.py)."""

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
