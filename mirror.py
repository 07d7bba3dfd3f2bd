"""The model mirror: a directory of weights served on the local network.

    python mirror.py [--config FILE] [--dir var/models] [--listen :8081] [--api-listen :8082]

Files are served read-only to nodes (`mirror.listen`); the management API
(`mirror.api_listen`) fetches sources into MODEL/VERSION, lists, and removes,
for this machine and `mirror.api_allow` only, with the token it makes on its
first start (`mirror.token_file`). It is not a cache: it fetches only what it
is asked to. Wiring only: the directory is llmgw/mirror/store.py, fetching
llmgw/mirror/fetch.py, the HTTP faces llmgw/mirror/server.py.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

import click
from prometheus_client import CollectorRegistry
from werkzeug.serving import make_server

from llmgw import addresses, filemodes, settings
from llmgw.metricsserver import serve_registry
from llmgw.mirror.fetch import GiB, Manager
from llmgw.mirror.server import Access, MirrorCollector, api_app, files_app
from llmgw.mirror.store import MirrorDir

log = logging.getLogger("llmgw.mirror")


def base_url(cfg: settings.Config) -> str:
    """Where nodes reach the files: `mirror.base_url`, or this machine on `mirror.listen`."""
    if cfg["mirror.base_url"]:
        return cfg["mirror.base_url"].rstrip("/")
    host, port = addresses.parse(cfg["mirror.listen"], "mirror.listen")
    return f"http://{addresses.join(socket.gethostname() if host in addresses.WILDCARDS else host, port)}"


def _serve(listen: str, app, name: str):
    server = make_server(*addresses.bind(listen, "the mirror's address"), app, threaded=True)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", envvar="LLMGW_CONFIG", type=click.Path(dir_okay=False),
              help="TOML configuration file (also $LLMGW_CONFIG).")
@click.option("--dir", "directory", help="The models directory [mirror.dir: var/models].")
@click.option("--listen", help="Files for nodes [mirror.listen: :8081].")
@click.option("--api-listen", help="The management API [mirror.api_listen: :8082].")
@click.option("--base-url", "base_url_flag", help="The address nodes use for the files [mirror.base_url].")
@click.option("--metrics-listen", help="Prometheus metrics [mirror.metrics_listen: 127.0.0.1:9093].")
def main(config_path, directory, listen, api_listen, base_url_flag, metrics_listen):
    """Run the llmgw model mirror."""
    try:
        cfg = settings.load(config_path, {"mirror.dir": directory, "mirror.listen": listen,
                                          "mirror.api_listen": api_listen, "mirror.base_url": base_url_flag,
                                          "mirror.metrics_listen": metrics_listen})
        filemodes.check_roles(cfg, "mirror")
    except settings.ConfigError as e:
        raise click.ClickException(str(e)) from None
    logging.basicConfig(level=cfg["log.level"].upper(),
                        format="%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    root = cfg["mirror.dir"]
    os.makedirs(root, exist_ok=True)
    store = MirrorDir(root)
    if not store.readable():
        raise click.ClickException(f"{root} is not a directory this user can read")
    try:
        access = Access.from_config(cfg)  # the token made now, before anything answers
    except settings.ConfigError as e:
        raise click.ClickException(str(e)) from None
    base = base_url(cfg)
    manager = Manager(store, cfg["mirror.hf_endpoint"], local_sources=cfg["mirror.local_sources"],
                      fetch_allow=cfg["mirror.fetch_allow"], max_fetches=cfg["mirror.max_fetches"],
                      min_free=int(cfg["mirror.min_free_gb"] * GiB), convert_python=cfg["mirror.convert_python"])
    collector = MirrorCollector(manager)
    registry = CollectorRegistry()
    registry.register(collector)
    serve_registry(cfg["mirror.metrics_listen"], registry)
    files = _serve(cfg["mirror.listen"], files_app(store, base, collector), "mirror-files")
    api = _serve(cfg["mirror.api_listen"], api_app(manager, base, access), "mirror-api")
    who = (f"this machine and {', '.join(cfg['mirror.api_allow'])}" if cfg["mirror.api_allow"]
           else "this machine only")
    log.info("serving %s read-only on %s; management API on %s, for %s, with the token in %s; metrics on "
             "http://%s/metrics; catalog sources should point at %s", store.root, cfg["mirror.listen"],
             cfg["mirror.api_listen"], who, access.token_file, cfg["mirror.metrics_listen"], base)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    stopping.wait()
    files.shutdown()
    api.shutdown()
    log.info("mirror stopped")


if __name__ == "__main__":
    sys.exit(main())
