"""The subnet managers an InfiniBand port sees, and so which physical fabric it is on.

Every port of one InfiniBand fabric is managed by the same subnet managers (one master, the others
standing by), so the set of them names the fabric; the lowest GUID in the set is its identity. The master
alone is not: when it fails and a standby takes over, a fabric named by its master would split in two
between the nodes that had looked before the failover and those that looked after (the Go version's
lesson). Subnet prefixes cannot tell fabrics apart either: OpenSM gives every fabric `fe80::`.

`sminfo` names a port's master and `saquery SMIR` lists every manager; both are management datagrams to
the master, so they are asked once a minute, not every heartbeat, and `saquery` once per master rather
than once per port. Output shapes are infiniband-diags' (`sminfo.c`, `saquery.c`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time

QUERY_TIMEOUT = 5.0  # seconds for one sminfo or saquery
EVERY = 60.0  # seconds between asking
NO_DIAGS = "sminfo is not installed: install infiniband-diags (apt-get install infiniband-diags)"
STATES = {"0": "not active", "1": "discovering", "2": "standby", "3": "master"}

_SMINFO = re.compile(r"sm lid (\d+) sm guid (0x[0-9a-fA-F]+), activity count \d+ priority (\d+) state (\d+)")
_FIELD = re.compile(r"^\s*([A-Za-z_]+)\.{2,}\s*(\S+)")


def _guid(text: str) -> str:
    digits = text.lower().removeprefix("0x")
    return "0x" + digits.zfill(16) if re.fullmatch(r"[0-9a-f]{1,16}", digits) and int(digits, 16) else ""


def parse_sminfo(text: str) -> dict:
    """`sminfo`'s line as {"guid", "lid", "priority", "state"}; ValueError for anything else (an ibwarn)."""
    match = _SMINFO.search(text)
    if not match or not _guid(match.group(2)):
        raise ValueError(f"unrecognised sminfo output: {text.strip()[:200]!r}")
    return {"guid": _guid(match.group(2)), "lid": int(match.group(1)), "priority": int(match.group(3)),
            "state": STATES.get(match.group(4), match.group(4))}


def parse_smir(text: str) -> list[dict]:
    """Every `SMInfoRecord` of `saquery SMIR`, as parse_sminfo's shape; a record without a GUID is dropped.
    ValueError when none is left."""
    records: list[dict] = []
    for block in text.split("SMInfoRecord dump:")[1:]:
        fields = {m.group(1): m.group(2) for m in map(_FIELD.match, block.splitlines()) if m}
        guid = _guid(fields.get("GUID", ""))
        if not guid:
            continue
        record: dict = {"guid": guid, "state": STATES.get(fields.get("SMState", ""), fields.get("SMState", ""))}
        for name, key in (("LID", "lid"), ("Priority", "priority")):
            if fields.get(name, "").isdigit():
                record[key] = int(fields[name])
        records.append(record)
    if not records:
        raise ValueError("no subnet manager records in saquery's output")
    return records


def identity(managers: list[dict]) -> str:
    """The fabric a set of subnet managers manages: "sm:" and the lowest GUID among them."""
    return "sm:" + min(m["guid"] for m in managers) if managers else ""


def _run(argv: list[str]) -> str:
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise ValueError(f"{argv[0]} did not answer in {QUERY_TIMEOUT:g} s") from None
    except OSError as e:
        raise ValueError(f"{argv[0]} did not run: {e}") from None
    if run.returncode != 0:
        last = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"{argv[0]} failed: {last[0][:300]}")
    return run.stdout


def ask_sminfo(hca: str, port: int) -> dict:
    return parse_sminfo(_run(["sminfo", "-C", hca, "-P", str(port)]))


def ask_smir(hca: str, port: int) -> list[dict]:
    return parse_smir(_run(["saquery", "-C", hca, "-P", str(port), "SMIR"]))


