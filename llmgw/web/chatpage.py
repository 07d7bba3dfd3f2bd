"""The chat page: a signed-in person talks to any served model in the browser.

The page's requests go through the same `/v1` pipeline as an API client's,
as the person (no key): their limits apply, their use is recorded against
them ("session:<id>"), and a Stop in the browser closes the connection, which
stops the engine's work. Finished answers are rendered as Markdown here, on
the server, with raw HTML dropped, images not loaded and only http, https and
mailto links kept, so a model cannot put script or a tracking pixel into the
page.

Who is asking is read from the signed session cookie and its session record
in the store (one read by primary key: a session ended at sign-out or by an
administrator stops chatting at once), and the CSRF header; whether that
person is still active comes from the worker's key table. A chat spent against
a project (`X-Llmgw-Spend`, chosen on the page) costs one more read, of the
person's memberships, so that leaving a project ends chatting in it at once. `/v1` requests,
which carry keys, never read the store.
"""

from __future__ import annotations

import os
from html import escape

import flask_login
import sqlalchemy as sa
from flask import Blueprint, Flask, abort, render_template, request
from markdown_it import MarkdownIt
from werkzeug.datastructures import MultiDict

from llmgw import store
from llmgw.gateway.errors import ApiError
from llmgw.gateway.worker import Runtime
from llmgw.units import human_bytes
from llmgw.web import forms
from llmgw.web.site import site

MAX_RENDER = 200_000  # characters of Markdown rendered at once
# KaTeX where `make` put it (static/katex): without it, mathematics shows as the TeX the model wrote.
KATEX_HERE = os.path.exists(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "static", "katex", "katex.min.js"))
SAFE_SCHEMES = ("http://", "https://", "mailto:")


# Mathematics a model wrote between \( \), \[ \] or $$ $$, read as such by Markdown's own inline parser
# (so never inside code, a link's address or any attribute) and written as spans the page's KaTeX typesets.
# A lone $ is no delimiter: "$5 and $10" is money (the Go version's automatic delimiters read it as
# mathematics). Each opener looks for its closer once: past the last opener that found none, no opener of
# that kind looks again, so unclosed openers cost a scan, not a scan each.
MATH_DELIMITERS = (("$$", "$$", True), ("\\[", "\\]", True), ("\\(", "\\)", False))


def _math(state, silent: bool) -> bool:
    src, pos = state.src, state.pos
    found = next((d for d in MATH_DELIMITERS if src.startswith(d[0], pos)), None)
    if found is None:
        return False
    opener, closer, display = found
    start = pos + len(opener)
    unclosed = state.env.setdefault("math_unclosed", {})
    key = (id(src), opener)
    if start >= unclosed.get(key, len(src) + 1):
        return False
    end = src.find(closer, start)
    if end < 0:
        unclosed[key] = min(unclosed.get(key, start), start)
        return False
    if not src[start:end].strip():
        return False
    if not silent:
        token = state.push("math", "span", 0)
        token.content, token.info = src[start:end].strip(), "1" if display else "0"
    state.pos = end + len(closer)
    return True


def _markdown() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "linkify": False})
    md.disable("image")  # an image would be fetched by the browser: a model must not make it call out
    md.validateLink = lambda url: url.strip().lower().startswith(SAFE_SCHEMES)
    md.inline.ruler.before("escape", "math", _math)  # before \( reads as an escaped parenthesis

    def link_open(renderer, tokens, idx, options, env):
        tokens[idx].attrSet("rel", "noopener noreferrer nofollow")
        tokens[idx].attrSet("target", "_blank")
        return renderer.renderToken(tokens, idx, options, env)

    md.add_render_rule("link_open", link_open)
    md.add_render_rule("math", lambda renderer, tokens, idx, options, env: (
        f'<span class="math" data-display="{tokens[idx].info}">{escape(tokens[idx].content)}</span>'))
    return md


MARKDOWN = _markdown()


def render_markdown(text: str) -> str:
    return MARKDOWN.render(text[:MAX_RENDER])


bp = Blueprint("chat", __name__)


@bp.get("/chat")
@flask_login.login_required
def chat():
    s = site()
    return render_template("chat.html", models=_models(s.runtime), spends=_choices(s.runtime), katex=KATEX_HERE,
                           token=s.form(forms.ActionForm).csrf_token.current_token)


def _choices(runtime: Runtime) -> list[tuple[str, str]]:
    """What the signed-in person may spend a chat against: on their own (unless personal use is off), and
    each project they reach through a membership, as (value, label)."""
    from llmgw.people import memberships
    from llmgw.people.orgtree import Tree

    me = flask_login.current_user.user
    with runtime.engine.connect() as conn:
        tree = Tree.read(conn)
        reach = sorted((tree.by_id[p] for p in memberships.reachable_projects(conn, tree, me.id)),
                       key=lambda n: n.path.lower())
    own = [] if runtime.keys.person(me.id).personal_off else [("personal", "On my own")]
    return own + [(p.id, p.path) for p in reach]


