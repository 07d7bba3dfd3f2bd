"""Signing in through an identity provider: the browser's redirect and callback, and `llmgw login`'s device flow.

The browser: `/login/oidc/NAME` makes a state, a nonce and a PKCE verifier, keeps them in the store (a
`sign_in_flows` row, keyed by the state's hash; it lasts FLOW_SECONDS) and the state in the session too, and
sends the person to the provider. `/login/oidc/NAME/callback` takes the row back by deleting it, so a
state is good once whatever copies of the cookie or the URL exist, and only in the browser that began it (a
link carrying someone else's code and state is refused: login CSRF). Then the code is redeemed, the ID token
checked (llmgw/web/oidc.py), the person found, linked or made and their groups applied
(llmgw/people/identities.py), and a session begun that lasts at most `auth.provider_session_lifetime`.

`llmgw login`: `POST /login/device` starts the provider's device authorization and answers the code to show
and a handle (the device code stays here); `POST /login/device/poll` with the handle answers `pending`
until the person has confirmed at the provider, then makes a key for them once (the row is deleted as it
is made) and answers its secret. Starting one is throttled per address, as sign-ups are.

Every refusal is a page (or, for the CLI, JSON) in words, and a log line with the detail.
"""

from __future__ import annotations

import logging
import secrets
import time

import sqlalchemy as sa
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from flask import Blueprint, abort, jsonify, redirect, render_template, request, session

from llmgw import store
from llmgw.people import accounts, identities, keys
from llmgw.principals import hash_secret
from llmgw.web import editors, oidc, safety
from llmgw.web.site import site

bp = Blueprint("oidc", __name__)
log = logging.getLogger("llmgw.oidc")

FLOW_SECONDS = 600.0  # a person has this long at the provider's pages
DEVICE_INTERVAL = 5  # seconds between polls, where the provider does not say
MOST_FLOWS = 10_000  # sign-ins under way at once, all providers; past it new ones wait (a flood of starts)


def _provider(name: str) -> oidc.Provider:
    provider = site().providers.get(name)
    if provider is None:
        abort(404)
    return provider


def _callback_url(name: str) -> str:
    return f"{editors.gateway_url(site().runtime)}/login/oidc/{name}/callback"


def _refused(text: str, status: int = 400):
    return render_template("message.html", title="Not signed in", text=text), status


def _new_flow(provider: str, key: str, lasts: float = FLOW_SECONDS, **values) -> str | None:
    """Keep a sign-in under way as KEY's hash; None when it is kept, else why not."""
    now = time.time()
    f = store.sign_in_flows
    with store.writing(site().engine) as conn:
        conn.execute(f.delete().where(f.c.expires_at < now))
        if conn.execute(sa.select(sa.func.count()).select_from(f)).scalar_one() >= MOST_FLOWS:
            return "Too many sign-ins are under way here just now; try again in a few minutes."
        conn.execute(f.insert().values(id=hash_secret(key), provider=provider, created_at=now, expires_at=now + lasts,
                                       **values))
    return None


def _take_flow(key: str, provider: str):
    """The flow kept as KEY's hash for PROVIDER, deleted as it is read (so it is used once); None if none is."""
    f = store.sign_in_flows
    with store.writing(site().engine) as conn:
        row = conn.execute(f.select().where(f.c.id == hash_secret(key))).first()
        if row is None or row.provider != provider:
            return None
        if not conn.execute(f.delete().where(f.c.id == row.id)).rowcount:
            return None  # another request took it first
    return row if row.expires_at > time.time() else None


@bp.get("/login/oidc/<name>")
def begin(name):
    provider = _provider(name)
    state, nonce, verifier = (secrets.token_urlsafe(32) for _ in range(3))
    refused = _new_flow(name, state, nonce=nonce, verifier=verifier,
                        next_path=safety.local_path(request.args.get("next")) or "/account")
    if refused:
        return _refused(refused, 503)
    try:
        url = provider.authorize_url(_callback_url(name), state, nonce, create_s256_code_challenge(verifier))
    except oidc.Refused as e:
        return _refused(str(e), 502)
    session["oidc_state"] = state
    return redirect(url)


@bp.get("/login/oidc/<name>/callback")
def callback(name):
    s = site()
    provider = _provider(name)
    state = request.args.get("state", "")
    expected = session.pop("oidc_state", None)
    if request.args.get("error"):
        log.info("sign-in through %s ended at the provider: %s %s", name, request.args["error"][:60],
                           request.args.get("error_description", "")[:200])
        if expected and secrets.compare_digest(expected, state):
            _take_flow(state, name)
        return _refused(f"{provider.label} did not sign you in ({request.args['error'][:60]}).")
    if not expected or not state or not secrets.compare_digest(expected, state):
        log.warning("sign-in through %s refused: its state is not the one this browser began with", name)
        return _refused(f"This sign-in was not begun in this browser, or was finished already. Sign in with "
                        f"{provider.label} again.")
    flow = _take_flow(state, name)
    if flow is None:
        log.warning("sign-in through %s refused: its state was used already or expired", name)
        return _refused(f"This sign-in was finished already, or took longer than {FLOW_SECONDS / 60:g} minutes. "
                        f"Sign in with {provider.label} again.")
    try:
        tokens = provider.redeem_code(request.args.get("code", ""), _callback_url(name), flow.verifier)
        claims = provider.claims(tokens, flow.nonce)
    except oidc.Refused as e:
        return _refused(str(e))
    except oidc.Pending:
        return _refused(f"{provider.label} did not finish the sign-in; try again.")
    outcome = identities.sign_in(s.engine, provider.entry, claims)
    if outcome.refusal is not None:
        log.info("sign-in through %s of %s: %s", name, claims.email, outcome.refusal)
        return _refused(outcome.refusal, 403)
    s.begin_session(outcome.user, provider=name)
    return redirect(flow.next_path or "/account")


