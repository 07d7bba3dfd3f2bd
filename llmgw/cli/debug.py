"""`llmgw debug profile ROLE`: where a running role spends its time, as Go's pprof tells of a Go one.

A sampling profile taken from outside by py-spy (llmgw's `debug` extra): it
reads the process's memory a hundred times a second and writes the stacks it
saw, a gateway's workers included (`--subprocesses`). Nothing is added to the
roles and nothing listens: a profiling endpoint would be one more door on a
process that faces clients, while this needs what reading another process's
memory needs, the role's own user or root, which is who should profile it.
`--dump` prints every thread's stack once, for a role that seems stuck.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import click

ROLES = ("gateway", "controller", "agent", "mirror")
FORMATS = {"flamegraph": "svg", "speedscope": "json", "raw": "txt"}


def _cmdline(pid: str, proc: str) -> list[str]:
    try:
        with open(os.path.join(proc, pid, "cmdline"), "rb") as f:
            return [part.decode("utf-8", "replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def _parent(pid: str, proc: str) -> str:
    try:
        with open(os.path.join(proc, pid, "stat")) as f:
            return f.read().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return ""


def candidates(role: str, proc: str = "/proc") -> list[tuple[int, str]]:
    """(pid, command line) of each process running ROLE's file (`gateway.py`, ...) whose parent does not: a
    gateway's gunicorn master, not each of its workers."""
    running = {}
    for pid in os.listdir(proc):
        if pid.isdigit():
            argv = _cmdline(pid, proc)
            if any(os.path.basename(a) == f"{role}.py" for a in argv[:3]):
                running[pid] = " ".join(argv)
    return sorted((int(pid), line) for pid, line in running.items() if _parent(pid, proc) not in running)


def _py_spy() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")  # llmgw's own environment's, first
    found = beside if os.access(beside, os.X_OK) else shutil.which("py-spy")
    if not found:
        raise click.ClickException("py-spy is not installed here: `pip install py-spy` in llmgw's environment (it is "
                                   "llmgw's `debug` extra: pip install -e '.[debug]')")
    return found


def _pid(role: str, pid: int | None) -> int:
    if pid is not None:
        return pid
    found = candidates(role)
    if len(found) == 1:
        return found[0][0]
    if not found:
        raise click.ClickException(f"no {role} runs on this machine (no process runs {role}.py); give --pid PID")
    shown = "\n".join(f"  {p}: {line[:120]}" for p, line in found)
    raise click.ClickException(f"{len(found)} {role}s run on this machine; say which with --pid:\n{shown}")


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise click.ClickException(f"py-spy did not finish within {timeout:.0f} s") from None
    said = (run.stderr + run.stdout).strip()
    if run.returncode != 0:
        if "Permission denied" in said or "Operation not permitted" in said:
            raise click.ClickException("py-spy may not read that process's memory: run this as the user the role runs "
                                       "as, or with sudo (a container needs the SYS_PTRACE capability)")
        raise click.ClickException(f"py-spy failed: {said.splitlines()[-1] if said else run.returncode}")
    return run


@click.group()
def debug():
    """Look inside running roles."""


@debug.command()
@click.argument("role", type=click.Choice(ROLES))
@click.option("--pid", type=int, help="The process, where more than one ROLE runs here (a gateway's master).")
@click.option("--seconds", type=click.IntRange(1, 600), default=10, show_default=True, help="How long to sample.")
@click.option("--format", "shape", type=click.Choice(tuple(FORMATS)), default="flamegraph", show_default=True,
              help="An SVG flame graph, speedscope's JSON (speedscope.app), or collapsed stacks.")
@click.option("--out", type=click.Path(dir_okay=False), help="Where to write it [ROLE-PID-TIME.svg here].")
@click.option("--dump", is_flag=True, help="Print every thread's stack once instead (a role that seems stuck).")
def profile(role, pid, seconds, shape, out, dump):
    """Where ROLE, running on this machine, spends its time: a sampling profile by py-spy.

    It samples from outside, changing nothing in the role; it needs the role's user or root."""
    spy, target = _py_spy(), _pid(role, pid)
    if dump:
        click.echo(_run([spy, "dump", "--pid", str(target), "--subprocesses"], 60).stdout, nl=False)
        return
    out = out or f"{role}-{target}-{time.strftime('%Y%m%d-%H%M%S')}.{FORMATS[shape]}"
    click.echo(f"profiling {role} (pid {target}, with its subprocesses) for {seconds} s...", err=True)
    run = _run([spy, "record", "--pid", str(target), "--subprocesses", "--duration", str(seconds), "--format", shape,
                "--output", out, "--nonblocking"], seconds + 60)
    samples = next((line for line in run.stderr.splitlines() if "Samples:" in line), "").partition("Samples:")[2]
    click.echo(f"wrote {out}" + (f" ({samples.split()[0]} samples)" if samples.strip() else ""), err=True)
    click.echo(out)
