"""`llmgw ctl`: the operator's commands for the fleet, spoken to the controller's admin API.

Tables for people, `--json` for scripts. The controller is found at
`controller.admin_listen` from the same configuration (`--config`), or
`--admin URL`. When it does not answer, the error says where it looked.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import click


class Admin:
    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            with e:
                try:
                    message = json.loads(e.read())["error"]
                except (ValueError, KeyError):
                    message = f"HTTP {e.code}"
            raise click.ClickException(message) from None
        except OSError as e:
            raise click.ClickException(f"the controller's admin API does not answer at {self.url} ({e}). "
                                       "Is controller.py running on this machine? Give --admin URL otherwise.") from None


def table(rows: list[tuple]) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip())


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


@click.group()
@click.option("--admin", "admin_url", help="The controller's admin API [http://controller.admin_listen].")
@click.pass_context
def ctl(ctx, admin_url):
    """Manage the fleet through the controller."""
    if not admin_url:
        listen = ctx.obj.config()["controller.admin_listen"]
        host, _, port = listen.rpartition(":")
        admin_url = f"http://{host if host not in ('', '0.0.0.0') else '127.0.0.1'}:{port}"
    ctx.obj.admin = Admin(admin_url)


@ctl.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def status(obj, as_json):
    """How many nodes are in each state."""
    result = obj.admin.call("GET", "/api/v1/status")
    if as_json:
        click.echo(json.dumps(result))
        return
    counts = result["nodes"]
    total = sum(counts.values())
    parts = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    click.echo(f"{total} nodes{': ' + parts if parts else ''}")
    if result["plaintext"]:
        click.echo("warning: agents connect without keys (controller.plaintext)", err=True)


@ctl.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per node.")
@click.pass_obj
def nodes(obj, as_json):
    """The nodes: state, when last heard, CPU, memory, disk, GPUs."""
    result = obj.admin.call("GET", "/api/v1/nodes")["nodes"]
    if as_json:
        for node in result:
            click.echo(json.dumps(node))
        return
    if not result:
        click.echo("no node has registered yet; start agent.py on a node with this controller's address", err=True)
        return
    rows = [("NODE", "STATE", "LAST SEEN", "ADDRESS", "CPUS", "MEMORY", "DISK FREE", "GPUS")]
    for n in result:
        facts, status_ = n["facts"], n["status"]
        memory = {**facts.get("memory", {}), **status_.get("memory", {})}
        disk = {**facts.get("disk", {}), **status_.get("disk", {})}
        gpus = facts.get("gpus")
        gpu_text = ("?" if gpus is None else
                    ", ".join(f"{g.get('class', g.get('name'))}" for g in gpus) or "none")
        flags = facts.get("cpu", {}).get("flags")
        cpus = str(facts.get("cpu", {}).get("count", "?")) + ("" if flags is None or "avx2" in flags or "asimd" in flags
                                                            else " (no AVX2)")
        rows.append((n["node_id"], n["state"], f"{n['last_heard_s']:.0f}s ago", facts.get("address") or "-",
                     cpus, _bytes(memory.get("total_bytes")), _bytes(disk.get("free_bytes")), gpu_text))
    table(rows)


@ctl.command()
@click.argument("node")
@click.pass_obj
def cordon(obj, node):
    """Place nothing new on NODE (what runs there stays)."""
    obj.admin.call("POST", f"/api/v1/nodes/{node}/cordon")
    click.echo(f"cordoned {node}: nothing new is placed there; `llmgw ctl uncordon {node}` undoes it", err=True)


@ctl.command()
@click.argument("node")
@click.pass_obj
def uncordon(obj, node):
    """Let placement use NODE again."""
    obj.admin.call("POST", f"/api/v1/nodes/{node}/uncordon")
    click.echo(f"uncordoned {node}", err=True)


@ctl.group("node")
def node_group():
    """Nodes: remove a lost one."""


@node_group.command("remove")
@click.argument("node")
@click.pass_obj
def node_remove(obj, node):
    """Forget NODE, which must be lost (silent for controller.lost_after)."""
    obj.admin.call("DELETE", f"/api/v1/nodes/{node}")
    click.echo(f"removed {node}", err=True)


@ctl.group("node-key")
def node_key():
    """CURVE keys that let a node connect."""


@node_key.command("issue")
@click.argument("node")
@click.pass_obj
def node_key_issue(obj, node):
    """Make NODE's key pair and authorise it; prints the key file (on standard output) for that node."""
    result = obj.admin.call("POST", "/api/v1/node-keys", {"node_id": node})
    click.echo(result["key_file"], nl=False)
    if sys.stdout.isatty():
        click.echo("", err=True)
    click.echo(f"issued a key for {node}. Install it on the node as agent.key_file (default /etc/llmgw/node.key), "
               "mode 0600. Any earlier key of this node no longer works.", err=True)
