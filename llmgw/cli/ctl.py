"""`llmgw ctl`: the operator's commands for the fleet, spoken to the controller's admin API.

Tables for people, `--json` for scripts. The controller is found at
`controller.admin_listen` from the same configuration (`--config`), or
`--admin URL`, and its token in the same configuration (`admin.token` in
`controller.keys_dir`, or `controller.admin_token`). When it does not answer,
the error says where it looked.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.parse

import click

from llmgw.apiclient import ApiClient, ApiError, admin_client, segment
from llmgw.cli import filters
from llmgw.cli.bench import bench, capacity
from llmgw.cli.tables import print_table, printable
from llmgw.units import human_bytes


class Admin:
    """The controller's admin API, its errors as click's."""

    def __init__(self, client: ApiClient):
        self.client = client

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 30) -> dict:
        try:
            return self.client.call(method, path, body, timeout=timeout)
        except ApiError as e:
            raise click.ClickException(printable(e)) from None  # the server's sentence, shown inert


@click.group()
@click.option("--admin", "admin_url", help="The controller's admin API [http://controller.admin_listen].")
@click.pass_context
def ctl(ctx, admin_url):
    """Manage the fleet through the controller."""
    cfg = ctx.obj.config()
    ctx.obj.admin = Admin(admin_client(cfg, admin_url or cfg["controller.admin_listen"],
                                       "Is controller.py running on this machine? Give --admin URL otherwise."))


ctl.add_command(bench)
ctl.add_command(capacity)


@ctl.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def status(obj, as_json):
    """How many nodes are in each state, and whether this controller leads."""
    result = obj.admin.call("GET", "/api/v1/status")
    if as_json:
        click.echo(json.dumps(result))
        return
    if result.get("role") == "standby":
        click.echo(f"standby: this controller does not lead; the leader is {printable(result['leader'] or 'not known yet')}")
        return
    counts = result["nodes"]
    total = sum(counts.values())
    parts = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    click.echo(printable(f"{total} nodes{': ' + parts if parts else ''}"))
    if result.get("leader"):
        click.echo(f"leader: this controller ({printable(result['leader'])})")
    if result["plaintext"]:
        click.echo("warning: agents connect without keys (controller.plaintext)", err=True)


@ctl.command()
@click.option("--fabric", help="Only nodes on this fabric.")
@click.option("--class", "gpu_class", help="Only nodes with a GPU of this class (such as h100-80g).")
@click.option("--state", help="Only nodes in this state (its start is enough: `cord` for cordoned).")
@click.option("--label", "labels", multiple=True, metavar="KEY[=VALUE]",
              help="Only nodes with this label (any value, or this one); may be given again, all must match.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per node.")
@click.pass_obj
def nodes(obj, fabric, gpu_class, state, labels, as_json):
    """The nodes: state, when last heard, CPU, memory, disk, GPUs."""
    wanted = filters.NodeFilter(fabric, gpu_class, state, tuple(filters.labels_wanted(labels)))
    everyone = obj.admin.call("GET", "/api/v1/nodes")["nodes"]
    result = [n for n in everyone if wanted.matches(n)]
    if as_json:
        for node in result:
            click.echo(json.dumps(node))
        return
    if not everyone:
        click.echo("no node has registered yet; start agent.py on a node with this controller's address", err=True)
        return
    if not result:
        click.echo(filters.no_matches("nodes", wanted.describe(), len(everyone)), err=True)
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
        rows.append((n["node_id"], n["state"], f"{n['last_heard_s']:.0f}s ago",
                     # Where its connection comes from, which its engines are on; an older controller's: what it said.
                     n.get("address") or facts.get("address") or "-",
                     cpus, human_bytes(memory.get("total_bytes")), human_bytes(disk.get("free_bytes")), gpu_text))
    print_table(rows)
    _print_installs(result)


def _print_installs(result: list[dict]) -> None:
    """Under the nodes' table, each engine install under way or failed (llmgw/node/installer.py): a node's
    reason for not being used yet, and what to do."""
    for n in result:
        installs = n["status"].get("installs", n["facts"].get("installs")) or {}
        for key, install in sorted(installs.items()):
            if install.get("state") == "installing":
                done, total = install.get("bytes_done"), install.get("bytes_total")
                fetched = "" if done is None else f", {human_bytes(done)}" + (f" of {human_bytes(total)}" if total else "")
                click.echo(printable(f"{n['node_id']}: installing engine {key} ({install.get('detail', 'starting')}{fetched})"))
            elif install.get("state") == "failed":
                click.echo(printable(f"{n['node_id']}: installing engine {key} failed: {install.get('detail')}"))
                click.echo(printable(f"  fix: {install.get('fix')}"))


@ctl.command()
@click.argument("node")
@click.pass_obj
def cordon(obj, node):
    """Place nothing new on NODE (what runs there stays)."""
    obj.admin.call("POST", f"/api/v1/nodes/{segment(node)}/cordon")
    click.echo(f"cordoned {node}: nothing new is placed there; `llmgw ctl uncordon {node}` undoes it", err=True)


@ctl.command()
@click.argument("node")
@click.pass_obj
def uncordon(obj, node):
    """Let placement use NODE again."""
    obj.admin.call("POST", f"/api/v1/nodes/{segment(node)}/uncordon")
    click.echo(f"uncordoned {node}", err=True)


@ctl.command()
@click.argument("node")
@click.pass_obj
def drain(obj, node):
    """Move NODE's replicas elsewhere, one at a time, each stopped only once its replacement is ready."""
    obj.admin.call("POST", f"/api/v1/nodes/{segment(node)}/drain")
    click.echo(f"draining {node}: `llmgw ctl replicas` shows the moves; `llmgw ctl uncordon {node}` ends it",
               err=True)


