"""Running the gateway under gunicorn with gevent workers.

gunicorn is driven from Python (a `BaseApplication`), so `python gateway.py`
is the whole command and settings come from llmgw's own configuration. The
app is built inside each worker, after gevent has patched it: with
`preload_app` the master would import ssl and sockets unpatched. The master
serves the summed Prometheus metrics and tells prometheus-client when a
worker dies; a stopping worker writes its buffered usage before it exits.
Each worker tags the log lines written while it serves a request with that
request's id.
"""

from __future__ import annotations

import logging

from gunicorn.app.base import BaseApplication

from llmgw import addresses
from llmgw.settings import Config

log = logging.getLogger("llmgw.server")


def bind_address(listen: str, setting: str) -> str:
    return addresses.join(*addresses.bind(listen, setting))


def _when_ready(server) -> None:
    from llmgw.gateway import metrics

    cfg = server.app.llmgw_cfg
    listen = cfg["gateway.metrics_listen"]
    metrics.serve(listen)
    log.info("metrics on http://%s/metrics", bind_address(listen, "gateway.metrics_listen"))
    if not cfg["gateway.controller"]:
        _run_accountant(cfg)


def _run_accountant(cfg: Config) -> None:
    """Without a controller, the master holds the accountant, so its workers share every limit, and
    rolls up usage. It runs before any worker is forked; each worker learns the accountant's address
    from the configuration it inherits."""
    import zmq

    from llmgw import store
    from llmgw.control.accountant import Accountant
    from llmgw.control.accountserver import AccountServer
    from llmgw.control.curvekeys import Authenticator, KeyRing
    from llmgw.people.rollup import Roller
    from llmgw.wire.curve import ClientKeys

    accountant = Accountant()
    engine = store.open_engine(cfg["store.url"])
    accountant.restore(engine)
    # Nobody else sums usage without a controller; the master's thread does, on its own engine.
    Roller(engine, cfg["usage.rollup_interval"], cfg["usage.keep_raw_days"]).start()
    # CURVE with keys made now and known only to this master and the workers it forks: no other process on
    # the machine can spend, refund or read a pool, loopback or not.
    server_keys, worker_keys = zmq.curve_keypair(), zmq.curve_keypair()
    context = zmq.Context()
    Authenticator(context, {"llmgw-workers": KeyRing({worker_keys[0]: "workers"}, "gateway worker")}).start()
    server = AccountServer(accountant, cfg["gateway.accountant_listen"], context,
                           (server_keys, "llmgw-workers")).start()
    cfg.local_accountant_keys = ClientKeys(server_keys[0], *worker_keys)
    host = addresses.parse(cfg["gateway.accountant_listen"], "gateway.accountant_listen", free_port=True)[0]
    cfg.local_accountant = addresses.join(addresses.dial_host(host), server.port)
    log.info("the accountant for this gateway's limits is on %s", cfg.local_accountant)


def _child_exit(server, worker) -> None:
    from llmgw.gateway import metrics

    metrics.worker_gone(worker.pid)


def _post_worker_init(worker) -> None:
    from llmgw.gateway import requestid

    requestid.install_log_filter()
    if worker.app.llmgw_cfg["store.url"].startswith("postgresql"):
        from llmgw.gateway.greendb import make_psycopg2_green

        make_psycopg2_green()


def _worker_exit(server, worker) -> None:
    app = getattr(worker, "wsgi", None)
    if app is not None and hasattr(app, "close"):
        app.close()


class GatewayServer(BaseApplication):
    def __init__(self, cfg: Config):
        self.llmgw_cfg = cfg
        super().__init__()

    def load_config(self) -> None:
        cfg = self.llmgw_cfg
        settings = {
            "bind": [bind_address(cfg["gateway.listen"], "gateway.listen")],
            "workers": cfg["gateway.workers"],
            "worker_class": "gevent",
            "worker_connections": cfg["gateway.worker_connections"],
            "graceful_timeout": cfg["gateway.graceful_timeout"],
            # Clients such as the openai library keep connections open between
            # requests; gunicorn's 2 s default would close them under them.
            "keepalive": 75,
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
        }
        for name, value in settings.items():
            self.cfg.set(name, value)

    def load(self):
        from llmgw.gateway.webapp import GatewayApp

        return GatewayApp(self.llmgw_cfg).start()
