"""Signing in through an identity provider: the browser's redirect and callback, and `llmgw login`'s device flow.

The browser: `/login/oidc/NAME` makes a state, a nonce and a PKCE verifier, keeps them in the session (the
signed cookie; a few sign-ins begun in other tabs are kept beside each other), writes nothing to the store,
and sends the person to the provider. `/login/oidc/NAME/callback` takes them back out of the session by the
state the provider returns, so a link carrying someone else's code and state finds nothing in this browser
(login CSRF), and records the state as used (a `sign_in_flows` row kept for FLOW_SECONDS) before anything
else, so it is good once whatever copies of the cookie or the URL exist. Then the code is redeemed, the ID
token checked (llmgw/web/oidc.py), the person found, linked or made and their groups applied
(llmgw/people/identities.py), and a session begun that lasts at most `auth.provider_session_lifetime`.

`llmgw login`: `POST /login/device` starts the provider's device authorization and answers the code to show
and a handle (the device code stays here); `POST /login/device/poll` with the handle answers `pending`
until the person has confirmed at the provider, then makes a key for them once (the row is deleted as it
is made), expiring after `auth.login_key_lifetime`, and answers its secret. Starting one is throttled per
address, as sign-ups are, and a handle asked about sooner than the interval is told to slow down without
the provider being asked.

Every refusal is a page (or, for the CLI, JSON) in fixed words, never the provider's or the URL's text, and
a log line with the detail.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time

import sqlalchemy as sa
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from flask import Blueprint, abort, jsonify, redirect, render_template, request, session

from llmgw import store
from llmgw.people import identities, keys
from llmgw.principals import hash_secret
from llmgw.web import editors, oidc, safety
from llmgw.web.site import site

bp = Blueprint("oidc", __name__)
log = logging.getLogger("llmgw.oidc")

FLOW_SECONDS = 600.0  # a person has this long at the provider's pages
BEGUN_AT_ONCE = 3  # sign-ins begun in one browser and not finished, kept in its session (other tabs)
DEVICE_INTERVAL = 5  # seconds between polls, where the provider does not say
MOST_DEVICE_FLOWS = 10_000  # device sign-ins under way at once; past it new ones wait
MOST_NEXT = 2048  # characters of the page to go back to


def _provider(name: str) -> oidc.Provider:
    provider = site().providers.get(name)
    if provider is None:
        abort(404)
    return provider


def _callback_url(name: str) -> str:
    return f"{editors.gateway_url(site().runtime)}/login/oidc/{name}/callback"


def _refused(text: str, status: int = 400):
    return render_template("message.html", title="Not signed in", text=text), status


def _same(a: str, b: str) -> bool:
    """Whether A and B are equal, in constant time; any text (a state from a URL may be anything)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


@bp.get("/login/oidc/<name>")
def begin(name):
    provider = _provider(name)
    state, nonce, verifier = (secrets.token_urlsafe(32) for _ in range(3))
    nxt = safety.local_path(request.args.get("next"))
    try:
        url = provider.authorize_url(_callback_url(name), state, nonce, create_s256_code_challenge(verifier))
    except oidc.Refused as e:
        return _refused(str(e), 502)
    begun = [b for b in session.get("oidc", []) if b["at"] > time.time() - FLOW_SECONDS][-(BEGUN_AT_ONCE - 1):]
    session["oidc"] = [*begun, {"state": state, "nonce": nonce, "verifier": verifier, "provider": name,
                                "next": nxt if nxt and len(nxt) <= MOST_NEXT else "/account", "at": time.time()}]
    return redirect(url)


def _take_begun(name: str, state: str) -> dict | None:
    """The sign-in this browser began with STATE at provider NAME, taken out of its session; None if none."""
    begun = session.get("oidc", [])
    found = next((b for b in begun if _same(b["state"], state)), None)
    if found is None:
        return None
    session["oidc"] = [b for b in begun if b is not found]
    if found["provider"] != name or found["at"] <= time.time() - FLOW_SECONDS:
        return None
    return found


def _used_once(name: str, state: str) -> bool:
    """Record STATE as used; False when it was already (the same answer replayed)."""
    now = time.time()
    f = store.sign_in_flows
    try:
        with store.writing(site().engine) as conn:
            conn.execute(f.delete().where(f.c.expires_at < now))
            conn.execute(f.insert().values(id=hash_secret(state), provider=name, created_at=now,
                                           expires_at=now + FLOW_SECONDS))
    except sa.exc.IntegrityError:
        return False
    return True