@ctl.group("node")
def node_group():
    """Nodes: remove one."""


@node_group.command("remove")
@click.argument("node")
@click.option("--force", is_flag=True, help="Remove it even while it is connected: stop its replicas, revoke its "
                                           "key and end its session now.")
@click.pass_obj
def node_remove(obj, node, force):
    """Forget NODE, which must be lost (silent for controller.lost_after), unless --force."""
    if not force:
        obj.admin.call("DELETE", f"/api/v1/nodes/{segment(node)}")
        click.echo(f"removed {node}", err=True)
        return
    result = obj.admin.call("DELETE", f"/api/v1/nodes/{segment(node)}?force=1")
    click.echo(f"removed {node}: its key is revoked and its session ended; {len(result['stopped'])} replicas "
               "stopped there, the rest of the fleet takes their place.", err=True)
    if result["unconfirmed"]:
        click.echo(f"warning: {node} did not confirm stopping {printable(', '.join(result['unconfirmed']))}; their engines "
                   "may still run there, unrouted. On that machine, stop the agent and its engines.", err=True)
    click.echo(f"To add it back: `llmgw ctl node-key issue {node}` and install the key there.", err=True)


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
               "mode 0600, and restart its agent. Any earlier key of this node no longer works, and a session "
               "it holds is ended now.", err=True)


@node_key.command("revoke")
@click.argument("node")
@click.pass_obj
def node_key_revoke(obj, node):
    """Withdraw NODE's key: its session ends now, it cannot connect again, and its replicas are replaced elsewhere."""
    obj.admin.call("DELETE", f"/api/v1/node-keys/{segment(node)}")
    click.echo(f"revoked {node}'s key: its session is refused from now on and its replicas leave the gateways' "
               f"snapshot. Its engines are not told to stop: `llmgw ctl node remove --force {node}` stops them "
               "first, where the node still answers.", err=True)


@ctl.group("gateway-key")
def gateway_key():
    """CURVE keys that let a gateway follow the controller and use its accountant."""


@gateway_key.command("issue")
@click.argument("name")
@click.pass_obj
def gateway_key_issue(obj, name):
    """Make gateway NAME's key pair and authorise it; prints the key file (on standard output)."""
    result = obj.admin.call("POST", "/api/v1/gateway-keys", {"name": name})
    click.echo(result["key_file"], nl=False)
    click.echo(f"issued a key for gateway {name}. Install it on that gateway as gateway.key_file, mode 0600. "
               "Any earlier key of this gateway no longer works.", err=True)


