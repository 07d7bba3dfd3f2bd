"""The mirror's administration page: what it holds and is fetching, fetch, retry, remove, serve this,
and an explorer of the configured registry.

The page speaks to the mirror's management API (`mirror.api`, with the token
in `mirror.token_file`) and, for what the catalog uses and to add a model, to
the controller's admin API (`gateway.controller_admin`). An unreachable mirror
or catalog is said outright, never shown as an empty table. The page refreshes
itself only while something downloads, so a half-typed form is not lost
otherwise.

"Serve this" fills a form from the file: a name, the mirror URL as source,
the engine (llama.cpp for GGUF, vLLM otherwise), memory estimated from the
size, and a run mode: always on (min 1), on demand (min 0, max 1) or
stopped (max 0). Registry listings come from a Hugging Face compatible API
(`mirror.hf_endpoint`); model cards are rendered like chat answers (raw HTML
dropped, images not loaded, only safe links). A mirror or registry that does
not answer is said in a sentence with what to check, never as urllib's error.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request

from flask import Blueprint, abort, flash, redirect, render_template, request

from llmgw.apiclient import ApiClient, ApiError, Unreachable, leader_client, mirror_client
from llmgw.units import human_bytes
from llmgw.web import forms, registryview, safety
from llmgw.web.adminpages import admin_only, require_token
from llmgw.web.chatpage import render_markdown
from llmgw.web.site import Site, site

REGISTRY_TIMEOUT = 10
LARGEST_FILE = 1 << 50  # a PiB: "serve this" estimates memory from a size, which must be a number of bytes


bp = Blueprint("mirror", __name__)


def mirror() -> ApiClient:
    return mirror_client(site().cfg)


def mirror_problem(e: ApiError) -> str:
    """What the page says when the mirror cannot be used: the mirror's own sentence when it refused."""
    if isinstance(e, Unreachable):
        return (f"The mirror at {site().cfg['mirror.api']} cannot be reached. Check that mirror.py is running on "
                "that machine and listening there (its mirror.api_listen), and that mirror.api on this "
                "gateway names that address.")
    return Site.sentence(e)


def controller() -> ApiClient:
    return leader_client(site().cfg, site().cfg["gateway.controller_admin"])


def catalog() -> tuple[list[dict] | None, str | None]:
    try:
        return controller().call("GET", "/api/v1/models", timeout=3)["models"], None
    except Unreachable:
        return None, (f"the controller's admin API at {' or '.join(site().cfg['gateway.controller_admin'])} cannot be "
                      "reached: check "
                      "that the controller runs and that gateway.controller_admin names its admin_listen")
    except ApiError as e:
        return None, str(e)


@bp.get("/admin/mirror")
@admin_only
def mirror_page():
    if not site().cfg["mirror.api"]:
        return render_template("message.html", title="No mirror",
                               text="No mirror is configured here (mirror.api)."), 404
    problem = None
    try:
        found = mirror().call("GET", "/api/v1/models", timeout=3)
    except ApiError as e:
        found, problem = None, mirror_problem(e)
    models, catalog_problem = catalog()
    rows = []
    if found is not None:
        for v in found["held"]:
            prefix = f"{found['base_url']}/{v['model']}/{v['version']}/"
            users = [m for m in models or [] if any(s.startswith(prefix) for s in m["sources"])]
            rows.append({**v, "used_by": [m["name"] for m in users],
                         "runs": [(m["name"], run_mode(m), m.get("origin") == "runtime") for m in users],
                         "source": prefix + v["files"][0]["name"] if len(v["files"]) == 1 else prefix})
    busy = {v["model"] for v in (found or {}).get("arriving", []) + (found or {}).get("failed", [])}
    template = "_mirror.html" if request.args.get("partial") else "admin_mirror.html"
    return render_template(template, found=found, rows=rows, groups=grouped(rows, busy), problem=problem,
                           catalog_problem=catalog_problem,
                           action=site().form(forms.ActionForm), registry=bool(site().cfg["mirror.hf_endpoint"]))


def family(model: str) -> str:
    """The family a model's name says it is of: its leading letters (qwen2.5-coder-7b and qwen3-8b: qwen)."""
    found = re.match(r"[A-Za-z]+", model)
    return found.group(0).lower() if found else model


def grouped(rows: list[dict], busy: set[str]) -> list[dict]:
    """The held versions ROWS by model, and models by family: [{"family" (None for a family of one model),
    "models": [{"model", "rows", "bytes", "in_use", "busy"}], "bytes", "busy"}]. Models with a download or a
    failure (BUSY) come first, in their family and among families; then by name."""
    models: dict[str, list[dict]] = {}
    for row in rows:
        models.setdefault(row["model"], []).append(row)
    families: dict[str, list[dict]] = {}
    for name, versions in models.items():
        families.setdefault(family(name), []).append({
            "model": name, "rows": versions, "bytes": sum(v["bytes"] for v in versions),
            "in_use": any(v["used_by"] for v in versions), "busy": name in busy})
    out = []
    for name, members in families.items():
        members.sort(key=lambda m: (not m["busy"], m["model"]))
        out.append({"family": name if len(members) > 1 else None, "models": members,
                    "bytes": sum(m["bytes"] for m in members), "busy": any(m["busy"] for m in members)})
    out.sort(key=lambda f: (not f["busy"], f["family"] or f["models"][0]["model"]))
    return out


