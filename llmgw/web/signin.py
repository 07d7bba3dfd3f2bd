"""The pages anyone may open: the landing page, sign-in, sign-up, sign-out, and a key's claim link.

Signing in starts a fresh session (`Site.begin_session`), so a session made before it (fixed by
someone else) is worth nothing after. Sign-in is throttled per account and per address, sign-up per
address (llmgw/web/throttle.py), and every password hash runs in the site's hashing threads.
"""

from __future__ import annotations

import time

import flask_login
from flask import Blueprint, abort, redirect, render_template, request, session

from llmgw.people import accounts, keys, sessions
from llmgw.web import editorconfig, editors, forms, oidcpages, safety
from llmgw.web.site import EXPIRED_FORM, site

bp = Blueprint("signin", __name__)


@bp.get("/")
def landing():
    s = site()
    router = s.runtime.router
    models = [(spec, router.serves(spec.name)) for spec in router.snapshot.offered()]
    base_url = request.host_url.rstrip("/") + "/v1"
    return render_template("landing.html", models=models, base_url=base_url, contact=s.cfg["gateway.contact"],
                           variable=editorconfig.KEY_VARIABLE)


@bp.route("/login", methods=["GET", "POST"])
def sign_in():
    s = site()
    f, problem = s.posted(forms.SignInForm, "Give your email and password.")
    if request.method == "POST" and problem is None:
        email, password = f.email.data, f.password.data
        problem = _local_refused(email)
        result = problem or s.throttled(email, lambda: accounts.authenticate(s.engine, email, password, s.offload))
        if isinstance(result, str):
            problem = result
        else:
            s.begin_session(result)
            return redirect(safety.local_path(request.args.get("next")) or "/account")
    nxt = safety.local_path(request.args.get("next"))
    return render_template("login.html", form=f, problem=problem, providers=oidcpages.provider_buttons(),
                           next=nxt, local=s.cfg["auth.local_sign_in"] or request.args.get("local") == "1"
                           or request.method == "POST"), 400 if problem else 200


def _local_refused(email: str) -> str | None:
    """Why EMAIL may not sign in with a password here, if not: local sign-in is off, and they are not one of
    the break-glass administrators. Said before the password is looked at, whatever the account."""
    s = site()
    if s.cfg["auth.local_sign_in"] or email.strip().lower() in {e.lower() for e in s.cfg["auth.break_glass"]}:
        return None
    labels = " or ".join(label for _, label in oidcpages.provider_buttons()) or "your organisation's account"
    return f"Signing in with a password is turned off here; sign in with {labels}."


@bp.route("/signup", methods=["GET", "POST"])
def sign_up():
    s = site()
    if not s.cfg["gateway.signup_open"] or not s.cfg["auth.local_sign_in"]:
        contact = s.cfg["gateway.contact"] or "an operator"
        return render_template("message.html", title="Sign-up is closed",
                               text=f"Accounts are made by the operators here. Ask {contact}."), 404
    f, problem = s.posted(forms.SignUpForm)
    if request.method == "POST" and problem is None:
        problem = _sign_up_refused() or _new_account(f.email.data, f.password.data)
        if problem is None:
            return render_template("message.html", title="Thank you",
                                   text="Your account waits for an operator's approval. "
                                        "You can sign in once it is approved.")
    return render_template("signup.html", form=f, problem=problem), 400 if problem else 200


def _new_account(email: str, password: str) -> str | None:
    """None once EMAIL has an account waiting for approval, else why not."""
    s = site()
    try:
        accounts.create_user(s.engine, email, password, offload=s.offload)
    except accounts.AccountError as e:
        return s.sentence(e)
    return None


def _sign_up_refused() -> str | None:
    """Why this sign-up is not taken, if it is not: too many waiting for approval, or too many from this
    address. Each sign-up hashes a password and leaves an account for an operator to look at; forty at
    once from one address once made forty in 3.3 s."""
    s = site()
    waiting = len(accounts.list_users(s.engine, accounts.PENDING))
    if waiting >= s.cfg["gateway.sign_ups_pending"]:
        return (f"Sign-up is paused: {waiting} accounts already wait for approval. Ask "
                f"{s.cfg['gateway.contact'] or 'an operator'} for an account.")
    return s.throttle.sign_up(s.proxies.client(request.environ), time.monotonic())


@bp.post("/logout")
def sign_out():
    s = site()
    if not s.form(forms.ActionForm, request.form).validate():
        abort(400, EXPIRED_FORM)
    sessions.end(s.engine, session.get("sid"))
    provider = s.providers.get(session.get("via", ""))
    flask_login.logout_user()
    session.clear()
    elsewhere = provider.end_session_url(editors.gateway_url(s.runtime) + "/") if provider else None
    if elsewhere:
        return render_template("signed_out.html", provider=provider.label, elsewhere=elsewhere)
    return redirect("/")


@bp.route("/claim/<token>", methods=["GET", "POST"])
def claim(token):
    s = site()
    # Opening the link only shows a button: link previews and scanners fetch pages, and must
    # not use up the one showing.
    if request.method == "GET":
        return render_template("claim.html", action=s.form(forms.ActionForm), secret=None)
    if not s.form(forms.ActionForm, request.form).validate():
        abort(400, EXPIRED_FORM)
    result = keys.claim(s.engine, token)
    if isinstance(result, str):
        return render_template("message.html", title="No key here", text=result), 410
    secret, record = result
    safety.no_store()
    return render_template("claim.html", secret=secret, record=record, base_url=request.host_url.rstrip("/") + "/v1")
