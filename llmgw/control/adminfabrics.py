"""The admin API's fabrics and NVLink domains (llmgw/control/fabricview.py): what `/admin/fabrics`,
`/admin/nvlink` and scripts read."""

from __future__ import annotations

import time

from flask import Blueprint, jsonify

from llmgw.control import fabricview
from llmgw.control.adminparts import parts

bp = Blueprint("fabrics", __name__)


@bp.get("/api/v1/fabrics")
def fabrics():
    nodes = parts().fleet.describe(time.monotonic())
    return jsonify({"fabrics": fabricview.fabrics(nodes), "problems": fabricview.problems(nodes)})


@bp.get("/api/v1/nvlink")
def nvlink():
    return jsonify({"domains": fabricview.nvlink(parts().fleet.describe(time.monotonic()))})