def run_mode(model: dict) -> str:
    """How a catalog model runs, as the serve form's choices name it: always (min >= 1), on demand
    (min 0, max >= 1) or stopped (max 0)."""
    scaling = model.get("scaling") or {}
    if scaling.get("max") == 0:
        return "stopped"
    return "always" if (scaling.get("min") or 0) >= 1 else "on_demand"


@bp.post("/admin/mirror/runs")
@admin_only
def mirror_runs():
    """A model served from the mirror set to run always, on demand, or not at all (`llmgw ctl scale`)."""
    require_token()
    name, mode = request.form.get("model", ""), request.form.get("mode", "")
    if mode not in forms.RUN_MODES or not name:
        flash("Choose always on, on demand or stopped for a model of the catalog.", "problem")
        return redirect("/admin/mirror")
    try:
        controller().call("POST", f"/api/v1/models/{urllib.parse.quote(name, safe='')}/scale", forms.RUN_MODES[mode])
        flash(f"{name} runs {RUN_WORDS[mode]} now.", "done")
    except ApiError as e:
        flash(Site.sentence(e), "problem")
    return redirect("/admin/mirror")


RUN_WORDS = {"always": "always", "on_demand": "on demand", "stopped": "no more: it is stopped"}


@bp.post("/admin/mirror/fetch")
@admin_only
def mirror_fetch():
    require_token()
    f = request.form
    try:
        started = mirror().call("POST", "/api/v1/models", {"source": f.get("source", "").strip(),
                                                           "model": f.get("model", "").strip(),
                                                           "version": f.get("version", "").strip(),
                                                           "anyway": bool(f.get("anyway"))})
        # The source as the mirror shows it: a password in it must not travel in the session cookie.
        flash(f"Fetching {started['source']} into {started['model']}/{started['version']}.", "done")
    except ApiError as e:
        flash(mirror_problem(e), "problem")
    return redirect("/admin/mirror")


@bp.post("/admin/mirror/remove")
@admin_only
def mirror_remove():
    require_token()
    model, version = request.form.get("model", ""), request.form.get("version", "")
    try:
        mirror().call("DELETE", f"/api/v1/models/{urllib.parse.quote(model)}/{urllib.parse.quote(version)}")
        flash(f"Removed {model}/{version}.", "done")
    except ApiError as e:
        flash(mirror_problem(e), "problem")
    return redirect("/admin/mirror")


@bp.route("/admin/mirror/serve", methods=["GET", "POST"])
@admin_only
def mirror_serve():
    if request.method == "GET":
        size = _size(request.args.get("size"))
        source = request.args.get("source", "")
        gguf = source.endswith(".gguf") or "gguf" in source.lower()
        memory = estimate(size)
        suggested = {"name": request.args.get("model", ""), "source": source,
                     "engine": "llamacpp" if gguf else "vllm", "memory": "" if memory is None else memory,
                     "max_context": 4096}
        return render_template("mirror_serve.html", s=suggested, action=site().form(forms.ActionForm),
                               engines=forms.ENGINES, warnings=fleet_warnings(memory, gguf))
    require_token()
    f = site().form(forms.ServeForm, request.form)
    if not f.validate():
        # The first thing wrong, in a sentence; nothing is sent to the controller.
        flash(next(e for errors in f.errors.values() for e in errors), "problem")
        return redirect(safety.back("/admin/mirror"))
    table = {"name": f.name.data.strip(), "source": f.source.data.strip(), "max_context": int(f.max_context.data),
             "scaling": forms.RUN_MODES[f.mode.data],
             "profiles": [{"engine": f.engine.data, "min_memory_gb": float(f.memory.data)}]}
    try:
        controller().call("POST", "/api/v1/models", table)
        flash(f"{table['name']} is in the catalog ({f.mode.data.replace('_', ' ')}).", "done")
    except ApiError as e:
        flash(Site.sentence(e), "problem")
        return redirect(safety.back("/admin/mirror"))
    return redirect("/admin/mirror")


@bp.get("/admin/mirror/registry")
@admin_only
def registry():
    filters = registryview.Filters(request.args)
    answer, problem = _registry(site().cfg, filters.query())
    now = datetime.datetime.now(datetime.timezone.utc)
    repos = [registryview.describe(r, now) for r in answer if isinstance(r, dict)] if isinstance(answer, list) else []
    shown, hidden = registryview.keep(repos, filters)
    everything = "?" + urllib.parse.urlencode({**request.args.to_dict(), "show": "all"})
    return render_template("mirror_registry.html", repos=shown, hidden=hidden, problem=problem, f=filters,
                           view=registryview, everything=everything)