@ctl.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per model.")
@click.pass_obj
def models(obj, as_json):
    """The catalog: each model, how many replicas serve it, and why not when none can be placed."""
    result = obj.admin.call("GET", "/api/v1/models")["models"]
    if as_json:
        for model in result:
            click.echo(json.dumps(model))
        return
    if not result:
        click.echo("the catalog is empty; add a model with `llmgw ctl model add -f model.toml`", err=True)
        return
    rows = [("MODEL", "SERVING", "REPLICAS", "SCALING", "ORIGIN", "ALIASES")]
    for m in result:
        rows.append((m["name"], m["ready"], m["replicas"], f"{m['scaling']['min']}-{m['scaling']['max']}",
                     m["origin"], ", ".join(m["aliases"]) or "-"))
    print_table(rows)
    for m in result:
        if m["unplaced"]:
            click.echo(f"\n{printable(m['name'])} cannot be placed:", err=True)
            for node, reason in m["unplaced"].items():
                click.echo(printable(f"  {node}: {reason}"), err=True)
        if m["last_failure"] and m["ready"] == 0:
            failure = m["last_failure"]
            click.echo("\n" + printable(f"{m['name']} failed on {failure['node']} ({failure['count']} in a row): "
                                        f"{failure['detail']}"), err=True)
            for line in failure["last_output"][-10:]:
                click.echo(f"  | {printable(line, tabs=True)}", err=True)


@ctl.command()
@click.option("--model", help="Only this model's replicas.")
@click.option("--node", help="Only replicas (or ranks of one) on this node.")
@click.option("--state", help="Only replicas in this state (its start is enough: `start` for starting).")
@click.option("--pool", help="Only replicas whose pool, FABRIC/CLASS of their node (ib-a/h100-80g, none/cpu), "
              "holds this.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per replica.")
@click.pass_obj
def replicas(obj, model, node, state, pool, as_json):
    """Every replica: where, in what state, downloading how much, and whether its profile is stale."""
    wanted = filters.ReplicaFilter(model, node, state, pool)
    everyone = obj.admin.call("GET", "/api/v1/replicas")["replicas"]
    fleet = {n["node_id"]: n for n in obj.admin.call("GET", "/api/v1/nodes")["nodes"]} if pool else {}
    result = [r for r in everyone if wanted.matches(r, fleet)]
    if as_json:
        for replica in result:
            click.echo(json.dumps(replica))
        return
    if not result:
        click.echo(filters.no_matches("replicas", wanted.describe(), len(everyone)) if everyone and not wanted.empty()
                   else "no replicas", err=True)
        return
    rows = [("REPLICA", "MODEL", "NODE", "STATE", "ENGINE", "URL")]
    for r in result:
        state = r["state"] + (" (stale profile)" if r["stale_profile"] else "")
        if r["state"] == "fetching" and r["fetch"]:
            done, total = r["fetch"].get("bytes_done", 0), r["fetch"].get("bytes_total")
            state += f" {human_bytes(done)}" + (f" of {human_bytes(total)}" if total else "")
        if r.get("restarts"):
            state += f" (restarted {r['restarts']}x)"
        if "rank" in r:
            state += f" (rank {r['rank']} of {r['ranks']})"
        rows.append((r["shard_id"], r["model"], r["node"], state, r["engine"] or "-", r["url"] or "-"))
    print_table(rows)
    # Why a replica is out of rotation, and why its node last restarted it: the operator's next question.
    for r in result:
        if r["state"] == "unhealthy" and r.get("detail"):
            click.echo(printable(f"{r['shard_id']} is unhealthy: {r['detail']}"), err=True)
        if r.get("restart_reason"):
            click.echo(printable(f"{r['shard_id']} was last restarted because {r['restart_reason']}"), err=True)


@ctl.command("install-engine")
@click.argument("node")
@click.argument("engine", type=click.Choice(["llamacpp", "vllm", "sglang"]))
@click.option("--no-wait", is_flag=True, help="Ask for the install and return; `llmgw ctl nodes` shows how it goes.")
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds to wait for it (vLLM is gigabytes).")
@click.pass_obj
def install_engine(obj, node, engine, no_wait, timeout):
    """Install ENGINE on NODE now, from the node's engine catalogue, rather than when a replica first needs it."""
    from llmgw.cli import engineinstall

    if no_wait:
        found = obj.admin.call("POST", f"/api/v1/nodes/{segment(node)}/engines/{segment(engine)}/install")
        click.echo(printable(f"{node} is installing {engine} {found['version']}; `llmgw ctl nodes` shows how it goes"),
                   err=True)
        return
    try:
        version = engineinstall.install(obj.admin.client, node, engine, timeout,
                                        lambda line: click.echo(printable(f"{node}: {line}"), err=True))
    except (engineinstall.InstallFailed, ApiError) as e:
        raise click.ClickException(printable(str(e))) from None
    click.echo(printable(f"{node}: {engine} {version} is installed"))


