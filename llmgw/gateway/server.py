"""Running the gateway under gunicorn with gevent workers.

gunicorn is driven from Python (a `BaseApplication`), so `python gateway.py`
is the whole command and settings come from llmgw's own configuration. The
app is built inside each worker, after gevent has patched it: with
`preload_app` the master would import ssl and sockets unpatched. The master
serves the summed Prometheus metrics and tells prometheus-client when a
worker dies; a stopping worker writes its buffered usage before it exits. The
master marks the store as used by this gateway from its start to its clean
stop (llmgw/gateway/presence.py), which `llmgw store move` waits for.
Each worker tags the log lines written while it serves a request with that
request's id. The worker class is gunicorn's gevent worker with every read
from a client bounded in time and connections counted per address
(llmgw/gateway/connguard.py).
"""

from __future__ import annotations

import logging

from gunicorn.app.base import BaseApplication

from llmgw import addresses
from llmgw.gateway.masterstate import MasterState
from llmgw.settings import Config

log = logging.getLogger("llmgw.server")

# Seconds the master waits beyond gateway.graceful_timeout before it kills a stopping worker. The worker lets
# requests drain for the graceful timeout itself (noticing the signal up to 1 s late, then taking 1 s to close
# what remains), then stops its greenlets (2 s) and writes or spools its usage (worker.CLOSE_WRITE_LIMIT, 5 s).
# With one timeout for both, a worker whose streams ran to the limit was killed holding its usage rows.
USAGE_CLOSE_MARGIN = 10


def bind_address(listen: str, setting: str) -> str:
    return addresses.join(*addresses.bind(listen, setting))


def _when_ready(server) -> None:
    from llmgw.gateway import metrics

    cfg = server.app.llmgw_cfg
    listen = cfg["gateway.metrics_listen"]
    metrics.serve(listen)
    log.info("metrics on http://%s/metrics", bind_address(listen, "gateway.metrics_listen"))
    state = server.app.state
    if cfg["gateway.controller"]:
        _keep_the_last_word(cfg, state)
    else:
        state.local_accountant, state.local_accountant_keys = server.app.standin(cfg)
    from llmgw.gateway import presence

    presence.mark(cfg["store.url"], cfg["gateway.listen"])  # before any worker is forked


def _on_exit(server) -> None:
    from llmgw.gateway import presence

    cfg = server.app.llmgw_cfg
    presence.remove(cfg["store.url"], cfg["gateway.listen"])  # the workers wrote their usage: the store is free


def _keep_the_last_word(cfg: Config, state: MasterState) -> None:
    """The master follows the controller too, in a thread, keeping its latest snapshot and keys in
    `state.last_word`. A worker forked later (a crashed one replaced) inherits them with the rest of the
    master's memory, so it serves at once: waiting for the controller's next message cost 610 failed
    requests over 3 worker kills. Replacing a dict entry needs no lock, and no lock may be held at fork."""
    import threading

    import zmq

    from llmgw.gateway.follower import follow
    from llmgw.gateway.keytable import HeldKeys, KeyTable

    def keep_snapshot(message: dict, host: str) -> None:
        state.last_word["snapshot"] = (message, host)
        state.last_word.pop("leading", None)  # a whole snapshot is the later word on the addresses

    held = HeldKeys(KeyTable({}, -1), say=False)  # as a worker holds its keys, from none; the workers say what they keep

    def keep_keys(message: dict) -> None:
        held.whole(message)
        keep()

    def keep_key_changes(message: dict) -> None:
        held.changes(message)
        keep()

    def keep() -> None:
        # With whether it is trusted: a worker forked later takes changes on it at once only if so.
        if held.table.revision >= 0:
            state.last_word["keys"] = (held.table, held.trusted)

    def keep_leading(message: dict, host: str) -> None:
        state.last_word["leading"] = (message, host)

    def snapshot_held() -> tuple[str, int] | None:
        kept = state.last_word.get("snapshot")
        return None if kept is None else (kept[0].get("epoch"), kept[0]["version"])

    # Its own context, never the green singleton the workers make after fork.
    threading.Thread(target=follow, name="last-word", daemon=True,
                     args=(cfg["gateway.controller"], state.controller_keys, keep_snapshot, keep_keys, keep_leading,
                           zmq.Context()),
                     kwargs={"on_key_changes": keep_key_changes, "keys_held": held.holds,
                             "snapshot_held": snapshot_held}).start()


