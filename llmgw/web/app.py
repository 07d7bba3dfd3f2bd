"""The gateway's WSGI application: `/v1` to the proxy, probes answered at once, pages to Flask.

It lives with the pages because it mounts them: `gateway.py` hands it to the gateway's server, so
nothing in llmgw/gateway/ imports the pages. Made once in each worker, after gevent has patched it
(gunicorn's `load`).
Every request is given its id here, before it is dispatched, and every
response leaves with it in `X-Request-Id` (see llmgw/gateway/requestid.py).
"""

from __future__ import annotations

from llmgw import store
from llmgw.gateway import requestid
from llmgw.gateway.errors import ApiError
from llmgw.gateway.forwarded import TrustedProxies
from llmgw.gateway.masterstate import MasterState
from llmgw.gateway.proxy import Proxy
from llmgw.gateway.snapshot import from_config
from llmgw.gateway.worker import Runtime
from llmgw.settings import Config
from llmgw.web import chatpage, pages

NOT_READY = b"not ready: no replica is in rotation\n"


class GatewayApp:
    def __init__(self, cfg: Config, key_source, state: MasterState | None = None):
        """KEY_SOURCE reads keys from the store (llmgw.people.keys, handed in by gateway.py); STATE: what the
        gateway's master learnt as it started (none for an app made alone, as the tests make one)."""
        state = state if state is not None else MasterState()
        self.runtime = Runtime(cfg, from_config(cfg, state.local_accountant), store.open_engine(cfg["store.url"]),
                               key_source, state)
        self.proxy = Proxy(self.runtime)
        self.proxies = TrustedProxies(cfg["gateway.trusted_proxies"])
        self.pages = pages.create_app(self.runtime, self.proxies)

    def start(self) -> "GatewayApp":
        self.runtime.start()
        return self

    def close(self) -> None:
        self.runtime.close()

    def __call__(self, environ, start_response):
        rid = requestid.begin(environ, self.proxies)

        def respond(status, headers, *exc_info):
            return start_response(status, [*headers, (requestid.HEADER, rid)], *exc_info)

        return self._dispatch(environ, respond)

    def _dispatch(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path.startswith("/v1/"):
            return self.proxy(environ, start_response)
        if path == "/health":
            start_response("200 OK", [("Content-Length", "0")])
            return [b""]
        if path == "/ready":
            if self.runtime.router.ready():
                start_response("200 OK", [("Content-Length", "0")])
                return [b""]
            start_response("503 Service Unavailable", [("Content-Type", "text/plain"),
                                                       ("Content-Length", str(len(NOT_READY)))])
            return [NOT_READY]
        self.proxies.apply(environ)
        if path == "/chat/completions" and environ.get("REQUEST_METHOD") == "POST":
            return self._chat(environ, start_response)
        return self.pages(environ, start_response)

    def _chat(self, environ, start_response):
        """A chat page request: the signed-in person's, through the same pipeline as the API's."""
        try:
            caller = chatpage.caller_for(self.pages, self.runtime, environ)
        except ApiError as e:
            return chatpage.error_response(e, start_response)
        environ["PATH_INFO"] = "/v1/chat/completions"
        return self.proxy(environ, start_response, caller)
