"""What a gateway's master runs when no controller is followed: the accountant its workers share, roll-ups and the
conversations' sweep.

Imported only by `gateway.py`, which hands `run` to the gateway's gunicorn
master; it runs there in threads, before any worker is forked.
"""

from __future__ import annotations

import logging

import zmq

from llmgw import addresses, store
from llmgw.control.accountant import Accountant
from llmgw.control.accountserver import AccountServer
from llmgw.control.authenticator import Authenticator, KeyRing
from llmgw.people.keeping import Sweeper
from llmgw.people.rollup import Roller
from llmgw.settings import Config
from llmgw.wire.curve import ClientKeys

log = logging.getLogger("llmgw.standin")


def run(cfg: Config) -> tuple[str, ClientKeys]:
    """Without a controller, the master holds the accountant, so its workers share every limit, and
    rolls up usage. It runs before any worker is forked: the accountant's address and the keys its
    workers dial it with, which the master keeps for the workers it forks."""
    accountant = Accountant()
    engine = store.open_engine(cfg["store.url"])
    accountant.restore(engine)
    # Nobody else sums usage without a controller; the master's thread does, on its own engine.
    Roller(engine, cfg["usage.rollup_interval"], cfg["usage.keep_raw_days"]).start()
    Sweeper(engine, cfg["threads.sweep_every"]).start()
    # CURVE with keys made now and known only to this master and the workers it forks: no other process on
    # the machine can spend, refund or read a pool, loopback or not.
    server_keys, worker_keys = zmq.curve_keypair(), zmq.curve_keypair()
    context = zmq.Context()
    Authenticator(context, {"llmgw-workers": KeyRing({worker_keys[0]: "workers"}, "gateway worker")}).start()
    server = AccountServer(accountant, cfg["gateway.accountant_listen"], context,
                           (server_keys, "llmgw-workers")).start()
    host = addresses.parse(cfg["gateway.accountant_listen"], "gateway.accountant_listen", free_port=True)[0]
    address = addresses.join(addresses.dial_host(host), server.port)
    log.info("the accountant for this gateway's limits is on %s", address)
    return address, ClientKeys(server_keys[0], *worker_keys)
