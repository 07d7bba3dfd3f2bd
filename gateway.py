"""The gateway: the OpenAI API, the pages, /health and /ready, under gunicorn with gevent workers.

    python gateway.py [--config FILE] [--listen :8080] [--workers 2] [--endpoint ID=URL=MODEL[,MODEL]]...

Wiring only: read the configuration, bring the store's schema up to date, give
prometheus-client its directory, run gunicorn. What happens to a request is in
llmgw/gateway/proxy.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile

import click

from llmgw import filemodes, keyfiles, settings, store
from llmgw.gateway.masterstate import MasterState
from llmgw.people import sessions
from llmgw.procs import raise_fd_limit
from llmgw.web import oidc
from llmgw.wire.curve import ClientKeys


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", envvar="LLMGW_CONFIG", type=click.Path(dir_okay=False),
              help="TOML configuration file (also $LLMGW_CONFIG).")
@click.option("--listen", help="Address for the API and pages, HOST:PORT [gateway.listen: :8080].")
@click.option("--workers", type=int, help="gunicorn worker processes [gateway.workers: 2].")
@click.option("--metrics-listen", help="Address for Prometheus metrics [gateway.metrics_listen].")
@click.option("--store", "store_url", help="Database URL [store.url]; @/path reads it from a file.")
@click.option("--endpoint", "endpoints", multiple=True, metavar="ID=URL=MODEL[,MODEL]",
              help="A replica to route to (repeatable); added to the file's [[endpoints]].")
def main(config_path, listen, workers, metrics_listen, store_url, endpoints):
    """Run the llmgw gateway."""
    try:
        cfg = settings.load(config_path, {"gateway.listen": listen, "gateway.workers": workers,
                                          "gateway.metrics_listen": metrics_listen, "store.url": store_url},
                            endpoints)
        filemodes.check_roles(cfg, "gateway")
        # Made here, before any worker is forked, so a start that cannot use it fails once, saying why.
        sessions.ensure_secret(sessions.secret_path(cfg))
        # Each worker reads the identity providers' client secrets as it starts; one missing fails here, once.
        for provider in cfg.identity_providers:
            oidc.read_client_secret(provider["client_secret_file"])
    except (settings.ConfigError, OSError) as e:
        raise click.ClickException(str(e)) from None
    logging.basicConfig(level=cfg["log.level"].upper(), format="%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("llmgw.gateway")
    try:
        engine = store.open_engine(cfg["store.url"])
        applied = store.migrate(engine)
        engine.dispose()
    except store.NewerSchema as e:
        raise click.ClickException(f"cannot open the store {store.describe(cfg['store.url'])}: {e}") from None
    except Exception as e:
        raise click.ClickException(f"cannot open the store {store.describe(cfg['store.url'])}: {e}. "
                                   "Check store.url, and that the database is running.") from None
    if applied:
        log.info("store %s: applied migrations %s", store.describe(cfg["store.url"]), applied)
    try:
        import gunicorn_h1c  # noqa: F401  (the workers parse request heads with it: llmgw/gateway/server.py)
    except ImportError:
        # gunicorn looks for it at each request, not at start: without it every request would get a 500.
        raise click.ClickException("gunicorn's C parser (gunicorn_h1c), which the gateway parses requests with, is "
                                   "not installed: pip install gunicorn_h1c (built from source where PyPI has no "
                                   "wheel for this machine, so it needs a C compiler).") from None
    limit = raise_fd_limit()
    if limit < 2 * cfg["gateway.worker_connections"] + 64:
        log.warning("open files are limited to %d: each stream holds two, so a worker holds at most about %d "
                    "streams. Raise the limit (LimitNOFILE= in the systemd unit, ulimit -n).", limit, limit // 2)
    state = MasterState()
    if cfg["gateway.controller"]:
        if cfg["gateway.plaintext"]:
            log.warning("gateway.plaintext is set: this gateway follows the controller WITHOUT encryption or a key, "
                        "and believes whoever answers on %s. Use it only on a closed test network.",
                        ", ".join(cfg["gateway.controller"]))
        else:
            try:
                keys = keyfiles.read_gateway_key_file(cfg["gateway.key_file"])
            except keyfiles.KeyFileError as e:
                raise click.ClickException(str(e)) from None
            state.controller_keys = ClientKeys(keys["controller_public_key"].encode(), keys["public_key"].encode(),
                                               keys["secret_key"].encode())
            log.info("following the controller at %s as gateway %s (CURVE)", " or ".join(cfg["gateway.controller"]),
                     keys["gateway"])
    if not cfg.endpoints and not cfg["gateway.controller"]:
        log.warning("no endpoints are configured and no controller is followed: /ready stays 503. Give "
                    "gateway.controller, --endpoint ID=URL=MODEL or [[endpoints]] in the configuration.")
    # prometheus-client reads this once, when first imported: it has to be set
    # before the server module (and its workers) import it.
    metrics_dir = tempfile.mkdtemp(prefix="llmgw-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    master = os.getpid()
    try:
        from llmgw.control import standin
        from llmgw.gateway.server import GatewayServer
        from llmgw.people import keys
        from llmgw.web.app import GatewayApp

        GatewayServer(cfg, state, key_source=keys, standin=standin.run, make_app=GatewayApp).run()
    finally:
        # Workers are forked inside run() and leave through here too. One stopped alone (SIGTERM, SIGQUIT)
        # removed the directory under the master and the other workers: its replacement failed to boot
        # (exit code 3) and took the whole gateway down.
        if os.getpid() == master:
            shutil.rmtree(metrics_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