@ctl.command("engine-check")
@click.argument("engine", type=click.Choice(["llamacpp", "vllm", "sglang"]))
@click.option("--bin", "binary", metavar="PATH", help="The engine's program: `llama-server`, or `vllm`.")
@click.option("--python", metavar="PATH", help="An interpreter that has the engine (a node's virtual environment).")
@click.option("--timeout", default=300.0, show_default=True, help="Seconds its help may take (vLLM's imports torch).")
def engine_check(engine, binary, python, timeout):
    """Check that ENGINE, as this machine would run it, takes every flag llmgw builds for it.

    Run it after changing an engine's version: flags drift between releases, and one it does not know stops
    it at once. Without --bin or --python: llmgw's own environment's. It runs the engine's help only,
    never a server."""
    from llmgw.engines import flagcheck

    if binary and python:
        raise click.UsageError("give --bin or --python, not both")
    if engine == "vllm" and not (binary or python):
        raise click.UsageError("say which vLLM: --bin /opt/venvs/vllm/bin/vllm, or --python of its environment")
    if engine == "sglang" and binary:
        raise click.UsageError("SGLang runs as a module: give --python of its environment")
    launch = ("binary", binary) if binary else ("python", python) if python else None
    click.echo(f"asking {engine} for its options (this runs its help, not a server)...", err=True)
    try:
        found = flagcheck.check(engine, launch, timeout)
    except RuntimeError as e:
        raise click.ClickException(f"{engine} could not be checked: {e}") from None
    click.echo(printable(f"{engine} {found.version or '(version unknown)'}: {found.program}"))
    if found.missing:
        raise click.ClickException(
            f"it does not take {len(found.missing)} of the {len(found.given)} flags llmgw builds for it: "
            f"{', '.join(sorted(found.missing))}. A node would start it and see it exit; keep the version "
            "before, or report the flags that changed.")
    click.echo(f"takes every one of the {len(found.given)} flags llmgw builds for it: "
               f"{', '.join(sorted(found.given))}")


@ctl.command("plan")
@click.argument("model")
@click.option("--context", type=click.IntRange(1, 10_000_000), help="Tokens one request may use [what it was "
              "trained for, at most 32768].")
@click.option("--json", "as_json", is_flag=True, help="The plan as one JSON object.")
@click.pass_obj
def plan_model(obj, model, context, as_json):
    """Whether MODEL fits, on which nodes, with what profile, before any node fetches it.

    MODEL is a catalog model, or a source: a GGUF file or a Hugging Face folder, a path here, an http(s)
    URL (the mirror's), or the registry's hf:ORG/REPO[/FILE][@REVISION] (mirror.hf_endpoint). Its shape is read
    from a GGUF header or config.json, never the whole weights."""
    from llmgw.cli import plan

    source, nodes, fleet_note = model, [], ""
    try:
        found = next((m for m in obj.admin.client.call("GET", "/api/v1/models", timeout=10)["models"]
                      if m["name"] == model), None)
        source = found["source"] if found else model
        nodes = obj.admin.client.call("GET", "/api/v1/nodes", timeout=10)["nodes"]
    except ApiError as e:
        fleet_note = f"the controller's fleet could not be read ({printable(e)}), so no node is weighed"
    try:
        shape = plan.read_shape(plan.from_registry(source, obj.config()["mirror.hf_endpoint"]))
    except plan.PlanError as e:
        raise click.ClickException(str(e)) from None
    result = plan.plan(shape, nodes, context)
    if as_json:
        click.echo(json.dumps(result))
        return
    per_token = result["kv_bytes_per_token"]
    click.echo(printable(f"{model}: {shape.architecture} ({'GGUF, llama.cpp' if shape.kind == 'gguf' else 'safetensors, vLLM'}), "
                         f"{human_bytes(shape.weights_bytes)} of weights"))
    click.echo(f"  context {result['context']:,} tokens" + (f" (trained for {shape.trained_context:,})"
                                                            if shape.trained_context else "")
               + (f", {human_bytes(per_token)} of KV cache a token, {human_bytes(per_token * result['context'])} "
                  "a request" if per_token else ", its KV cache size not known (a quarter of the weights assumed)"))
    click.echo(f"  needs about {human_bytes(result['needed_bytes'])} for one request at a time; the mirror page's "
               f"rough figure is {human_bytes(result['rough_bytes'])}; each request more at once needs its own "
               "cache")
    if fleet_note or not nodes:
        click.echo(fleet_note or "no node has registered, so none is weighed", err=True)
        return
    for fit in result["nodes"]:
        click.echo(printable(f"  {fit['node']}: {'fits' if fit['fits'] else 'does not fit:'} {fit['how']}"))
    best = next((f for f in result["nodes"] if f["fits"] and "gpu_class" in (f["profile"] or {})),
                next((f for f in result["nodes"] if f["fits"]), None))
    if best is None:
        raise click.ClickException(f"{model} fits on no node of the fleet as it is: try a smaller --context, a smaller "
                                   "quantisation of it (a GGUF of fewer bits), or a node with more memory")
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in best["profile"].items())
    click.echo(f"in its model file (llmgw ctl model add -f FILE):\nmax_context = {result['context']}\n"
               f"[[profiles]]\n{lines}")


