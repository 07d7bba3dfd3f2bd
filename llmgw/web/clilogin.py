"""`llmgw login`'s side of the gateway: a key for a person, made without a password, two ways.

The device flow, where the identity provider offers it: `POST /login/device` starts the provider's device
authorization and answers the code to show and a handle (the device code stays here); `POST
/login/device/poll` with the handle answers `pending` until the person has confirmed at the provider, then
makes the key once (the row is deleted as it is made). Starting one is throttled per address, as sign-ups
are, and a handle asked about sooner than DEVICE_INTERVAL is told to slow down without the provider being
asked (it counts questions against the client every sign-in shares).

The browser on the person's computer, as RFC 8252 has native apps do it (`llmgw login --browser`, and where
the provider has no device flow): the command listens on a loopback port and opens `/login/cli` with that
port, the S256 challenge of a verifier it keeps, and a state. The person signs in as on any page (a
provider, or a password), sees a page that names the command's confirmation words (its port and the
challenge's first characters, which the command printed too: a local user who started a listener of their
own and sent the link would show other words) and makes the key with a button; the browser is sent to the command's port
with a one-time code, which only the verifier redeems (`POST /login/cli/token`) within CODE_SECONDS.

Either way the key expires after `auth.login_key_lifetime`, and belongs to the person (or to a project
they are a member of, where the command names one).
"""

from __future__ import annotations

import hmac
import logging
import re
import secrets
import time

import flask_login
import sqlalchemy as sa
from flask import Blueprint, abort, jsonify, render_template, request

from llmgw import pkce, store
from llmgw.people import accounts, identities, keys
from llmgw.principals import hash_secret
from llmgw.web import editors, forms, oidc, oidcpages, safety
from llmgw.web.site import EXPIRED_FORM, site

bp = Blueprint("clilogin", __name__)
log = logging.getLogger("llmgw.oidc")

FLOW_SECONDS = 600.0  # a device code is good for at most this long here
DEVICE_INTERVAL = 5  # seconds between polls, where the provider does not say more
MOST_DEVICE_FLOWS = 10_000  # device sign-ins under way at once; past it new ones wait
CODE_SECONDS = 120.0  # from the button to the command redeeming the code
BROWSER = "browser"  # sign_in_flows.provider of a browser's one-time code
CHALLENGE = re.compile(r"[A-Za-z0-9_-]{43}")  # S256 of a verifier, base64url without padding
STATE = re.compile(r"[A-Za-z0-9_-]{16,128}")


def _json_refusal(text: str, status: int):
    """A refusal as the CLI's client reads one."""
    return jsonify({"error": text}), status


def _small_json() -> dict:
    """The request's JSON object, when it is one of under 4 KiB; else an empty one."""
    if not request.content_length or request.content_length >= 4096:
        return {}
    body = request.get_json(silent=True)
    return body if isinstance(body, dict) else {}


def _project(value) -> str | None:
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 300):
        raise ValueError("A project is named by its path, such as acme/research/chat.")
    return value


def _issue(user: accounts.User, project: str | None, how: str):
    """The key for USER (in PROJECT, or personal), as the command reads it; or its refusal."""
    s = site()
    try:
        record, secret = keys.create_key(s.engine, f"llmgw login ({time.strftime('%Y-%m-%d', time.gmtime())})",
                                         project, user_id=user.id, made_by=user.id, member_only=True,
                                         expires_in=s.cfg["auth.login_key_lifetime"] or None)
    except keys.KeyRefused as e:
        return _json_refusal(s.sentence(e), 403)
    log.info("%s got a key from llmgw login (%s): %s in %s", user.email, how, record.prefix, record.project)
    return jsonify({"status": "done", "email": user.email, "key": secret, "key_id": record.id,
                    "project": record.project, "expires_at": record.expires_at,
                    "base_url": editors.gateway_url(s.runtime) + "/v1"})


def _take(key: str, browser: bool = False):
    """The device flow kept as KEY (with BROWSER, the browser's code), deleted as it is read; None when there is
    none of that kind, or another request took it first. Of the one kind only: a state's used-once marker is
    never taken for a code."""
    f = store.sign_in_flows
    kind = f.c.provider == BROWSER if browser else f.c.device_code.is_not(None)
    with store.writing(site().engine) as conn:
        row = conn.execute(f.select().where(sa.and_(f.c.id == key, kind))).first()
        if row is None or not conn.execute(f.delete().where(f.c.id == key)).rowcount:
            return None
    return row


# --- the device flow -------------------------------------------------------------------------------------

