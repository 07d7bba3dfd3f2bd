"""The controller: agents connect here, and `llmgw ctl` manages the fleet through its admin API.

    python controller.py [--config FILE] [--agent-listen :7443] [--admin-listen 127.0.0.1:9090]

Wiring only: options, configuration, the store, the CURVE keys, the agents'
ROUTER, the gateways' sockets, the admin API and fleet metrics are built here
and handed to the loop (llmgw/control/loop.py), which serves until SIGTERM sets
a flag and then closes them. What a node is and how its state ages is in
llmgw/control/fleet.py; the wire is in llmgw/control/agentserver.py.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

import click
import zmq
from prometheus_client import CollectorRegistry
from werkzeug.serving import make_server

from llmgw import addresses, filemodes, keyfiles, settings, store
from llmgw.control import adminapi, adminnodes, authenticator, curvekeys, fabricmaps, seals
from llmgw.control.accountant import Accountant
from llmgw.control.accountparts import AccountParts
from llmgw.control.accountserver import AccountServer
from llmgw.control.adminparts import Parts
from llmgw.control.agentserver import AgentServer
from llmgw.control.autoscale import Scaler
from llmgw.control.catalog import Catalog, CatalogError, source_checks
from llmgw.control.fleet import Fleet
from llmgw.control.fleetmetrics import FleetCollector
from llmgw.control.lease import TRUSTED, Lease
from llmgw.control.loop import ControlLoop, Outbox, ReconcileReport
from llmgw.control.publisher import DemandInbox, KeyPusher, Publisher
from llmgw.control.reconciler import Demand, Replicas
from llmgw.metricsserver import serve_registry
from llmgw.people.keeping import Sweeper
from llmgw.people.rollup import Roller

log = logging.getLogger("llmgw.controller")

@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", envvar="LLMGW_CONFIG", type=click.Path(dir_okay=False),
              help="TOML configuration file (also $LLMGW_CONFIG).")
@click.option("--agent-listen", help="Where agents connect [controller.agent_listen: :7443].")
@click.option("--admin-listen", help="The admin API for llmgw ctl [controller.admin_listen: 127.0.0.1:9090].")
@click.option("--metrics-listen", help="Fleet metrics [controller.metrics_listen: 127.0.0.1:9091].")
@click.option("--gateway-listen", help="Routing snapshots for gateways [controller.gateway_listen: 127.0.0.1:7444].")
@click.option("--store", "store_url", help="Database URL [store.url]; @/path reads it from a file.")
def main(config_path, agent_listen, admin_listen, metrics_listen, gateway_listen, store_url):
    """Run the llmgw controller."""
    try:
        cfg = settings.load(config_path, {"controller.agent_listen": agent_listen,
                                          "controller.admin_listen": admin_listen,
                                          "controller.metrics_listen": metrics_listen,
                                          "controller.gateway_listen": gateway_listen, "store.url": store_url})
        filemodes.check_roles(cfg, "controller")
    except settings.ConfigError as e:
        raise click.ClickException(str(e)) from None
    logging.basicConfig(level=cfg["log.level"].upper(),
                        format="%(asctime)s [%(process)d] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per `llmgw ctl` call
    logging.getLogger("apscheduler").setLevel(logging.WARNING)  # nor per reconcile pass
    try:
        engine = store.open_store(cfg["store.url"])
    except Exception as e:
        raise click.ClickException(f"cannot open the store {store.describe(cfg['store.url'])}: {e}") from None

    plaintext = cfg["controller.plaintext"]
    context = zmq.Context()
    if plaintext:
        log.warning("controller.plaintext is set: agents and gateways connect WITHOUT encryption or keys; any "
                    "machine that reaches %s can claim to be any node, and any that reaches %s or %s can read "
                    "snapshots, spend or refund budgets. Use it only on a closed test network.",
                    cfg["controller.agent_listen"], cfg["controller.gateway_listen"],
                    cfg["controller.accountant_listen"])
        ring, gateway_ring, keypair, public, auth = None, None, None, None, None
    else:
        keypair = keyfiles.controller_keypair(cfg["controller.keys_dir"])
        public = keypair[0]
        ring = authenticator.KeyRing(curvekeys.authorised_keys(engine), "node",
                                     reload=lambda: curvekeys.authorised_keys(engine))
        gateway_ring = authenticator.KeyRing(curvekeys.gateway_keys(engine), "gateway",
                                             reload=lambda: curvekeys.gateway_keys(engine))
        auth = authenticator.Authenticator(context, {authenticator.AGENTS: ring, authenticator.GATEWAYS: gateway_ring}).start()
        log.info("agents and gateways authenticate with CURVE; %d node keys and %d gateway keys issued",
                 len(ring.keys), len(gateway_ring.keys))
    # Each socket gateways use admits only gateway keys (or anyone, in plaintext mode).
    gateway_keys = None if plaintext else (keypair, authenticator.GATEWAYS)

    if cfg["controller.lease_renew_interval"] >= cfg["controller.lease_ttl"] * TRUSTED:
        raise click.ClickException(
            f"controller.lease_renew_interval ({cfg['controller.lease_renew_interval']:g} s) must be shorter than "
            f"{TRUSTED:.0%} of controller.lease_ttl ({cfg['controller.lease_ttl']:g} s), the part of it a leader "
            f"trusts, or the leader loses its lease between renewals (in {cfg.source})")
    lease = Lease(engine, cfg["controller.address"] or addresses.advertised(cfg["controller.agent_listen"],
                                                                             "controller.agent_listen"),
                  cfg["controller.lease_ttl"], cfg["controller.lease_renew_interval"])

    # Nodes with issued keys are the ones that may be running replicas; in plaintext any node may.
    def expected_nodes() -> set[str] | None:
        return set(ring.keys.values()) if ring is not None else None

    fleet = Fleet(cfg["controller.unreachable_after"], cfg["controller.lost_after"],
                  cordoned=adminnodes.cordoned_nodes(engine), started=time.monotonic(), expected=expected_nodes())
    try:
        egress = source_checks(cfg["controller.source_allow"], cfg["mirror.base_url"])
        catalog = Catalog(engine, cfg.models)
    except CatalogError as e:
        raise click.ClickException(f"{e} (in {cfg.source})") from None
    replicas = Replicas(base_backoff=cfg["controller.base_backoff"],
                        seal_key=seals.key_of(keypair[1]) if keypair is not None else None)
    server = AgentServer(context, cfg["controller.agent_listen"], fleet, ring, keypair,
                         heartbeat_interval=cfg["agent.heartbeat_interval"], replicas=replicas, lease=lease,
                         models=catalog.models)
    publisher = Publisher(context, cfg["controller.gateway_listen"], gateway_keys)

    # The accountant is made when this controller comes to lead; a standby answers no gateway.
    parts = cfg["controller.accountant_parts"]

    def restored_accountant() -> Accountant:
        # Spend is rebuilt from the store's usage rows; rate windows and open reservations start empty.
        accountant = Accountant()
        accountant.restore(engine, 0, parts)
        return accountant

    # The accountant is made when this controller comes to lead; a standby answers no gateway. Its other parts,
    # if any, are processes of their own (llmgw/control/accountparts.py).
    account_server = AccountParts(
        AccountServer(Accountant(), cfg["controller.accountant_listen"], context, gateway_keys, lease=lease,
                      fresh=restored_accountant), parts,
        {"store_url": cfg["store.url"], "keys_dir": None if plaintext else cfg["controller.keys_dir"],
         "listen": cfg["controller.accountant_listen"], "log_level": cfg["log.level"]}, lease).start()
    roller = Roller(engine, cfg["usage.rollup_interval"], cfg["usage.keep_raw_days"], leading=lease.held).start()
    sweeper = Sweeper(engine, cfg["threads.sweep_every"], leading=lease.held).start()
    demand = Demand()
    scaler = Scaler(cfg["controller.scale_up_after"], cfg["controller.scale_down_after"])
    inbox = DemandInbox(context, cfg["controller.demand_listen"], gateway_keys)
    key_pusher = KeyPusher(engine, publisher.epoch)
    outbox = Outbox(server)
    report = ReconcileReport()
    maps = fabricmaps.Maps()
    # The admin API's token is made here on the first start, beside the CURVE keys; llmgw ctl reads it there.
    app = adminapi.create_app(Parts(fleet, engine, catalog, replicas, report, outbox.ask_node,
                                    adminapi.Access.from_config(cfg), egress, plaintext=plaintext, ring=ring,
                                    gateway_ring=gateway_ring, controller_public=public, lease=lease,
                                    scaler=scaler, maps=maps))

    admin = make_server(*addresses.bind(cfg["controller.admin_listen"], "controller.admin_listen"), app,
                        threaded=True)
    registry = CollectorRegistry()
    registry.register(FleetCollector(fleet, replicas, catalog.models, lease.held))
    registry.register(server)
    registry.register(inbox)
    registry.register(account_server)  # the messages it dropped
    registry.register(lease)  # whether this controller leads
    serve_registry(cfg["controller.metrics_listen"], registry)
    log.info("agents on %s, gateways on %s, the accountant on %s, admin API on http://%s, metrics on http://%s/metrics",
             cfg["controller.agent_listen"], cfg["controller.gateway_listen"], cfg["controller.accountant_listen"],
             cfg["controller.admin_listen"], cfg["controller.metrics_listen"])

    def reload_keys() -> None:
        # Keys issued or revoked through the other controller are in the store only.
        if ring is not None:
            ring.replace(curvekeys.authorised_keys(engine))
            gateway_ring.replace(curvekeys.gateway_keys(engine))

    def on_lead() -> None:
        # What this controller knew while standing by is stale: it starts as a restarted controller does,
        # learning the replicas from the agents that register with it, and waiting for them before it places.
        reload_keys()
        fleet.begin(time.monotonic(), adminnodes.cordoned_nodes(engine), expected_nodes())
        replicas.clear()
        demand.clear()
        scaler.clear()
        catalog.reload()

    loop = ControlLoop(context=context, engine=engine, auth=auth, fleet=fleet, catalog=catalog, replicas=replicas,
                       demand=demand, server=server, outbox=outbox, inbox=inbox, key_pusher=key_pusher,
                       publisher=publisher, account_server=account_server, housekeepers=(roller, sweeper),
                       admin=admin,
                       report=report, reconcile_interval=cfg["controller.reconcile_interval"], lease=lease,
                       renew_interval=cfg["controller.lease_renew_interval"], on_lead=on_lead,
                       on_standby=reload_keys, scaler=scaler, maps=maps)

    # The lease is first tried now that every socket is bound: a start that failed took none, and a lease
    # held under the agents' address, where this controller now listens, can only be its own. The admin API
    # answers from then on, saying leader or standby.
    if not lease.renew():
        log.info("standing by: %s leads; this controller takes over if its lease runs out",
                 lease.leader or "another controller")
    threading.Thread(target=admin.serve_forever, name="admin-api", daemon=True).start()
    # Handlers only set a flag: the loop notices within one poll.
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    try:
        loop.run(stopping)
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