def _child_exit(server, worker) -> None:
    from llmgw.gateway import metrics

    metrics.worker_gone(worker.pid)


def _post_worker_init(worker) -> None:
    from llmgw.gateway import requestid

    requestid.install_log_filter()
    # The worker drains for the graceful timeout alone; the master's is longer by USAGE_CLOSE_MARGIN.
    worker.cfg.set("graceful_timeout", worker.app.llmgw_cfg["gateway.graceful_timeout"])
    if worker.app.llmgw_cfg["store.url"].startswith("postgresql"):
        from llmgw.gateway.greendb import make_psycopg2_green

        make_psycopg2_green()


def _worker_exit(server, worker) -> None:
    app = getattr(worker, "wsgi", None)
    if app is not None and hasattr(app, "close"):
        app.close()


class GatewayServer(BaseApplication):
    def __init__(self, cfg: Config, state: MasterState, key_source, standin, make_app):
        """KEY_SOURCE reads keys from the store (`current_revision(engine)`, `key_set(engine)`): at a
        worker's start, and, without a controller, when they change. STANDIN(cfg) runs in the master
        before any worker is forked when no controller is followed: the accountant its workers share.
        STATE is what the master learns as it starts, which its workers inherit (llmgw/gateway/masterstate.py).
        MAKE_APP(cfg, key_source, state) makes a worker's WSGI app (llmgw/web/app.py, which mounts the pages).
        All are handed in by gateway.py, so this package never imports the people, control or web code."""
        self.llmgw_cfg = cfg
        self.state = state
        self.key_source = key_source
        self.standin = standin
        self.make_app = make_app
        super().__init__()

    def load_config(self) -> None:
        cfg = self.llmgw_cfg
        settings = {
            "bind": [bind_address(cfg["gateway.listen"], "gateway.listen")],
            "workers": cfg["gateway.workers"],
            # gunicorn's gevent worker, with bounded reads and connections per address.
            "worker_class": "llmgw.gateway.connguard.GuardedWorker",
            "worker_connections": cfg["gateway.worker_connections"],
            "graceful_timeout": cfg["gateway.graceful_timeout"] + USAGE_CLOSE_MARGIN,
            # Clients such as the openai library keep connections open between
            # requests; gunicorn's 2 s default would close them under them. An
            # idle connection is closed after this, or sooner when its address
            # or its worker needs the room (llmgw/gateway/connguard.py).
            "keepalive": 75,
            # gunicorn's C parser for request heads (gunicorn_h1c, picohttpparser), never the Python parser
            # unseen: gateway.py refuses to start without it ("fast" alone would answer every request 500).
            "http_parser": "fast",
            "backlog": 4096,
            # gunicorn 27 otherwise opens one control socket per user, shared
            # by every instance on the machine.
            "control_socket_disable": True,
            # gunicorn believes X-Forwarded-Proto from 127.0.0.1 by default;
            # llmgw decides whom to believe (gateway.trusted_proxies), so
            # gunicorn must believe nobody.
            "forwarded_allow_ips": "",
            "secure_scheme_headers": {},
            "proc_name": "llmgw-gateway",
            "loglevel": cfg["log.level"],
            "errorlog": "-",
            "accesslog": None,
            "when_ready": _when_ready,
            "child_exit": _child_exit,
            "post_worker_init": _post_worker_init,
            "worker_exit": _worker_exit,
            "on_exit": _on_exit,
        }
        for name, value in settings.items():
            self.cfg.set(name, value)

    def load(self):
        return self.make_app(self.llmgw_cfg, self.key_source, self.state).start()
