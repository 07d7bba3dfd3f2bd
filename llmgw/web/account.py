"""A person's account: their keys (made, revoked), their use and budgets, their editors' setup, and
their password.

Changing the password ends every session of theirs (one may have been a thief's) and begins a new
one for this browser; the current password is throttled as sign-in is.
"""

from __future__ import annotations

import time

import flask_login
from flask import Blueprint, abort, redirect, render_template, request
from markupsafe import Markup

from llmgw import rules
from llmgw.people import accounts, identities, keys, limits, memberships, usagereport
from llmgw.people.orgtree import Tree
from llmgw.web import budgets, editors, forms, safety
from llmgw.web.site import EXPIRED_FORM, site

bp = Blueprint("account", __name__)


def _my_projects(me) -> tuple:
    with site().engine.connect() as conn:
        tree = Tree.read(conn)
        reach = memberships.reachable_projects(conn, tree, me.id)
    return tree, sorted((tree.by_id[p] for p in reach), key=lambda n: n.path.lower())


def _key_form(me, tree_projects, data=None):
    f = site().form(forms.KeyForm, data)
    personal = [] if site().runtime.keys.person(me.id).personal_off else [("personal", "Personal")]
    f.spends.choices = personal + [(p.id, p.path) for p in tree_projects]
    return f


def _account_page(new_secret=None, f=None, problem=None, status=200):
    s = site()
    engine, runtime = s.engine, s.runtime
    me = flask_login.current_user.user
    if new_secret:
        safety.no_store()
    tree, projects = _my_projects(me)
    mine = keys.list_keys(engine, user_id=me.id)
    own = [k for k in mine if k.revoked_at is None]
    # An administrator who ran `llmgw up` looks here for the key it printed, which is a project's, nobody's.
    unowned = [k for k in keys.list_keys(engine, ownerless=True) if k.revoked_at is None] if me.is_admin else []
    ids = [k.id for k in mine + unowned]
    use = usagereport.report(engine, "model", time.time() - 29 * usagereport.DAY, user_id=me.id)
    days = [sum(line.series.get(b, (0, 0, 0))[0] for line in use.lines) for b in use.buckets]
    with engine.connect() as conn:
        priced = limits.read_prices(conn).anything_priced()
    return render_template("account.html", keys=own, unowned=unowned, key_form=f or _key_form(me, projects),
                           revoke=s.form(forms.ActionForm), new_secret=new_secret, problem=problem,
                           last_used=usagereport.last_used(engine, ids), use=use, days=days,
                           day_names=[time.strftime("%Y-%m-%d", time.gmtime(b)) for b in use.buckets],
                           peak=max(days, default=0), money=rules.show_money, priced=priced,
                           providers=identities.changes_of(engine, me.id), labels={
                               name: p.label for name, p in s.providers.items()},
                           has_password=accounts.has_password(engine, me.id),
                           budgets=budgets.for_person(runtime, me.id, [p.id for p in projects], tree),
                           editors=editors.section(runtime, editors.usable_models(runtime, me.id, own),
                                                   request.args.get("model"),
                                                   editors.keeps_notes(runtime, own))), status


@bp.get("/account")
@flask_login.login_required
def account():
    return _account_page()


@bp.post("/account/keys")
@flask_login.login_required
def create_key():
    s = site()
    me = flask_login.current_user.user
    _, projects = _my_projects(me)
    f = _key_form(me, projects, request.form)
    if not f.validate():
        problem = EXPIRED_FORM if "csrf_token" in f.errors else "Give the key a name, and choose what it spends against."
        return _account_page(f=f, problem=problem, status=400)
    lifetime = keys.parse_duration(f.expires.data) if f.expires.data else None
    project = None if f.spends.data == "personal" else f.spends.data
    try:
        models = [m.strip() for m in (f.models.data or "").split(",") if m.strip()] or None
        _, secret = keys.create_key(s.engine, f.name.data, project, expires_in=lifetime, user_id=me.id,
                                    made_by=me.id, member_only=True, band=f.band.data or None, models=models)
    except keys.KeyRefused as e:
        return _account_page(f=f, problem=s.sentence(e), status=400)
    return _account_page(new_secret=secret)


@bp.post("/account/keys/<key_id>/revoke")
@flask_login.login_required
def revoke_key(key_id):
    s = site()
    if not s.form(forms.ActionForm, request.form).validate():
        abort(400, EXPIRED_FORM)
    try:
        keys.revoke_key(s.engine, key_id, user_id=flask_login.current_user.user.id)
    except keys.KeyRefused:
        abort(404)  # not one of this person's keys: say nothing about it
    return redirect("/account")


@bp.route("/account/password", methods=["GET", "POST"])
@flask_login.login_required
def password():
    s = site()
    f, problem = s.posted(forms.PasswordForm)
    if request.method == "POST" and problem is None:
        me = flask_login.current_user.user
        problem = s.throttled(me.email, lambda: _change_password(me, f.current.data, f.password.data))
        if problem is None:
            # Every session of theirs ended with the change (one may have been a thief's); this browser
            # gets a new one, with a new CSRF token for the forms after it.
            s.begin_session(me)
            return render_template("message.html", title="Password changed",
                                   text=Markup('Your password is changed. <a href="/account">Back to '
                                               'your account</a>.'))
    return render_template("password.html", form=f, problem=problem), 400 if problem else 200


def _change_password(me: accounts.User, current: str, new: str) -> str | None:
    """None once ME's password is NEW, else why not."""
    s = site()
    try:
        accounts.change_password(s.engine, me.id, current, new, s.offload)
    except accounts.AccountError as e:
        return s.sentence(e)
    return None