@ctl.command("tool-check")
@click.argument("model")
@click.option("--gateway", "gateway_url", metavar="URL", help="The gateway [gateway.public_url, or its listen address].")
@click.option("--key", envvar="LLMGW_API_KEY", metavar="KEY", help="A key that may use MODEL [$LLMGW_API_KEY].")
@click.option("--timeout", default=120.0, show_default=True, help="Seconds each answer may take.")
@click.pass_obj
def tool_check(obj, model, gateway_url, key, timeout):
    """Check that MODEL calls tools well enough for coding agents (Codex, Claude Code, Cline, Continue).

    Asks it, through the gateway as the agents do, to call a tool in a whole answer, in a stream and
    through the Responses API, then to answer from the tool's result. Exits 1 when any step fails."""
    from llmgw.cli import toolcheck

    if not key:
        raise click.UsageError("give a key that may use the model: --key, or LLMGW_API_KEY in the environment")
    gw = toolcheck.Gateway(gateway_url or obj.config().public_url(), key, timeout)
    click.echo(f"asking {model} to call a tool, through {gw.url}...", err=True)
    try:
        steps = toolcheck.run(gw, model)
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    for step in steps:
        click.echo(printable(f"{'ok  ' if step.ok else 'FAIL'}  {step.name}: {step.said}"))
    failed = [s for s in steps if not s.ok]
    if failed:
        raise click.ClickException(
            f"{model} failed {len(failed)} of {len(steps)} steps: coding agents will stumble on it. Point them at a "
            "model that calls tools (an instruct or coder model, served with its own chat template).")
    click.echo(f"{model} calls tools well: {len(steps)} of {len(steps)} steps.")


@ctl.command("fabric-test")
@click.argument("a")
@click.argument("b")
@click.option("--fabric", help="The fabric to test, by the name the nodes declare it under (needed where they share several).")
@click.option("--seconds", type=click.IntRange(1, 30), default=3, show_default=True, help="How long each rail is tested.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def fabric_test(obj, a, b, fabric, seconds, as_json):
    """Measure the fabric nodes A and B share, rail by rail, with perftest's ib_write_bw through their agents.

    B serves and A sends, one adapter pair at a time; each rail is graded against its link rate (ok at 80%
    or more, slow at 50%, fail below). Exits 1 unless every rail is ok."""
    click.echo(f"testing {a} -> {b} for {seconds} s a rail...", err=True)
    result = obj.admin.call("POST", "/api/v1/fabric-test", {"a": a, "b": b, "seconds": seconds,
                                                            **({"fabric": fabric} if fabric else {})}, timeout=30 * 60)
    if as_json:
        click.echo(json.dumps(result))
    else:
        where = result["physical"] or "not verified"
        click.echo(printable(f"fabric {result['fabric']} ({where}), {result['seconds']} s a rail"))
        print_table([("RAIL", "GB/S", "RATE", "GRADE", "WHY")] + [
            (f"{r['a']} -> {r['b']}", f"{r['gbps']:.1f}" if r["gbps"] else "-",
             f"{r['rate_gbps']:g}" if r["rate_gbps"] else "-", r["grade"], r.get("error", "")) for r in result["rails"]])
    if not result["passed"]:
        sys.exit(1)


@ctl.command("explain-placement")
@click.argument("model")
@click.pass_obj
def explain_placement(obj, model):
    """For every node and profile: could MODEL run there, and if not, why; and what load scaling sees and decided."""
    answer = obj.admin.call("GET", f"/api/v1/models/{segment(model)}/placement")
    result = answer["nodes"]
    if not result:
        click.echo("no node has registered", err=True)
    else:
        print_table([("NODE", "PROFILE", "FITS", "WHY")] +
                    [(r["node"], r["profile"], "yes" if r["fits"] else "no", r["reason"]) for r in result])
    scaling = answer.get("scaling")
    if scaling is not None:
        click.echo(printable(f"\nscaling: {scaling['state']}, {scaling['extra']} replicas added for load; "
                             f"{scaling['now']}"), err=True)
        for decision in scaling["decisions"][-5:]:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(decision["at"]))
            click.echo(printable(f"  {when}  {decision['reason']}"), err=True)


