"""The fabrics and NVLink domains, for administrators: `/admin/fabrics` and `/admin/nvlink`.

What the controller's admin API says (`/api/v1/fabrics`, `/api/v1/nvlink`; llmgw/control/fabricview.py):
each physical fabric with the names it is declared under, its subnet managers and their standbys, its
nodes with their adapters, rate and degraded ports, and the declared fabrics a node cannot use; each
NVLink domain with each node's cards and IMEX. The cluster page links here when the cluster has any.
"""

from __future__ import annotations

from flask import Blueprint, render_template

from llmgw.apiclient import ApiError
from llmgw.web.adminpages import admin_only
from llmgw.web.nodepages import admin

bp = Blueprint("fabrics", __name__)


@bp.get("/admin/fabrics")
@admin_only
def fabrics_page():
    try:
        answer = admin().call("GET", "/api/v1/fabrics", timeout=2)
        view = {"fabrics": answer["fabrics"], "problems": answer["problems"], "problem": None}
    except (ApiError, KeyError) as e:
        view = {"fabrics": [], "problems": [], "problem": f"The fabrics cannot be shown: {e}"}
    return render_template("admin_fabrics.html", **view)


@bp.get("/admin/nvlink")
@admin_only
def nvlink_page():
    try:
        view = {"domains": admin().call("GET", "/api/v1/nvlink", timeout=2)["domains"], "problem": None}
    except (ApiError, KeyError) as e:
        view = {"domains": [], "problem": f"The NVLink domains cannot be shown: {e}"}
    return render_template("admin_nvlink.html", **view)
