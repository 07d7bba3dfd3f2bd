"""The request id: one per request a gateway worker answers, so a client's error can be found in the log.

The id goes back in `X-Request-Id` on every response, ends the message of
every error object and stream error event (`(request id ID)`), and ends every
log line written while the request is served (`request_id=ID`). A client
quotes it; an operator greps for it. Errors say what happened in plain words
and name no host, port or replica: the log line beside them keeps the detail.

The id is held in a context variable. gevent gives each greenlet its own
context, and a worker serves each connection in one greenlet (a streamed
body is iterated there too), so the variable is the request's for as long as
it is served; a greenlet spawned from it starts with none. Reading it costs
nothing until something is logged or an error is rendered.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re

from llmgw.gateway.forwarded import TrustedProxies

HEADER = "X-Request-Id"
# What a proxy's id may look like to be kept: nginx's $request_id is 32 hex
# characters, a UUID 36; anything longer or odder could forge log lines.
SANE = re.compile(r"[A-Za-z0-9._-]{1,64}")

current: contextvars.ContextVar[str | None] = contextvars.ContextVar("llmgw_request_id", default=None)


def begin(environ: dict, proxies: TrustedProxies) -> str:
    """The id of the request in ENVIRON, made current: a trusted proxy's own, if it sent a sane one, else new.

    A proxy in `gateway.trusted_proxies` may have given the request an id
    already (and logged it); keeping it lets one id follow the request
    through both. Anyone else's is replaced, so a client cannot make its
    requests look like another's in the log.
    """
    offered = environ.get("HTTP_X_REQUEST_ID")
    if offered and SANE.fullmatch(offered) and proxies.trusts(environ.get("REMOTE_ADDR")):
        rid = offered
    else:
        rid = os.urandom(8).hex()
    current.set(rid)
    return rid


class LogFilter(logging.Filter):
    """Ends each log line written while a request is served with ` request_id=ID`."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = current.get()
        # A record that passes two handlers is tagged once.
        if rid is not None and not hasattr(record, "request_id"):
            try:
                message = record.getMessage()
            except Exception:
                return True  # a malformed call: the handler reports it when it formats the record
            record.request_id = rid
            record.msg = f"{message} request_id={rid}"
            record.args = None
        return True


def install_log_filter() -> None:
    """Tag the log lines of this process's requests: put the filter on every handler of the root logger."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, LogFilter) for f in handler.filters):
            handler.addFilter(LogFilter())