@bp.get("/login/oidc/<name>/callback")
def callback(name):
    s = site()
    provider = _provider(name)
    state = request.args.get("state", "")
    begun = _take_begun(name, state) if state else None
    if request.args.get("error"):
        log.info("sign-in through %s ended at the provider: %r %r", name, request.args["error"][:60],
                 request.args.get("error_description", "")[:200])
        return _refused(f"{provider.label} did not sign you in. Sign in again, or ask an operator if it goes on.")
    if begun is None:
        log.warning("sign-in through %s refused: its state is not one this browser began, or it took too long", name)
        return _refused(f"This sign-in was not begun in this browser, was finished already, or took longer than "
                        f"{FLOW_SECONDS / 60:g} minutes. Sign in with {provider.label} again.")
    if not _used_once(name, state):
        log.warning("sign-in through %s refused: its state was used already", name)
        return _refused(f"This sign-in was finished already. Sign in with {provider.label} again.")
    try:
        tokens = provider.redeem_code(request.args.get("code", "")[:4096], _callback_url(name), begun["verifier"])
        claims = provider.claims(tokens, begun["nonce"])
    except oidc.Refused as e:
        return _refused(str(e))
    except oidc.Pending:
        return _refused(f"{provider.label} did not finish the sign-in; try again.")
    outcome = identities.sign_in(s.engine, provider.entry, claims, s.cfg["gateway.sign_ups_pending"])
    if outcome.refusal is not None:
        log.info("sign-in through %s of %r: %s", name, claims.email, outcome.refusal)
        return _refused(outcome.refusal, 403)
    s.begin_session(outcome.user, provider=name)
    return redirect(begun["next"])


# --- `llmgw login` ----------------------------------------------------------------------------------

def _json_refusal(text: str, status: int):
    """A refusal as the CLI's client reads one."""
    return jsonify({"error": text}), status


@bp.post("/login/device")
def device_start():
    s = site()
    body = _small_json()
    name = body.get("provider") or (next(iter(s.providers)) if len(s.providers) == 1 else None)
    if not s.providers:
        return _json_refusal("This gateway signs nobody in through an identity provider; ask an operator for a key.",
                             404)
    if not isinstance(name, str) or name not in s.providers:
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
    given = started.get("expires_in")
    lasts = min(float(given), FLOW_SECONDS) if isinstance(given, (int, float)) and given > 0 else FLOW_SECONDS
    interval = started.get("interval")
    interval = interval if isinstance(interval, int) and 0 < interval < 60 else DEVICE_INTERVAL
    now = time.time()
    f = store.sign_in_flows
    with store.writing(s.engine) as conn:
        conn.execute(f.delete().where(f.c.expires_at < now))
        if conn.execute(sa.select(sa.func.count()).select_from(f)).scalar_one() >= MOST_DEVICE_FLOWS:
            return _json_refusal("Too many sign-ins are under way here just now; try again in a few minutes.", 503)
        conn.execute(f.insert().values(id=hash_secret(handle), provider=name, device_code=started["device_code"],
                                       project=project, polled_at=now, created_at=now, expires_at=now + lasts))
    return jsonify({"handle": handle, "provider": name, "label": provider.label, "user_code": started["user_code"],
                    "verification_uri": started["verification_uri"],
                    "verification_uri_complete": started.get("verification_uri_complete"),
                    "expires_in": int(lasts), "interval": interval})


def _small_json() -> dict:
    """The request's JSON object, when it is one of under 4 KiB; else an empty one."""
    if not request.content_length or request.content_length >= 4096:
        return {}
    body = request.get_json(silent=True)
    return body if isinstance(body, dict) else {}


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
        # One question to the provider per interval, however often the handle is sent: the provider counts them
        # against the client every sign-in shares.
        if now - (row.polled_at or 0) < DEVICE_INTERVAL:
            return jsonify({"status": "pending", "slow_down": True}), 202
        conn.execute(f.update().where(f.c.id == key).values(polled_at=now))
    provider = s.providers[row.provider]
    try:
        claims = provider.claims(provider.poll_device(row.device_code), None)
    except oidc.Pending as e:
        return jsonify({"status": "pending", "slow_down": e.slow_down}), 202
    except oidc.Refused as e:
        _forget(key)
        return _json_refusal(str(e), 403)
    if not _forget(key):
        return _json_refusal("This sign-in is over (finished, or expired); run llmgw login again.", 410)
    outcome = identities.sign_in(s.engine, provider.entry, claims, s.cfg["gateway.sign_ups_pending"])
    if outcome.refusal is not None:
        return _json_refusal(outcome.refusal, 403)
    user = outcome.user
    try:
        record, secret = keys.create_key(s.engine, f"llmgw login ({time.strftime('%Y-%m-%d', time.gmtime())})",
                                         row.project, user_id=user.id, made_by=user.id, member_only=True,
                                         expires_in=s.cfg["auth.login_key_lifetime"] or None)
    except keys.KeyRefused as e:
        return _json_refusal(s.sentence(e), 403)
    log.info("%s signed in through %s with llmgw login: key %s made in %s", user.email, row.provider,
             record.prefix, record.project)
    return jsonify({"status": "done", "email": user.email, "key": secret, "key_id": record.id,
                    "project": record.project, "expires_at": record.expires_at,
                    "base_url": editors.gateway_url(s.runtime) + "/v1"})


def _forget(key: str) -> bool:
    """Delete the device flow kept as KEY; whether this call did (a second poll at once finds it gone)."""
    with store.writing(site().engine) as conn:
        return bool(conn.execute(store.sign_in_flows.delete().where(store.sign_in_flows.c.id == key)).rowcount)


def provider_buttons() -> list[tuple[str, str]]:
    """(name, label) of each identity provider, for the sign-in page."""
    return [(p.name, p.label) for p in site().providers.values()]
