"""The web pages, as a Flask app: the landing page, sign-in and sign-up, and a person's account.

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
from flask import Flask, abort, redirect, render_template, request, session
from flask.sessions import SecureCookieSessionInterface
from gevent.threadpool import ThreadPool
from markupsafe import Markup

from llmgw import rules
from llmgw.gateway.forwarded import TrustedProxies
from llmgw.gateway.worker import Runtime
from llmgw.people import accounts, keys, limits, memberships, sessions, usagereport
from llmgw.people.orgtree import Tree
from llmgw.web import adminpages, budgets, chatpage, editorconfig, editors, errorpages, forms, mirrorpage, nodepages, safety, throttle

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPIRED_FORM = "The form expired or did not come from this page; reload the page and try again."


class _Sessions(SecureCookieSessionInterface):
    def get_cookie_secure(self, app) -> bool:
        # Secure behind HTTPS, and only then: over plain HTTP the browser would drop the cookie.
        return request.scheme == "https"


class Person(flask_login.UserMixin):
    def __init__(self, user: accounts.User):
        self.user = user

    def get_id(self) -> str:
        return self.user.id


# Threads that hash passwords at once. scrypt lets go of the GIL, but each hash is 16 MiB and tens of ms of
# CPU: with gevent's ten default threads a burst of sign-ins took the CPU from the worker's event loop
# (/health stalled 1.3 s on a busy two-core machine); with two it stayed under 0.1 s, the rest queueing.
HASHING_THREADS = 2


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
    engine = runtime.engine
    cfg = runtime.cfg
    app = Flask("llmgw", template_folder=os.path.join(ROOT, "templates"),
                static_folder=os.path.join(ROOT, "static"))
    app.wsgi_app = checked_host(app.wsgi_app)
    hashing = ThreadPool(HASHING_THREADS)

    def offload(function, *args):
        """Run FUNCTION (a password hash) in the hashing threads; this greenlet waits, the loop serves."""
        return hashing.apply(function, args)

    secret = sessions.ensure_secret(sessions.secret_path(cfg))
    lifetimes = sessions.Lifetimes(cfg["gateway.session_idle"], cfg["gateway.session_lifetime"])
    guard = throttle.Throttle(throttle.Limits(cfg["gateway.sign_in_failures_per_account"],
                                              cfg["gateway.sign_in_failures_per_address"], cfg["gateway.sign_in_window"],
                                              cfg["gateway.sign_ups_per_address"]),
                              lambda limit: runtime.metrics.sign_in_throttled.labels(limit).inc())
    app.config.update(SECRET_KEY=secret, SESSION_COOKIE_HTTPONLY=True, SESSION_COOKIE_SAMESITE="Lax",
                      SESSION_COOKIE_NAME="llmgw_session")
    app.session_interface = _Sessions()
    csrf_secret = secret.encode()
    app.config["CSRF_SECRET"] = csrf_secret
    login = flask_login.LoginManager(app)
    login.login_view = "sign_in"
    login.login_message = None

    app.after_request(safety.add_headers)

    @login.user_loader
    def load(user_id: str):
        if not sessions.holds(engine, session.get("sid"), user_id, lifetimes):
            return None  # ended, expired, or a cookie from before sessions were kept
        user = accounts.get(engine, user_id)
        # Suspended or removed since signing in: the session no longer counts.
        return Person(user) if user and user.state == accounts.ACTIVE else None

    def begin_session(user: accounts.User) -> None:
        session.clear()  # a new session: one fixed before signing in is worth nothing
        flask_login.login_user(Person(user))
        session["sid"] = sessions.start(engine, user.id, lifetimes)

    def form(form_class, data=None):
        return forms.make(form_class, data, csrf_secret, session)

    def posted(form_class, missing: str | None = None):
        """FORM_CLASS for this request, and what is wrong with what was posted (None: nothing, or not a POST)."""
        f = form(form_class, request.form if request.method == "POST" else None)
        if request.method != "POST" or f.validate():
            return f, None
        if "csrf_token" in f.errors:
            return f, EXPIRED_FORM
        return f, missing or " ".join(e for errors in f.errors.values() for e in errors)

    def sentence(e: Exception) -> str:
        text = str(e)
        return text[:1].upper() + text[1:] + "."

    @app.template_filter("day")
    def day(timestamp: float) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(timestamp))

    @app.template_filter("minute")
    def minute(timestamp: float) -> str:
        return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(timestamp))

    @app.context_processor
    def menu():
        signed_in = flask_login.current_user.is_authenticated
        me = flask_login.current_user.user if signed_in else None
        manages = False
        if me is not None and not me.is_admin:
            with engine.connect() as conn:
                manages = bool(memberships.managed_orgs(conn, me.id))
        return {"signed_in": signed_in, "signup_open": cfg["gateway.signup_open"],
                "sign_out": form(forms.ActionForm) if signed_in else None, "me": me, "manages": manages,
                "here": request.path}

    @app.get("/")
    def landing():
        snapshot = runtime.router.snapshot
        models = [(spec, bool(runtime.router.available(spec.name))) for spec in snapshot.offered()]
        base_url = request.host_url.rstrip("/") + "/v1"
        return render_template("landing.html", models=models, base_url=base_url, contact=cfg["gateway.contact"],
                               variable=editorconfig.KEY_VARIABLE)

    @app.route("/login", methods=["GET", "POST"])
    def sign_in():
        f, problem = posted(forms.SignInForm, "Give your email and password.")
        if request.method == "POST" and problem is None:
            result = signed_in(f.email.data, f.password.data)
            if isinstance(result, str):
                problem = result
            else:
                begin_session(result)
                return redirect(safety.local_path(request.args.get("next")) or "/account")
        return render_template("login.html", form=f, problem=problem), 400 if problem else 200

    def signed_in(email: str, password: str) -> accounts.User | str:
        """The person EMAIL and PASSWORD sign in, or why not."""
        return throttled(email, lambda: accounts.authenticate(engine, email, password, offload))

    def throttled(email: str, check):
        """CHECK of EMAIL's password (what it answers, or a str saying why not) under the throttle: every
        attempt counts, and past the limits the password is not checked at all."""
        address = proxies.client(request.environ)
        refused = guard.begin(email, address, time.monotonic())
        if refused:
            return refused
        result = check()
        if not isinstance(result, str):
            guard.succeeded(email, address, time.monotonic())
        return result

    @app.route("/signup", methods=["GET", "POST"])
    def sign_up():
        if not cfg["gateway.signup_open"]:
            contact = cfg["gateway.contact"] or "an operator"
            return render_template("message.html", title="Sign-up is closed",
                                   text=f"Accounts are made by the operators here. Ask {contact}."), 404
        f, problem = posted(forms.SignUpForm)
        if request.method == "POST" and problem is None:
            problem = sign_up_refused() or new_account(f.email.data, f.password.data)
            if problem is None:
                return render_template("message.html", title="Thank you",
                                       text="Your account waits for an operator's approval. "
                                            "You can sign in once it is approved.")
        return render_template("signup.html", form=f, problem=problem), 400 if problem else 200

    def new_account(email: str, password: str) -> str | None:
        """None once EMAIL has an account waiting for approval, else why not."""
        try:
            accounts.create_user(engine, email, password, offload=offload)
        except accounts.AccountError as e:
            return sentence(e)
        return None

    def sign_up_refused() -> str | None:
        """Why this sign-up is not taken, if it is not: too many waiting for approval, or too many from this
        address. Each sign-up hashes a password and leaves an account for an operator to look at; forty at
        once from one address once made forty in 3.3 s."""
        waiting = len(accounts.list_users(engine, accounts.PENDING))
        if waiting >= cfg["gateway.sign_ups_pending"]:
            return (f"Sign-up is paused: {waiting} accounts already wait for approval. Ask "
                    f"{cfg['gateway.contact'] or 'an operator'} for an account.")
        return guard.sign_up(proxies.client(request.environ), time.monotonic())

    @app.post("/logout")
    def sign_out():
        if not form(forms.ActionForm, request.form).validate():
            abort(400, EXPIRED_FORM)
        sessions.end(engine, session.get("sid"))
        flask_login.logout_user()
        session.clear()
        return redirect("/")

    def my_projects(me) -> list:
        with engine.connect() as conn:
            tree = Tree.read(conn)
            reach = memberships.reachable_projects(conn, tree, me.id)
        return tree, sorted((tree.by_id[p] for p in reach), key=lambda n: n.path.lower())

    def key_form(me, tree_projects, data=None):
        f = form(forms.KeyForm, data)
        f.spends.choices = [("personal", "Personal")] + [(p.id, p.path) for p in tree_projects]
        return f

    def account_page(new_secret=None, f=None, problem=None, status=200):
        me = flask_login.current_user.user
        if new_secret:
            safety.no_store()
        tree, projects = my_projects(me)
        mine = keys.list_keys(engine, user_id=me.id)
        own = [k for k in mine if k.revoked_at is None]
        # An administrator who ran `llmgw up` looks here for the key it printed, which is a project's, nobody's.
        unowned = [k for k in keys.list_keys(engine, ownerless=True) if k.revoked_at is None] if me.is_admin else []
        ids = [k.id for k in mine + unowned]
        use = usagereport.report(engine, "model", time.time() - 29 * usagereport.DAY, user_id=me.id)
        days = [sum(line.series.get(b, (0, 0, 0))[0] for line in use.lines) for b in use.buckets]
        with engine.connect() as conn:
            priced = limits.read_prices(conn).anything_priced()
        return render_template("account.html", keys=own, unowned=unowned, key_form=f or key_form(me, projects),
                               revoke=form(forms.ActionForm), new_secret=new_secret, problem=problem,
                               last_used=usagereport.last_used(engine, ids), use=use, days=days,
                               day_names=[time.strftime("%Y-%m-%d", time.gmtime(b)) for b in use.buckets],
                               peak=max(days, default=0), money=rules.show_money, priced=priced,
                               budgets=budgets.for_person(runtime, me.id, [p.id for p in projects], tree),
                               editors=editors.section(runtime, editors.usable_models(runtime, me.id, own),
                                                       request.args.get("model"))), status

    @app.get("/account")
    @flask_login.login_required
    def account():
        return account_page()

    @app.post("/account/keys")
    @flask_login.login_required
    def create_key():
        me = flask_login.current_user.user
        _, projects = my_projects(me)
        f = key_form(me, projects, request.form)
        if not f.validate():
            problem = EXPIRED_FORM if "csrf_token" in f.errors else "Give the key a name, and choose what it spends against."
            return account_page(f=f, problem=problem, status=400)
        lifetime = keys.parse_duration(f.expires.data) if f.expires.data else None
        project = None if f.spends.data == "personal" else f.spends.data
        try:
            models = [m.strip() for m in (f.models.data or "").split(",") if m.strip()] or None
            _, secret = keys.create_key(engine, f.name.data, project, expires_in=lifetime, user_id=me.id,
                                        made_by=me.id, member_only=True, band=f.band.data or None, models=models)
        except keys.KeyRefused as e:
            return account_page(f=f, problem=sentence(e), status=400)
        return account_page(new_secret=secret)

    @app.post("/account/keys/<key_id>/revoke")
    @flask_login.login_required
    def revoke_key(key_id):
        if not form(forms.ActionForm, request.form).validate():
            abort(400, EXPIRED_FORM)
        try:
            keys.revoke_key(engine, key_id, user_id=flask_login.current_user.user.id)
        except keys.KeyRefused:
            abort(404)  # not one of this person's keys: say nothing about it
        return redirect("/account")

    @app.route("/account/password", methods=["GET", "POST"])
    @flask_login.login_required
    def password():
        f, problem = posted(forms.PasswordForm)
        if request.method == "POST" and problem is None:
            me = flask_login.current_user.user
            problem = throttled(me.email, lambda: change_password(me, f.current.data, f.password.data))
            if problem is None:
                # Every session of theirs ended with the change (one may have been a thief's); this browser
                # gets a new one, with a new CSRF token for the forms after it.
                begin_session(me)
                return render_template("message.html", title="Password changed",
                                       text=Markup('Your password is changed. <a href="/account">Back to '
                                                   'your account</a>.'))
        return render_template("password.html", form=f, problem=problem), 400 if problem else 200

    def change_password(me: accounts.User, current: str, new: str) -> str | None:
        """None once ME's password is NEW, else why not."""
        try:
            accounts.change_password(engine, me.id, current, new, offload)
        except accounts.AccountError as e:
            return sentence(e)
        return None

    @app.route("/claim/<token>", methods=["GET", "POST"])
    def claim(token):
        # Opening the link only shows a button: link previews and scanners fetch pages, and must
        # not use up the one showing.
        if request.method == "GET":
            return render_template("claim.html", action=form(forms.ActionForm), secret=None)
        if not form(forms.ActionForm, request.form).validate():
            abort(400, EXPIRED_FORM)
        result = keys.claim(engine, token)
        if isinstance(result, str):
            return render_template("message.html", title="No key here", text=result), 410
        secret, record = result
        safety.no_store()
        return render_template("claim.html", secret=secret, record=record, base_url=request.host_url.rstrip("/") + "/v1")

    chatpage.install(app, runtime, csrf_secret, form)
    editors.install(app, runtime)
    adminpages.install(app, runtime, form, sentence)
    mirrorpage.install(app, runtime, form, sentence)
    nodepages.install(app, runtime)
    errorpages.install(app)
    return app