# --- `llmgw login` ----------------------------------------------------------------------------------

def _json_refusal(text: str, status: int):
    return jsonify({"error": text}), status


@bp.post("/login/device")
def device_start():
    s = site()
    body = request.get_json(silent=True) if request.content_length and request.content_length < 4096 else {}
    body = body if isinstance(body, dict) else {}
    name = body.get("provider") or (next(iter(s.providers)) if len(s.providers) == 1 else None)
    if not s.providers:
        return _json_refusal("This gateway signs nobody in through an identity provider; ask an operator for a key.",
                             404)
    if name not in s.providers:
        return _json_refusal(f"Say which identity provider to sign in with (--provider): "
                             f"{', '.join(sorted(s.providers))}.", 400)
    project = body.get("project")
    if project is not None and (not isinstance(project, str) or not 0 < len(project) <= 300):
        return _json_refusal("A project is named by its path, such as acme/research/chat.", 400)
    refused = s.throttle.sign_up(s.proxies.client(request.environ), time.monotonic())
    if refused:
        return _json_refusal(refused, 429)
    provider = s.providers[name]
    try:
        started = provider.start_device()
    except oidc.Refused as e:
        return _json_refusal(str(e), 502)
    handle = secrets.token_urlsafe(32)
    lasts = min(float(started.get("expires_in") or FLOW_SECONDS), FLOW_SECONDS) \
        if isinstance(started.get("expires_in"), (int, float)) else FLOW_SECONDS
    refused = _new_flow(name, handle, lasts, device_code=started["device_code"][:2048], project=project)
    if refused:
        return _json_refusal(refused, 503)
    interval = started.get("interval")
    return jsonify({"handle": handle, "provider": name, "label": provider.label, "user_code": started["user_code"],
                    "verification_uri": started["verification_uri"],
                    "verification_uri_complete": started.get("verification_uri_complete"),
                    "expires_in": int(lasts),
                    "interval": interval if isinstance(interval, int) and 0 < interval < 60 else DEVICE_INTERVAL})


@bp.post("/login/device/poll")
def device_poll():
    s = site()
    body = request.get_json(silent=True) if request.content_length and request.content_length < 4096 else {}
    handle = body.get("handle") if isinstance(body, dict) else None
    if not isinstance(handle, str) or not handle:
        return _json_refusal("Send the handle /login/device gave.", 400)
    f = store.sign_in_flows
    with s.engine.connect() as conn:
        row = conn.execute(f.select().where(f.c.id == hash_secret(handle))).first()
    if row is None or row.device_code is None or row.expires_at <= time.time() or row.provider not in s.providers:
        return _json_refusal("This sign-in is over (finished, or expired); run llmgw login again.", 410)
    provider = s.providers[row.provider]
    try:
        tokens = provider.poll_device(row.device_code)
        claims = provider.claims(tokens, None)
    except oidc.Pending as e:
        return jsonify({"status": "pending", "slow_down": e.slow_down}), 202
    except oidc.Refused as e:
        _take_flow(handle, row.provider)
        return _json_refusal(str(e), 403)
    if _take_flow(handle, row.provider) is None:
        return _json_refusal("This sign-in is over (finished, or expired); run llmgw login again.", 410)
    outcome = identities.sign_in(s.engine, provider.entry, claims)
    if outcome.refusal is not None:
        return _json_refusal(outcome.refusal, 403)
    user = outcome.user
    try:
        record, secret = keys.create_key(s.engine, f"llmgw login ({time.strftime('%Y-%m-%d', time.gmtime())})",
                                         row.project, user_id=user.id, made_by=user.id, member_only=True)
    except keys.KeyRefused as e:
        return _json_refusal(s.sentence(e), 403)
    log.info("%s signed in through %s with llmgw login: key %s made in %s", user.email, row.provider,
                       record.prefix, record.project)
    return jsonify({"status": "done", "email": user.email, "key": secret, "key_id": record.id,
                    "project": record.project, "base_url": editors.gateway_url(s.runtime) + "/v1"})


def provider_buttons() -> list[tuple[str, str]]:
    """(name, label) of each identity provider, for the sign-in page."""
    return [(p.name, p.label) for p in site().providers.values()]


def signed_in_through(user: accounts.User) -> list[tuple[str, float, list[str]]]:
    """The person's page: each provider they sign in through, when last, and what its groups changed."""
    return identities.changes_of(site().engine, user.id)