@ctl.command()
@click.argument("model")
@click.option("--min", "low", type=click.IntRange(min=0), help="Replicas kept running at least.")
@click.option("--max", "high", type=click.IntRange(min=0), help="Replicas at most.")
@click.pass_obj
def scale(obj, model, low, high):
    """Change how many replicas of MODEL run (models added with `ctl model add`)."""
    if low is None and high is None:
        raise click.UsageError("give --min, --max or both")
    result = obj.admin.call("POST", f"/api/v1/models/{segment(model)}/scale", {"min": low, "max": high})
    click.echo(f"{model}: min {result['min']}, max {result['max']}", err=True)


@ctl.command()
@click.argument("node")
@click.option("--source", default="agent", show_default=True,
              help="agent (the agent's own last 2,000 lines) or a shard id; the node lists its sources.")
@click.option("-n", "--lines", type=click.IntRange(1, 2000), default=200, show_default=True,
              help="How many of the last lines.")
@click.pass_obj
def logs(obj, node, source, lines):
    """The last lines the agent on NODE logged, or an engine there printed."""
    query = urllib.parse.urlencode({"lines": lines, "source": source})
    result = obj.admin.call("GET", f"/api/v1/nodes/{segment(node)}/logs?{query}")
    others = [s for s in result["sources"] if s != source]
    click.echo(f"{source} on {node}; its other sources: {printable(', '.join(others) or 'none')} (choose one with --source)",
               err=True)
    for line in result["lines"]:
        click.echo(printable(line, tabs=True))


@ctl.group("model")
def model_group():
    """Add and remove models while running."""


@model_group.command("add")
@click.option("-f", "--file", "path", required=True, type=click.Path(dir_okay=False),
              help="A TOML file with the keys of one [[models]] entry.")
@click.option("--no-source-check", is_flag=True, help="Accept a source the controller cannot see.")
@click.pass_obj
def model_add(obj, path, no_source_check):
    """Add (or replace) a model in the catalog; the reconciler places it (an on-demand one, at its first request)."""
    from llmgw.control.catalog import CatalogError, parse_model, read_model_file

    try:
        table_ = read_model_file(path)
        model = parse_model(table_)
    except CatalogError as e:
        raise click.ClickException(str(e)) from None
    query = "?source_check=0" if no_source_check else ""
    obj.admin.call("POST", f"/api/v1/models{query}", table_)
    if model.min_replicas > 0:
        click.echo(f"added {model.name}; `llmgw ctl replicas --model {model.name}` shows it starting", err=True)
        return
    # "shows it starting" sent operators looking for a replica that an on-demand model never has until asked for.
    from llmgw.control.reconciler import DEFAULT_IDLE_TIMEOUT

    idle = model.idle_timeout if model.idle_timeout is not None else DEFAULT_IDLE_TIMEOUT
    wait = obj.config()["gateway.load_wait"]
    click.echo(f"added {model.name}, on demand (scaling.min = 0): nothing starts now. The first request for it "
               "starts a replica: a node fetches the weights (only the first time, and that can take minutes for "
               f"large ones) and the engine loads them. That request waits up to gateway.load_wait ({wait:g} s in "
               "this configuration) and then gets 503 with Retry-After while the start goes on. The replica stops "
               f"after {_duration(idle)} without requests. `llmgw ctl replicas --model {model.name}` shows it once "
               f"asked for; `llmgw ctl scale {model.name} --min 1` keeps one running from now on.", err=True)


