"""The pages' Flask app: made once in each gateway worker, with each group of pages a blueprint.

The groups: sign-in and the pages anyone may open (llmgw/web/signin.py), a person's account
(account.py), the chat page (chatpage.py), the editors' setup scripts (editors.py), the
administration pages (adminpages.py, mirrorpage.py, nodepages.py, fabricpages.py) and the error pages
(errorpages.py). What they share (the runtime, the store, forms, sessions, the throttle) is the
app's `Site` (site.py), kept as Flask's own extensions keep theirs.

Pages are not on the `/v1` path, so they can afford Flask, Jinja2 and a
database query per page. Every form carries a CSRF token bound to the
session; session cookies are HttpOnly, SameSite=Lax, and Secure whenever the
request came over HTTPS (directly, or through a trusted proxy's
`X-Forwarded-Proto`). Signing in starts a fresh session, so a session made
before it (fixed by someone else) is worth nothing after.

A signed cookie alone no longer counts: each names a session record in the
store (llmgw/people/sessions.py), checked on every page request, so signing
out, changing a password, suspension and an administrator end sessions for
good. Sign-in and the current password of a password change are throttled
per account and per address, sign-up per address (llmgw/web/throttle.py),
and every password hash runs in a thread pool, off the worker's event loop:
120 sign-ins once stalled `/health` for 0.63 s.
"""

from __future__ import annotations

import os
import time

import flask_login
from flask import Flask, request, session
from flask.sessions import SecureCookieSessionInterface

from llmgw import units
from llmgw.gateway.forwarded import TrustedProxies
from llmgw.gateway.worker import Runtime
from llmgw.people import accounts, memberships, sessions
from llmgw.web import (
    about,
    account,
    adminpages,
    chatpage,
    clilogin,
    editors,
    errorpages,
    fabricpages,
    forms,
    history,
    mirrorpage,
    nodepages,
    oidcpages,
    safety,
    signin,
)
from llmgw.web.site import Person, Site, site

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Sessions(SecureCookieSessionInterface):
    def get_cookie_secure(self, app) -> bool:
        # Secure behind HTTPS, and only then: over plain HTTP the browser would drop the cookie.
        return request.scheme == "https"


def checked_host(wsgi_app):
    """WSGI_APP behind a check of the Host header (after a trusted proxy's X-Forwarded-Host has replaced it).

    Werkzeug builds the URLs a page shows from the Host, and routes by it. One it could not read (a space,
    a non-ASCII letter, port 99999) it took as empty, and `/setup/<tool>` answered 500, blaming the operator;
    one it refused (`..`, a 5,000-character name) it refused with a 400 that then failed to draw, so the
    client got gunicorn's bare 500. Only a client sends a Host, so this refusal is a 400, in plain text that
    is inert when piped to sh, as `/setup/<tool>` answers are. A request without one (HTTP/1.0) is left to
    Werkzeug, which takes the server's own address."""

    def app(environ, start_response):
        host = environ.get("HTTP_HOST")
        if host is None or editors.plain_host(host):
            return wsgi_app(environ, start_response)
        text = (f"This request's Host header ({ascii(host[:100])}) is not a host name this gateway can answer to. "
                "Send the gateway's own address (a DNS name, an IPv4 address or an [IPv6] address, with a port "
                "if it needs one), as curl and browsers do when given its URL.")
        answer = editors.refusal(400, text)
        answer.headers["X-Content-Type-Options"] = "nosniff"
        return answer(environ, start_response)

    return app


def create_app(runtime: Runtime, proxies: TrustedProxies) -> Flask:
    app = Flask("llmgw", template_folder=os.path.join(ROOT, "templates"), static_folder=os.path.join(ROOT, "static"))
    app.wsgi_app = checked_host(app.wsgi_app)
    secret = sessions.ensure_secret(sessions.secret_path(runtime.cfg))
    app.config.update(SECRET_KEY=secret, SESSION_COOKIE_HTTPONLY=True, SESSION_COOKIE_SAMESITE="Lax",
                      SESSION_COOKIE_NAME="llmgw_session")
    app.session_interface = _Sessions()
    app.extensions["llmgw"] = Site(runtime, proxies, secret)
    login = flask_login.LoginManager(app)
    login.login_view = "signin.sign_in"
    login.login_message = None
    login.user_loader(_load_person)
    app.after_request(safety.add_headers)
    # Figures as llmgw.units writes them everywhere: `bytes`, `duration` (seconds), `ago` (seconds since),
    # `count`, `since` (a time, as how long ago); a figure that is not a number (a node of another version) reads "unknown", never an error.
    app.add_template_filter(history.size, "bytes")
    app.add_template_filter(lambda s: units.human_duration(s, "unknown"), "duration")
    app.add_template_filter(units.ago, "ago")
    app.add_template_filter(lambda t: units.ago(time.time() - t) if units.known(t) else "never", "since")
    app.add_template_filter(units.count, "count")
    app.add_template_filter(lambda t: time.strftime("%Y-%m-%d", time.gmtime(t)), "day")
    app.add_template_filter(lambda t: time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t)), "minute")
    app.context_processor(_menu)
    for blueprint in (signin.bp, oidcpages.bp, clilogin.bp, about.bp, account.bp, chatpage.bp, editors.bp, adminpages.bp, mirrorpage.bp,
                      nodepages.bp, fabricpages.bp, errorpages.bp):
        app.register_blueprint(blueprint)
    return app


def _load_person(user_id: str):
    s = site()
    if not sessions.holds(s.engine, session.get("sid"), user_id, s.lifetimes):
        return None  # ended, expired, or a cookie from before sessions were kept
    user = accounts.get(s.engine, user_id)
    # Suspended or removed since signing in: the session no longer counts.
    return Person(user) if user and user.state == accounts.ACTIVE else None


def _menu() -> dict:
    s = site()
    signed_in = flask_login.current_user.is_authenticated
    me = flask_login.current_user.user if signed_in else None
    manages = False
    if me is not None and not me.is_admin:
        with s.engine.connect() as conn:
            manages = bool(memberships.managed_orgs(conn, me.id))
    return {"signed_in": signed_in, "signup_open": s.cfg["gateway.signup_open"] and s.cfg["auth.local_sign_in"],
            "sign_out": s.form(forms.ActionForm) if signed_in else None, "me": me, "manages": manages,
            "here": request.path}