@bp.get("/admin/mirror/repo")
@admin_only
def repo():
    repo_id = request.args.get("id", "")
    if repo_id.count("/") != 1 or any(c in repo_id for c in " ?#\\"):
        abort(404)
    info, problem = _registry(site().cfg, f"/api/models/{repo_id}?blobs=true")
    card = None
    if info:
        sha = info.get("sha") or "main"
        text, _ = _registry(site().cfg, f"/{repo_id}/raw/{sha}/README.md", raw=True)
        card = render_markdown(_strip_front_matter(text)) if text else None
    files = registryview.weight_files((info or {}).get("siblings"), (info or {}).get("sha"))
    return render_template("mirror_repo.html", repo_id=repo_id, info=info, problem=problem, card=card,
                           files=files, action=site().form(forms.ActionForm))


def estimate(size: int) -> int | None:
    """GiB a replica of weights of SIZE bytes needs, as a rule of thumb the form lets one change: the
    weights and half again (the context's cache, the engine's buffers), plus 2 GiB for the engine itself.
    None where the size is not known: a blank field, not a floor of 2 that looks like an estimate."""
    return math.ceil(size * 1.5 / (1 << 30) + 2) if size else None


def fleet_warnings(memory: int | None, gguf: bool) -> list[str]:
    """What the fleet says against serving it: more memory than any node has, or safetensors where no node
    has a GPU or vLLM. Nothing where the controller does not answer (the form still works)."""
    try:
        nodes = controller().call("GET", "/api/v1/nodes", timeout=3)["nodes"]
    except ApiError:
        return []
    if not nodes:
        return []
    said = []

    def room(node: dict) -> int:
        facts, status = node.get("facts") or {}, node.get("status") or {}
        cards = sum(g.get("memory_total_bytes") or 0 for g in facts.get("gpus") or [] if isinstance(g, dict))
        ram = ((status.get("memory") or facts.get("memory") or {}).get("total_bytes")) or 0
        return max(cards, ram) if isinstance(ram, int) else cards

    largest = max(nodes, key=room)
    if memory is not None and memory * (1 << 30) > room(largest):
        said.append(f"No node has {memory} GiB: the largest, {largest.get('node_id')}, has "
                    f"{human_bytes(room(largest))}. Serve a smaller quantisation, or add a larger node.")
    if not gguf:
        gpus = any((n.get("facts") or {}).get("gpus") for n in nodes)
        vllm = any("vllm" in ((n.get("status") or {}).get("engines") or (n.get("facts") or {}).get("engines") or {})
                   or "vllm" in ((n.get("facts") or {}).get("installable") or {}) for n in nodes)
        if not (gpus and vllm):
            said.append("These weights are safetensors, which vLLM or SGLang serve on GPUs, and no node has "
                        + ("a GPU" if not gpus else "vLLM (installed, or in its engine catalogue)")
                        + ": serve a GGUF of the model instead, which llama.cpp runs on CPUs.")
    return said


def _size(text: str | None) -> int:
    """The `size` a "serve this" link carries, in bytes; 400 for anything else (it was a 500)."""
    try:
        size = int(text or 0)
    except ValueError:
        size = -1
    if not 0 <= size < LARGEST_FILE:
        abort(400, "The size in this link is not a number of bytes; open Serve this from the mirror page again.")
    return size


# The registry's answers, kept REGISTRY_KEPT seconds by each worker: browsing goes back and forth over the
# same listings, and a registry that rate-limits (Hugging Face's does) must not be asked for each. A fetch
# stays exact: it is pinned to the commit the page showed.
REGISTRY_KEPT = 600.0
REGISTRY_KEPT_MOST = 256
_answers: dict[tuple[str, str, bool], tuple[float, object]] = {}


def _registry(cfg, path: str, raw: bool = False):
    """(answer, problem) from the registry: JSON, or text when RAW; an answer asked for within
    REGISTRY_KEPT seconds is the one given then."""
    endpoint = cfg["mirror.hf_endpoint"]
    kept = _answers.get((endpoint, path, raw))
    if kept is not None and time.monotonic() < kept[0]:
        return kept[1], None
    try:
        with urllib.request.urlopen(endpoint.rstrip("/") + path, timeout=REGISTRY_TIMEOUT) as resp:
            body = resp.read(4 << 20)
        answer = body.decode("utf-8", "replace") if raw else json.loads(body)
        if len(_answers) >= REGISTRY_KEPT_MOST:
            _answers.pop(next(iter(_answers)))  # the oldest asked
        _answers[(endpoint, path, raw)] = (time.monotonic() + REGISTRY_KEPT, answer)
        return answer, None
    except urllib.error.HTTPError as e:
        e.close()
        return None, f"The registry at {endpoint} answered {e.code} {e.reason}."
    except OSError:
        return None, (f"The registry at {endpoint} cannot be reached from this gateway. Check that this machine "
                      "reaches it (its DNS, a proxy, a firewall), or set mirror.hf_endpoint to a registry it can "
                      "reach, such as an internal mirror of it.")
    except ValueError:
        return None, f"The registry at {endpoint} answered something that is not its API; check mirror.hf_endpoint."


def _strip_front_matter(text: str) -> str:
    if text.startswith("---"):
        end = text.find("\n---", 3)
        if end != -1:
            return text[end + 4:]
    return text