def _duration(seconds: float) -> str:
    """SECONDS as a person says it: 15 minutes, 2 hours, 90 s."""
    for unit, size in (("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            count = seconds / size
            return f"{count:g} {unit}{'' if count == 1 else 's'}"
    return f"{seconds:g} s"


@model_group.command("remove")
@click.argument("model")
@click.pass_obj
def model_remove(obj, model):
    """Remove MODEL from the catalog; its replicas are stopped."""
    obj.admin.call("DELETE", f"/api/v1/models/{segment(model)}")
    click.echo(f"removed {model}; its replicas are stopping", err=True)


def _weights_rows(nodes: list[dict], only_reclaimable: bool) -> list[tuple]:
    """The table of what each node's weights directory holds (or, with ONLY_RECLAIMABLE, what may go)."""
    rows = [("NODE", "ENTRY", "SIZE", "FETCHED", "USED BY", "RECLAIM")]
    for n in nodes:
        for f in n.get("files", []):
            if only_reclaimable and not f["reclaimable"]:
                continue
            fetched = ("partly" if f["partial"] else "yes") if f["fetched"] else "no"
            users = [f"model {m}" for m in f["models"]] + [f"replica {r}" for r in f["replicas"]]
            rows.append((n["node"], f["name"], human_bytes(f["bytes"]), fetched, ", ".join(users) or "-",
                         "yes" if f["reclaimable"] else f"no: {f['kept']}"))
    return rows


@ctl.command()
@click.argument("node", required=False)
@click.option("--reclaim", is_flag=True, help="Remove what llmgw fetched that nothing uses (asks first).")
@click.option("--yes", "-y", is_flag=True, help="With --reclaim: do not ask.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per node.")
@click.pass_obj
def weights(obj, node, reclaim, yes, as_json):
    """What each node (or NODE) holds in its weights directory: size, which models and replicas use each
    entry, whether llmgw fetched it. --reclaim removes, through each node's agent, the entries llmgw
    fetched that no catalog model, replica or local source uses, once you say yes."""
    nodes = obj.admin.call("GET", "/api/v1/weights" + (f"?{urllib.parse.urlencode({'node': node})}" if node else ""))["nodes"]
    if as_json and not reclaim:
        for n in nodes:
            click.echo(json.dumps(n))
        return
    if not nodes:
        click.echo("no node has registered yet", err=True)
        return
    listed = [n for n in nodes if "error" not in n]
    rows = _weights_rows(listed, only_reclaimable=reclaim)
    if len(rows) > 1:
        print_table(rows)
    for n in nodes:
        if "error" in n:
            click.echo(printable(f"{n['node']}: {n['error']}"), err=True)
            continue
        more = f" (only the largest {len(n['files'])} are listed)" if n["truncated"] else ""
        click.echo(f"{printable(n['node'])}: {n['entries']} entries, {human_bytes(n['bytes'])} in {printable(n['weights_dir'])}{more}; "
                   f"{human_bytes(n['reclaimable_bytes'])} reclaimable", err=True)
    if not reclaim:
        return
    chosen = {n["node"]: [f["name"] for f in n["files"] if f["reclaimable"]] for n in listed}
    chosen = {k: v for k, v in chosen.items() if v}
    if not chosen:
        click.echo("nothing to reclaim: every entry is in use, kept by the catalog, or not llmgw's", err=True)
        return
    total = sum(n["reclaimable_bytes"] for n in listed)
    count = sum(len(v) for v in chosen.values())
    if not yes:
        click.confirm(f"Remove these {count} entries ({human_bytes(total)}) from {printable(', '.join(chosen))}?", abort=True,
                      err=True)
    for node_id, names in chosen.items():
        result = obj.admin.call("POST", f"/api/v1/nodes/{segment(node_id)}/weights/reclaim", {"names": names})
        if as_json:
            click.echo(json.dumps(result))
        click.echo(f"{printable(node_id)}: removed {len(result['removed'])} entries, {human_bytes(result['freed_bytes'])} freed",
                   err=True)
        for name, why in result["refused"].items():
            # Something began to use it since the listing: kept, and said, but no failure.
            click.echo(printable(f"{node_id}: kept {name}: {why}"), err=True)