def _spends(runtime: Runtime, user_id: str, wanted: str) -> str | None:
    """The project a chat request (`X-Llmgw-Spend`) spends against, None for on one's own; raises ApiError
    for a project the person reaches through no membership. One read of their memberships: the project's
    team and organisation come from the worker's key table."""
    if not wanted or wanted == "personal":
        return None
    up = runtime.keys.rules.parents.get(wanted)
    if up is None:
        raise ApiError(400, "The project this chat spends against is not known (removed, or a stale page); "
                            "reload the page and choose again.", "unknown_project")
    m = store.memberships
    with runtime.engine.connect() as conn:
        member = conn.execute(sa.select(m.c.scope_id).where(m.c.user_id == user_id,
                                                              m.c.scope_id.in_((wanted, *up)))).first()
    if member is None:
        raise ApiError(403, "You are not a member of the project this chat spends against; choose another on the "
                            "page, or ask an operator to add you (`llmgw users join`).", "not_a_member")
    return wanted


@bp.get("/chat/models")
@flask_login.login_required
def chat_models():
    return {"models": _models(site().runtime)}


@bp.post("/chat/render")
@flask_login.login_required
def chat_render():
    if not _csrf_ok(site().csrf_secret, request.headers.get("X-CSRF-Token", ""), request.environ):
        abort(400, "The page is out of date; reload it.")
    body = request.get_json(silent=True)
    text = body.get("text") if isinstance(body, dict) else None
    if not isinstance(text, str):
        abort(400, "Send {\"text\": \"...\"}.")
    return {"html": render_markdown(text)}


def _models(runtime: Runtime) -> list[dict]:
    """Each served model once (no aliases), whether it answers now, whether it starts when asked, and the most
    a turn here asks for: the smaller of the page's ceiling (`gateway.chat_max_tokens`) and its `max_output`."""
    router = runtime.router
    ceiling = runtime.cfg["gateway.chat_max_tokens"] or None
    out = []
    for spec in router.snapshot.offered():
        ready = router.serves(spec.name)
        out.append({"name": spec.name, "ready": ready, "on_demand": spec.on_demand, "status": status(spec, ready),
                    "max_tokens": min(filter(None, (ceiling, spec.max_output)), default=None),
                    "description": spec.description})
    return out


def status(spec, ready: bool) -> str:
    """What a model that is not ready waits for, in words for the page ("" when ready)."""
    if ready:
        return ""
    if spec.loading is None:
        return "starts when asked" if spec.on_demand else "waiting for a node with room for it"
    state, done, total = spec.loading
    if state == "fetching" and done is not None and total:
        return f"downloading its weights: {100 * done // total}% of {human_bytes(total)}"
    return {"waiting": "waiting for the other nodes of its replica", "pending": "a node is about to start it",
            "fetching": "downloading its weights", "starting": "its engine is starting"}.get(state, state)


@bp.post("/chat/wake")
@flask_login.login_required
def chat_wake():
    """Start a model that runs on demand (the page asks before it sends, then waits saying what for)."""
    s = site()
    if not _csrf_ok(s.csrf_secret, request.headers.get("X-CSRF-Token", ""), request.environ):
        abort(400, "The page is out of date; reload it.")
    body = request.get_json(silent=True)
    name = body.get("model") if isinstance(body, dict) else None
    snapshot = s.runtime.router.snapshot
    spec = next((m for m in snapshot.offered() if m.name == name), None)
    if spec is None:
        abort(404, "No such model here; reload the page.")
    # Only what the person may use, spending as the page says: a chat request would be refused, so nothing
    # is started for it (a model kept loaded for nobody holds cards others need).
    me = flask_login.current_user.user
    try:
        project = _spends(s.runtime, me.id, request.headers.get("X-Llmgw-Spend", ""))
    except ApiError as e:
        abort(e.status, e.message)
    table = s.runtime.keys
    access = table.person(me.id) if project is None else table.rules.access(None, project, me.id)
    if access.personal_off or (access.models is not None and not snapshot.allows(access.models, spec.name)):
        abort(403, f"You may not use {spec.name} spending as chosen; choose another model or project.")
    ready = s.runtime.router.serves(spec.name)
    if spec.on_demand and not ready:
        s.runtime.demand(spec.name)
    return {"ready": ready, "status": "" if ready else status(spec, ready).replace("starts when asked",
                                                                               "waiting for a node with room for it")}


def _csrf_ok(secret: bytes, token: str, environ) -> bool:
    from flask import session

    f = forms.make(forms.ActionForm, MultiDict({"csrf_token": token}), secret, session)
    return f.validate()


def caller_for(app: Flask, runtime: Runtime, environ):
    """The person behind a chat request to APP (the pages' app), as a proxy `Caller`; raises ApiError when
    there is none."""
    from llmgw.gateway.caller import Caller

    csrf_secret = app.extensions["llmgw"].csrf_secret
    with app.request_context(environ):
        person = flask_login.current_user
        user_id = person.get_id() if person.is_authenticated else None
        table = runtime.keys
        if not user_id or user_id not in table.active_people:
            raise ApiError(401, "Sign in again to chat (your session ended).", "not_signed_in")
        if not _csrf_ok(csrf_secret, environ.get("HTTP_X_CSRF_TOKEN", ""), environ):
            raise ApiError(403, "The page is out of date; reload it.", "csrf_failed")
    project = _spends(runtime, user_id, environ.get("HTTP_X_LLMGW_SPEND", ""))
    access = table.person(user_id) if project is None else table.rules.access(None, project, user_id)
    return Caller(f"session:{user_id}", project, user_id, access)


def error_response(e: ApiError, start_response):
    body = e.body()
    start_response(e.status_line, e.headers(body))
    return [body]

