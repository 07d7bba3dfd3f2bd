"""The node doctor: is this machine ready to be a node? Run it before the agent.

    python doctor.py [--config FILE] [--json]

Checks GPUs and their driver (and an NVIDIA card with no working driver),
GPU health, memory and NVLink, the CPU's vector extensions, memory, the disk
for weights, the engines, InfiniBand and RoCE ports and their subnet managers,
the declared fabrics (and the NCCL environment a shard on each would get),
NVSwitch and its fabric manager, NVLink domains and IMEX, the memlock limit, the
route to the controller and whether it accepts this node's key. Problems
come first, each with the command that fixes it. `--json` writes every fact
read and every conclusion. The exit status is 1 when a check fails.
Wiring only: the checks are llmgw/node/doctor.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import click

from llmgw import engines, keyfiles, settings
from llmgw.node import doctor
from llmgw.node.installer import Installer
from llmgw.node.reporter import engines_here


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", envvar="LLMGW_CONFIG", type=click.Path(dir_okay=False),
              help="The agent's TOML configuration (also $LLMGW_CONFIG): controllers, key, weights directory.")
@click.option("--json", "as_json", is_flag=True, help="Every fact read and every conclusion, as JSON.")
@click.option("--root", default="/", show_default=True, help="Where /proc and /sys are (for a captured tree).")
def main(config_path, as_json, root):
    """Check that this machine is ready to be an llmgw node."""
    try:
        cfg = settings.load(config_path)
    except settings.ConfigError as e:
        raise click.ClickException(str(e)) from None
    keys = None
    key_problem = None
    if cfg["agent.controllers"] and not cfg["agent.plaintext"]:
        try:
            keys = keyfiles.read_node_key_file(cfg["agent.key_file"])
        except (OSError, ValueError) as e:
            key_problem = f"cannot read the node's key ({cfg['agent.key_file']}): {e}"
    # The engines as the agent would run them: never one that merely lies on the PATH.
    named = engines.named(cfg)
    installer = Installer(cfg["agent.engines_dir"], cfg.engines, cfg["agent.mirror_url"])
    known = {"engines": engines_here(engines.installed(named), named, installer),
             "installable": installer.installable()}
    facts = doctor.collect(root, cfg["agent.nvidia_smi"], cfg["agent.weights_dir"],
                           cfg["agent.controllers"] if key_problem is None else (), keys, known,
                           engines_dir=cfg["agent.engines_dir"], declared=cfg.fabrics)
    findings = doctor.evaluate(facts)
    if key_problem:
        findings.insert(0, doctor.Finding(doctor.FAIL, "agent", key_problem,
                                          "on the controller: llmgw ctl node-key issue NODE; put the file it writes "
                                          "at agent.key_file"))
    failed = sum(1 for f in findings if f.level == doctor.FAIL)
    if as_json:
        click.echo(json.dumps({"findings": [dataclasses.asdict(f) for f in findings], "facts": facts},
                              indent=2, default=str))
    else:
        cpu = facts.get("cpu", {})
        click.echo(f"{facts['hostname']} · {cpu.get('model', 'CPU')} · {cpu.get('count', '?')} CPUs\n")
        for f in findings:
            click.echo(f"{f.level:<4} {f.area:<7} {f.message}")
            if f.fix and f.level != doctor.OK:
                click.echo(f"{'':13}→ {f.fix}")
        warned = sum(1 for f in findings if f.level == doctor.WARN)
        click.echo(f"\n{failed} failed, {warned} warnings. `python doctor.py --json > report.json` keeps "
                   "everything read, to send to whoever helps.")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