class Watch:
    """What each active InfiniBand port's subnet managers are, asked at most once a minute.

    `look(ports)` puts on each active InfiniBand port its master (`sm`), the fabric's managers
    (`subnet_managers`, on the first port of each master only: the same list for every port), and
    `fabric_id`; a port whose managers could not be asked says why (`sm_error`). SMINFO and SMIR are the
    queries (replaced in tests); CLOCK is monotonic time.
    """

    def __init__(self, sminfo=ask_sminfo, smir=ask_smir, clock=time.monotonic, every: float = EVERY,
                 installed=lambda: shutil.which("sminfo") is not None, background: bool = True):
        self.sminfo, self.smir, self.clock, self.every = sminfo, smir, clock, every
        self.installed = installed
        self.background = background
        self.asked_at: float | None = None
        self.asking: threading.Thread | None = None
        # Replaced whole when an asking finishes, so a reader sees one asking's answers or the last one's.
        self.masters: dict[tuple[str, int], dict | str] = {}  # (hca, port) -> master, or why not known
        self.sets: dict[str, list[dict] | str] = {}  # master guid -> every manager, or why not known

    def look(self, ports: list[dict]) -> None:
        """Put on PORTS what is known of their subnet managers. The first time, they are asked at once (the
        registration waits for them); after that, each minute, in a thread of its own, while this goes on
        with the last answers: a subnet manager that does not answer takes 5 s a port, and heartbeats wait
        for nothing."""
        infiniband = [p for p in ports if p.get("state", "").upper() == "ACTIVE"
                      and p.get("link_layer", "").lower() != "ethernet"]
        now = self.clock()
        if infiniband and (self.asked_at is None or now - self.asked_at >= self.every):
            first, self.asked_at = self.asked_at is None, now
            if first or not self.background:
                self._ask(infiniband)
            elif self.asking is None or not self.asking.is_alive():
                self.asking = threading.Thread(target=self._ask, args=(infiniband,), name="subnet-managers",
                                               daemon=True)
                self.asking.start()
        listed: set[str] = set()
        for port in infiniband:
            master = self.masters.get((port["hca"], port["port"]))
            if master is None:
                continue  # the port came up since the last asking: known at the next
            if isinstance(master, str):
                port["sm_error"] = master
                continue
            port["sm"] = master
            managers = self.sets.get(master["guid"])
            if isinstance(managers, list):
                port["fabric_id"] = identity(managers)
                if master["guid"] not in listed:
                    port["subnet_managers"] = managers
                    listed.add(master["guid"])
            else:
                # Without the list, the master is all that is known: named by it, which a failover changes.
                port["fabric_id"] = identity([master])
                if managers:
                    port["sm_error"] = managers

    def _ask(self, ports: list[dict]) -> None:
        masters: dict[tuple[str, int], dict | str] = {}
        sets: dict[str, list[dict] | str] = {}
        if not self.installed():
            for port in ports:
                masters[(port["hca"], port["port"])] = NO_DIAGS
        else:
            for port in ports:
                where = (port["hca"], port["port"])
                try:
                    masters[where] = master = self.sminfo(*where)
                except ValueError as e:
                    masters[where] = str(e)
                    continue
                if master["guid"] not in sets:  # one saquery per master, through the first port that sees it
                    try:
                        sets[master["guid"]] = self.smir(*where)
                    except ValueError as e:
                        sets[master["guid"]] = str(e)
        self.masters, self.sets = masters, sets


SCAN_TIMEOUT = 120.0  # seconds for ibnetdiscover: it walks every switch of the fabric
SCAN_MOST = 15 * 1024 * 1024  # bytes of a scan sent back: under the agent channel's 16 MiB message


def scan(hca: str, port: int) -> dict:
    """The fields of a `scan_fabric_reply`: `ibnetdiscover`'s map of the fabric seen from HCA's PORT
    (`output`), or why there is none (`error`)."""
    if shutil.which("ibnetdiscover") is None:
        return {"error": "ibnetdiscover is not installed: install infiniband-diags"}
    try:
        run = subprocess.run(["ibnetdiscover", "-C", hca, "-P", str(port)], capture_output=True, text=True,
                             timeout=SCAN_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"error": f"ibnetdiscover did not finish in {SCAN_TIMEOUT:.0f} s"}
    except OSError as e:
        return {"error": f"ibnetdiscover did not run: {e}"}
    if run.returncode != 0:
        last = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"ibnetdiscover failed: {last[0][:300]}"}
    if len(run.stdout.encode()) > SCAN_MOST:
        return {"error": f"ibnetdiscover printed {len(run.stdout.encode()) >> 20} MiB, more than the "
                         f"{SCAN_MOST >> 20} MiB a scan may send"}
    return {"output": run.stdout}
