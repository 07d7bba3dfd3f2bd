"""What every page needs, held on the pages' app as Flask's own extensions hold theirs.

The app factory (llmgw/web/pages.py) makes one `Site` and keeps it in `app.extensions["llmgw"]`; a view
reaches it with `site()`. It holds the worker's runtime and store, the forms' CSRF secret, the sessions'
lifetimes, the sign-in throttle and the threads that hash passwords, and the helpers the page groups
share (a form for this session, what was wrong with a posted one, a session begun, an error as a sentence).
"""

from __future__ import annotations

import time

import flask_login
from flask import current_app, request, session
from gevent.threadpool import ThreadPool

from llmgw.gateway.forwarded import TrustedProxies
from llmgw.gateway.worker import Runtime
from llmgw.people import accounts, sessions
from llmgw.web import forms, oidc, throttle

EXPIRED_FORM = "The form expired or did not come from this page; reload the page and try again."
# Threads that hash passwords at once. scrypt lets go of the GIL, but each hash is 16 MiB and tens of ms of
# CPU: with gevent's ten default threads a burst of sign-ins took the CPU from the worker's event loop
# (/health stalled 1.3 s on a busy two-core machine); with two it stayed under 0.1 s, the rest queueing.
HASHING_THREADS = 2


class Person(flask_login.UserMixin):
    def __init__(self, user: accounts.User):
        self.user = user

    def get_id(self) -> str:
        return self.user.id


class Site:
    def __init__(self, runtime: Runtime, proxies: TrustedProxies, secret: str):
        cfg = runtime.cfg
        self.runtime = runtime
        self.engine = runtime.engine
        self.cfg = cfg
        self.proxies = proxies
        self.csrf_secret = secret.encode()
        self.lifetimes = sessions.Lifetimes(cfg["gateway.session_idle"], cfg["gateway.session_lifetime"])
        self.throttle = throttle.Throttle(
            throttle.Limits(cfg["gateway.sign_in_failures_per_account"], cfg["gateway.sign_in_failures_per_address"],
                            cfg["gateway.sign_in_window"], cfg["gateway.sign_ups_per_address"]),
            lambda limit: runtime.metrics.sign_in_throttled.labels(limit).inc())
        self.hashing = ThreadPool(HASHING_THREADS)
        # The identity providers people sign in through, by name, each with the worker's caches of what it said.
        self.providers = {e["name"]: oidc.Provider(e, cfg["auth.clock_skew"]) for e in cfg.identity_providers}
        self.provider_lifetime = min(cfg["auth.provider_session_lifetime"], cfg["gateway.session_lifetime"])

    def offload(self, function, *args):
        """Run FUNCTION (a password hash) in the hashing threads; this greenlet waits, the loop serves."""
        return self.hashing.apply(function, args)

    def form(self, form_class, data=None):
        """FORM_CLASS with DATA, its CSRF token bound to this session."""
        return forms.make(form_class, data, self.csrf_secret, session)

    def posted(self, form_class, missing: str | None = None):
        """FORM_CLASS for this request, and what is wrong with what was posted (None: nothing, or not a POST)."""
        f = self.form(form_class, request.form if request.method == "POST" else None)
        if request.method != "POST" or f.validate():
            return f, None
        if "csrf_token" in f.errors:
            return f, EXPIRED_FORM
        return f, missing or " ".join(e for errors in f.errors.values() for e in errors)

    def begin_session(self, user: accounts.User, provider: str | None = None) -> None:
        """Sign USER in; through PROVIDER (an identity provider's name), for at most its sessions' lifetime."""
        session.clear()  # a new session: one fixed before signing in is worth nothing
        flask_login.login_user(Person(user))
        session["sid"] = sessions.start(self.engine, user.id, self.lifetimes, provider,
                                        self.provider_lifetime if provider else None)
        if provider:
            session["via"] = provider

    def throttled(self, email: str, check):
        """CHECK of EMAIL's password (what it answers, or a str saying why not) under the throttle: every
        attempt counts, and past the limits the password is not checked at all."""
        address = self.proxies.client(request.environ)
        refused = self.throttle.begin(email, address, time.monotonic())
        if refused:
            return refused
        result = check()
        if not isinstance(result, str):
            self.throttle.succeeded(email, address, time.monotonic())
        return result

    @staticmethod
    def sentence(e: Exception) -> str:
        text = str(e)
        return text[:1].upper() + text[1:] + "."


def site() -> Site:
    """The pages' Site, for the app serving this request."""
    return current_app.extensions["llmgw"]
