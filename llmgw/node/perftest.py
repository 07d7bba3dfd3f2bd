"""One rail of a fabric test: perftest's `ib_write_bw` between an adapter here and one on another node.

The controller runs the server on one node and the client on the other, adapter by adapter, one rail
at a time (llmgw/control/fabrictest.py); this module runs either side. The test runs for a duration,
not a count, so it takes as long on a slow link as on a fast one. The client retries while the server
is not listening yet. The result is read from perftest's table by its column heading ("BW average"),
never by position: the columns moved between perftest versions.

perftest is installed on first use, with the node's package manager (apt-get, dnf, yum or zypper),
as the agent installs nothing else of the system's; a node that cannot install it says so.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import time

BINARY = "ib_write_bw"
INSTALL_TIMEOUT = 600.0  # seconds for the package manager (a fresh machine's first apt-get update)
CONNECT_TRIES = 10  # the client's, one a second, while the server is not listening yet
NOT_LISTENING = ("Couldn't connect", "Unable to init the socket connection", "Connection refused")
MANAGERS = (("apt-get", ["apt-get", "install", "-y", "perftest"]), ("dnf", ["dnf", "install", "-y", "perftest"]),
            ("yum", ["yum", "install", "-y", "perftest"]), ("zypper", ["zypper", "--non-interactive", "install", "perftest"]))


def args(hca: str, port: int, tcp_port: int, seconds: int, gid_index: int | None = None,
         peer: str | None = None) -> list[str]:
    """`ib_write_bw`'s command line; PEER makes it the client (the server has none). GID_INDEX: RoCE's v2
    entry (llmgw/node/ibports.py), none on InfiniBand."""
    argv = [BINARY, "-d", hca, "-i", str(max(port, 1)), "-p", str(tcp_port), "-D", str(max(seconds, 1)),
            "-F", "--report_gbits"]
    if gid_index is not None and gid_index >= 0:
        argv += ["-x", str(gid_index)]
    return argv + ([peer] if peer else [])


def parse(text: str) -> float:
    """The average bandwidth in Gb/s from perftest's result table; ValueError where there is none."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "BW average" not in line:
            continue
        heads = re.split(r"\s{2,}", line.strip())
        column = next((j for j, head in enumerate(heads) if head.startswith("BW average")), None)
        if column is None:
            raise ValueError(f"perftest's result table has a shape this does not know: {line.strip()!r}")
        data = next((row for row in lines[i + 1:] if row.strip() and not row.strip().startswith("-")), "")
        cells = re.split(r"\s{2,}", data.strip())
        if len(cells) != len(heads):
            raise ValueError("perftest's result table has a shape this does not know: "
                             f"{line.strip()!r} over {data.strip()!r}")
        try:
            return float(cells[column])
        except ValueError:
            raise ValueError(f"perftest's average bandwidth is not a number: {cells[column]!r}") from None
    raise ValueError("perftest printed no result")


def ensure_installed() -> str | None:
    """None once `ib_write_bw` is on the PATH, installing perftest if it is not; else why it is not there."""
    if shutil.which(BINARY):
        return None
    manager = next(((name, argv) for name, argv in MANAGERS if shutil.which(name)), None)
    if manager is None:
        return f"{BINARY} is not installed (the perftest package), and no package manager was found to install it"
    name, argv = manager
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=INSTALL_TIMEOUT,
                             env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"installing perftest with {name} failed: {e}"
    if run.returncode != 0 or not shutil.which(BINARY):
        last = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"installing perftest with {name} failed: {last[0][:300]}"
    return None


def run(argv: list[str], seconds: int, client: bool) -> tuple[float | None, str, str]:
    """Run ARGV (`args`): (Gb/s or None, why not, the last lines it printed). A CLIENT whose server is not
    listening yet tries again, once a second."""
    output = ""
    for _ in range(CONNECT_TRIES if client else 1):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            return None, f"{BINARY} did not finish in {seconds + 60} s", ""
        except OSError as e:
            return None, f"{BINARY} did not run: {e}", ""
        output = done.stdout + done.stderr
        if client and any(words in output for words in NOT_LISTENING):
            time.sleep(1)
            continue
        break
    tail = "\n".join(output.strip().splitlines()[-20:])
    try:
        return parse(output), "", tail
    except ValueError as e:
        last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")
        return None, f"{BINARY}: {e}: {last[:300]}", tail


MOST_SECONDS = 30


def answer(message: dict, ports: list[dict]) -> dict:
    """The fields of the `fabric_test_reply` to MESSAGE (a `fabric_test`: this node's side of one rail), run
    on PORTS, this node's ports: `gbps`, or `error` saying why not; `output`, perftest's last lines."""
    hca, port, role = message["hca"], message["port"], message["role"]
    seconds, tcp_port, peer = message["seconds"], message["tcp_port"], message.get("peer")
    if role not in ("server", "client") or not 1 <= seconds <= MOST_SECONDS or not 1024 <= tcp_port <= 65535:
        return {"error": f"a fabric test is a server or a client, for 1 to {MOST_SECONDS} s, on a TCP port from "
                         "1024; this one asked otherwise"}
    if role == "client":
        try:
            peer = str(ipaddress.ip_address(peer or ""))  # an address, never something perftest reads as a flag
        except ValueError:
            return {"error": f"the peer of a fabric test is an IP address, not {str(peer)[:100]!r}"}
    found = next((p for p in ports if p["hca"] == hca and p["port"] == port), None)
    if found is None:
        return {"error": f"no port {hca}/{port} here"}
    if found.get("state", "").upper() != "ACTIVE":
        return {"error": f"{hca}/{port} is {found.get('state') or 'in no state'} ({found.get('phys_state') or '?'})"}
    missing = ensure_installed()
    if missing:
        return {"error": missing}
    argv = args(hca, port, tcp_port, seconds, found.get("roce_gid_index"), peer if role == "client" else None)
    gbps, error, output = run(argv, seconds, role == "client")
    return {"gbps": gbps, "output": output} if gbps is not None else {"error": error, "output": output}
