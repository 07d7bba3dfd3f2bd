"""Signing in through an identity provider: the browser's redirect to it and its callback.

The browser: `/login/oidc/NAME` makes a state, a nonce and a PKCE verifier, keeps them in the session (the
signed cookie; a few sign-ins begun in other tabs are kept beside each other), writes nothing to the store,
and sends the person to the provider. `/login/oidc/NAME/callback` takes them back out of the session by the
state the provider returns, so a link carrying someone else's code and state finds nothing in this browser
(login CSRF), and records the state as used (a `sign_in_flows` row kept for FLOW_SECONDS) before anything
else, so it is good once whatever copies of the cookie or the URL exist. Then the code is redeemed, the ID
token checked (llmgw/web/oidc.py), the person found, linked or made and their groups applied
(llmgw/people/identities.py), and a session begun that lasts at most `auth.provider_session_lifetime`.

`llmgw login`'s side is llmgw/web/clilogin.py.

Every refusal is a page in fixed words, never the provider's or the URL's text, and
a log line with the detail.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time

import sqlalchemy as sa
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from flask import Blueprint, abort, redirect, render_template, request, session

from llmgw import store
from llmgw.people import identities
from llmgw.principals import hash_secret
from llmgw.web import editors, oidc, safety
from llmgw.web.site import site

bp = Blueprint("oidc", __name__)
log = logging.getLogger("llmgw.oidc")

FLOW_SECONDS = 600.0  # a person has this long at the provider's pages
BEGUN_AT_ONCE = 3  # sign-ins begun in one browser and not finished, kept in its session (other tabs)
MOST_NEXT = 256  # characters of the page to go back to: the session cookie carries it, and must stay small


def _provider(name: str) -> oidc.Provider:
    provider = site().providers.get(name)
    if provider is None:
        abort(404)
    return provider


def _callback_url(name: str) -> str:
    return f"{editors.gateway_url(site().runtime)}/login/oidc/{name}/callback"


def _refused(text: str, status: int = 400):
    return render_template("message.html", title="Not signed in", text=text), status


def counted(provider: str, result: str) -> None:
    """Count a sign-in through PROVIDER by RESULT (`llmgw_provider_sign_ins_total`)."""
    site().runtime.metrics.provider_sign_ins.labels(provider, result).inc()


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
        counted(name, "provider_failed")
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
    address = s.proxies.client(request.environ)
    throttled = s.throttle.callback(address, time.monotonic())
    if throttled:
        return _refused(throttled, 429)
    state = request.args.get("state", "")
    begun = _take_begun(name, state) if state else None
    if request.args.get("error"):
        log.info("sign-in through %s ended at the provider: %r %r", name, request.args["error"][:60],
                 request.args.get("error_description", "")[:200])
        counted(name, "refused")
        return _refused(f"{provider.label} did not sign you in. Sign in again, or ask an operator if it goes on.")
    if begun is None:
        log.warning("sign-in through %s refused: its state is not one this browser began, or it took too long", name)
        counted(name, "refused")
        return _refused(f"This sign-in was not begun in this browser, was finished already, or took longer than "
                        f"{FLOW_SECONDS / 60:g} minutes. Sign in with {provider.label} again.")
    if not _used_once(name, state):
        log.warning("sign-in through %s refused: its state was used already", name)
        counted(name, "refused")
        return _refused(f"This sign-in was finished already. Sign in with {provider.label} again.")
    try:
        tokens = provider.redeem_code(request.args.get("code", "")[:4096], _callback_url(name), begun["verifier"])
        claims = provider.claims(tokens, begun["nonce"])
    except (oidc.Refused, oidc.Pending) as e:
        counted(name, "provider_failed")
        return _refused(str(e) if isinstance(e, oidc.Refused) else
                        f"{provider.label} did not finish the sign-in; try again.")
    outcome = identities.sign_in(s.engine, provider.entry, claims, s.cfg["gateway.sign_ups_pending"])
    counted(name, outcome.result)
    if outcome.refusal is not None:
        log.info("sign-in through %s of %r: %r", name, claims.email, outcome.refusal)
        return _refused(outcome.refusal, 403)
    s.throttle.callback_finished(address)
    s.begin_session(outcome.user, provider=name)
    return redirect(begun["next"])


def provider_buttons() -> list[tuple[str, str]]:
    """(name, label) of each identity provider, for the sign-in page."""
    return [(p.name, p.label) for p in site().providers.values()]