@bp.post("/login/device")
def device_start():
    s = site()
    body = _small_json()
    if not s.providers:
        return _json_refusal("This gateway signs nobody in through an identity provider; llmgw login --browser "
                             "signs you in with your password on the pages instead.", 501)
    name = body.get("provider") or (next(iter(s.providers)) if len(s.providers) == 1 else None)
    if name is None:  # several: the sign-in page offers each, so the browser it is
        return _json_refusal(f"This gateway signs in through {len(s.providers)} identity providers "
                             f"({', '.join(sorted(s.providers))}); choose one in the browser, or with --provider.",
                             501)
    if not isinstance(name, str) or name not in s.providers:
        return _json_refusal(f"Say which identity provider to sign in with (--provider): "
                             f"{', '.join(sorted(s.providers))}.", 400)
    try:
        project = _project(body.get("project"))
    except ValueError as e:
        return _json_refusal(str(e), 400)
    refused = s.throttle.sign_up(s.proxies.client(request.environ), time.monotonic())
    if refused:
        return _json_refusal(refused, 429)
    provider = s.providers[name]
    try:
        started = provider.start_device()
    except oidc.NoDeviceFlow as e:
        return _json_refusal(str(e), 501)
    except oidc.Refused as e:
        return _json_refusal(str(e), 502)
    handle = secrets.token_urlsafe(32)
    given = started.get("expires_in")
    lasts = min(float(given), FLOW_SECONDS) if isinstance(given, (int, float)) and given > 0 else FLOW_SECONDS
    interval = started.get("interval")
    interval = interval if isinstance(interval, int) and DEVICE_INTERVAL <= interval < 60 else DEVICE_INTERVAL
    now = time.time()
    f = store.sign_in_flows
    with store.writing(s.engine) as conn:
        conn.execute(f.delete().where(f.c.expires_at < now))
        if conn.execute(sa.select(sa.func.count()).select_from(f).where(f.c.device_code.is_not(None))).scalar_one() \
                >= MOST_DEVICE_FLOWS:
            return _json_refusal("Too many sign-ins are under way here just now; try again in a few minutes.", 503)
        conn.execute(f.insert().values(id=hash_secret(handle), provider=name, device_code=started["device_code"],
                                       project=project, polled_at=now, created_at=now, expires_at=now + lasts))
    return jsonify({"handle": handle, "provider": name, "label": provider.label, "user_code": started["user_code"],
                    "verification_uri": started["verification_uri"],
                    "verification_uri_complete": started.get("verification_uri_complete"),
                    "expires_in": int(lasts), "interval": interval})


@bp.post("/login/device/poll")
def device_poll():
    s = site()
    handle = _small_json().get("handle")
    if not isinstance(handle, str) or not handle:
        return _json_refusal("Send the handle /login/device gave.", 400)
    f = store.sign_in_flows
    key, now = hash_secret(handle), time.time()
    with store.writing(s.engine) as conn:
        row = conn.execute(f.select().where(f.c.id == key)).first()
        if row is None or row.device_code is None or row.expires_at <= now or row.provider not in s.providers:
            return _json_refusal("This sign-in is over (finished, or expired); run llmgw login again.", 410)
        if now - (row.polled_at or 0) < DEVICE_INTERVAL:
            return jsonify({"status": "pending", "slow_down": True}), 202
        conn.execute(f.update().where(f.c.id == key).values(polled_at=now))
    provider = s.providers[row.provider]
    try:
        claims = provider.claims(provider.poll_device(row.device_code), None)
    except oidc.Pending as e:
        return jsonify({"status": "pending", "slow_down": e.slow_down}), 202
    except oidc.Refused as e:
        _take(key)
        oidcpages.counted(row.provider, "provider_failed")
        return _json_refusal(str(e), 403)
    if _take(key) is None:
        return _json_refusal("This sign-in is over (finished, or expired); run llmgw login again.", 410)
    outcome = identities.sign_in(s.engine, provider.entry, claims, s.cfg["gateway.sign_ups_pending"])
    oidcpages.counted(row.provider, outcome.result)
    if outcome.refusal is not None:
        return _json_refusal(outcome.refusal, 403)
    return _issue(outcome.user, row.project, f"device flow at {row.provider}")


# --- the browser on the person's computer ------------------------------------------------------------------

def _asked() -> tuple[int, str, str, str | None]:
    """What the command asked for in /login/cli's query or form: its port, challenge, state and project; 400
    when any is not what a command sends."""
    values = request.values
    port, challenge, state = values.get("port", ""), values.get("challenge", ""), values.get("state", "")
    try:
        project = _project(values.get("project") or None)
    except ValueError:
        abort(400)
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and 1024 <= int(port) <= 65535
            and CHALLENGE.fullmatch(challenge) and STATE.fullmatch(state)):
        abort(400)
    return int(port), challenge, state, project


@bp.get("/login/cli")
@flask_login.login_required
def browser_ask():
    port, challenge, state, project = _asked()
    return render_template("cli_login.html", port=port, challenge=challenge, state=state, project=project,
                           words=pkce.confirmation_words(port, challenge), form=site().form(forms.ActionForm),
                           me=flask_login.current_user.user)


@bp.post("/login/cli")
@flask_login.login_required
def browser_give():
    s = site()
    if not s.form(forms.ActionForm, request.form).validate():
        abort(400, EXPIRED_FORM)
    port, challenge, state, project = _asked()
    code, now = secrets.token_urlsafe(32), time.time()
    f = store.sign_in_flows
    with store.writing(s.engine) as conn:
        conn.execute(f.delete().where(f.c.expires_at < now))
        conn.execute(f.insert().values(id=hash_secret(code), provider=BROWSER, project=project, challenge=challenge,
                                       user_id=flask_login.current_user.user.id, created_at=now,
                                       expires_at=now + CODE_SECONDS))
    safety.no_store()
    back = f"http://127.0.0.1:{port}/?code={code}&state={state}"
    return render_template("cli_login_done.html", back=back)


@bp.post("/login/cli/token")
def browser_token():
    body = _small_json()
    code, verifier = body.get("code"), body.get("verifier")
    if not (isinstance(code, str) and isinstance(verifier, str) and 43 <= len(verifier) <= 128
            and verifier.isascii()):
        return _json_refusal("Send the code the browser brought and the verifier of its challenge.", 400)
    row = _take(hash_secret(code), browser=True)
    if row is None or row.expires_at <= time.time():
        return _json_refusal("This code is used or expired; run llmgw login again.", 410)
    if not hmac.compare_digest(pkce.challenge_of(verifier), row.challenge or ""):
        log.warning("llmgw login --browser: a code was brought with the wrong verifier; it is spent")
        return _json_refusal("This code was not made for this command; run llmgw login again.", 403)
    user = accounts.get(site().engine, row.user_id)
    if user is None or user.state != accounts.ACTIVE:
        return _json_refusal("This account cannot have keys now; ask an operator.", 403)
    return _issue(user, row.project, "browser")
