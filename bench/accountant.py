"""The accountant as gateway workers multiply: what each asks of it, what a message costs it, its ceiling.

    python bench/accountant.py [--quick] [--sizes 2,8,32] [--seconds S] [--parts N] [--baseline CHECKOUT]
                               [--out FILE] [--chart FILE]

Every limited request is admitted by the one accountant (in the controller, or a gateway's master without
one), which keeps limits exact across every worker and gateway. Here the accountant runs as it does in
service, its thread and ROUTER socket over CURVE (`llmgw/control/accountserver.py`), in a process of its own
pinned to CPU 0. On CPU 1, one process holds N simulated gateway workers (each size), each a real
`llmgw.gateway.limiter.Limiter` with its own DEALER socket and 8 requests at once, as many gevent requests
do: admit a request with limits at four levels (key, project, team, organisation: requests, tokens and a
budget at each, all far from binding), settle it at once, and the next. Two kinds of traffic:

- *hot*: every request for one of 20 keys, so each worker admits most requests from its allowances (a
  grant of up to 1,024 requests a second for a key, asked for once);
- *spread*: every request for one of 100,000 keys, so a worker rarely sees a key twice within a second
  and almost every request is a grant asked for and settled: what many people each sending a little
  ask of it.

Measured for each: requests admitted a second, the messages the accountant answered or took (admits,
settles), its CPU share, and from them its CPU a message and the messages a second one core of it would
take. Then *exactness* at the size: a key allowed 2,000 requests a minute, asked by every worker at once
as fast as they can for a few seconds: exactly 2,000 must be admitted.

The workers here do nothing but admit, so one core of them asks the accountant far more than one core of
real gateway workers would (those also parse, route and relay each request). `--baseline CHECKOUT` runs
the accountant of another checkout against this checkout's workers.

`--parts N` (default 2; 1: none) also runs spread traffic against the accountant split into N parts
(`controller.accountant_parts`, llmgw/control/accountparts.py), each a process of its own: *spread*, each
request held at its organisation's four levels (one part), and *spread+person*, a level of its person too,
whose home is in another part for most requests (two admissions, in order). This machine has two cores,
one of them the workers', so the parts share CPU 0 as the single accountant had it: what they show is
each part's CPU a message, how the messages divide between parts, and what a request held in two parts
costs; N parts on N cores of their own take N times one part's messages. `--quick` (2 workers, 3 s) runs in
the test suite (tests/test_bench_accountant.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import curves  # noqa: E402
from bench.chart import log_lines  # noqa: E402
from bench.procstat import cpu_seconds  # noqa: E402
from llmgw.procs import wait_for  # noqa: E402

SIZES = (2, 8, 32)
QUICK_SIZES = (2,)
AT_ONCE = 8  # requests in flight in each simulated worker
TRAFFIC = {"hot": 20, "spread": 100_000}  # keys the requests are spread over
EXACT_LIMIT = 2_000  # requests a minute of the key every worker asks for at once
FAR = dict(rpm=10_000_000, tpm=2_000_000_000, budget=10 ** 15)  # limits no request here reaches
PARTS = 2  # accountant parts of the split runs, by default
SPLIT_TRAFFIC = ("spread", "spread+person")


# The accountant of the checkout named by its first argument, as a controller runs it, until killed; its
# address and the keys a worker dials it with are written to the file named by its second (0600) once it
# listens. Run with `python -c`, so that the checkout's own llmgw is imported, not this one's.
SERVE = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
import zmq
from llmgw.control.accountant import Accountant
from llmgw.control.accountserver import AccountServer
from llmgw.control.authenticator import Authenticator, KeyRing

out = sys.argv[2]
if len(sys.argv) > 3:  # one part of several, which share the controller's key pair as the workers' keys
    given = json.load(open(sys.argv[3]))
    server_keys = (given["server"].encode(), given["server_secret"].encode())
    worker_keys = (given["public"].encode(), given["secret"].encode())
else:
    server_keys, worker_keys = zmq.curve_keypair(), zmq.curve_keypair()
context = zmq.Context()
Authenticator(context, {"llmgw-bench": KeyRing({worker_keys[0]: "workers"}, "gateway worker")}).start()
server = AccountServer(Accountant(), "127.0.0.1:0", context, (server_keys, "llmgw-bench")).start()
with os.fdopen(os.open(out + ".part", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
    json.dump({"address": f"127.0.0.1:{server.port}", "server": server_keys[0].decode(),
               "public": worker_keys[0].decode(), "secret": worker_keys[1].decode()}, f)
os.rename(out + ".part", out)
while True:
    time.sleep(3600)
"""


def levels(key: int, rpm: int = FAR["rpm"]) -> list[list]:
    """The four levels a request of KEY is held to: its key, one of 1,000 projects, 100 teams, 10 orgs."""
    names = (f"key:k{key}", f"project:p{key % 1000}", f"team:t{key % 100}", f"org:o{key % 10}")
    return [[name, rpm if name.startswith("key:") else FAR["rpm"], FAR["tpm"], FAR["budget"], "month"]
            for name in names]


def split(key: int, person: bool, parts: int) -> list[tuple[int, list]]:
    """The levels of KEY (and of its person, with PERSON) by accountant part, as a gateway's `Access.parts`
    gives them: the organisation's four in its organisation's part, the person's in theirs."""
    from llmgw.rules import part_of

    by_part: dict[int, list] = {part_of(f"o{key % 10}", parts): levels(key)}
    if person:
        by_part.setdefault(part_of(f"u{key}", parts), []).append(
            [f"user:u{key}", FAR["rpm"], FAR["tpm"], FAR["budget"], "month"])
    return sorted(by_part.items())


def drive(found: str, workers: int, traffic: str, seconds: float) -> None:
    """N simulated workers against the accountant in FOUND, for SECONDS; prints what they did as JSON.
    TRAFFIC is one of TRAFFIC's kinds, or "exact": every request for the one key EXACT_LIMIT allows; against
    parts, one of SPLIT_TRAFFIC."""
    import gevent

    from llmgw.gateway import limiter as limiting
    from llmgw.wire.curve import ClientKeys

    where = json.loads(Path(found).read_text())
    keys = ClientKeys(where["server"].encode(), where["public"].encode(), where["secret"].encode())
    address = where["address"]
    parts = tuple(where.get("parts", ()))
    counts = {"admitted": 0, "refused": 0, "unavailable": 0, "messages": 0}
    by_part = dict.fromkeys(parts, 0)

    class Counting(limiting.Limiter):
        def _send(self, address: str, op: str, **fields) -> None:
            counts["messages"] += 1
            if parts:
                by_part[address] += 1
            super()._send(address, op, **fields)

    limiters = [Counting(timeout=5.0, keys=keys) for _ in range(workers)]
    for each in limiters:
        for part in parts or (address,):
            each.ask(part, {"op": "status", "levels": []})  # connected, and the CURVE handshake done
    spread = TRAFFIC.get(traffic.split("+")[0], 1)
    level_sets = {k: levels(k) for k in range(min(spread, 20))} if traffic != "exact" else {
        0: levels(0, EXACT_LIMIT)}
    end = time.monotonic() + seconds

    def requests(lim: limiting.Limiter, rng: random.Random) -> None:
        while time.monotonic() < end:
            k = rng.randrange(spread)
            try:
                if parts:
                    answer = lim.admit_split(parts, (k,), split(k, traffic.endswith("+person"), len(parts)), True,
                                             300, 300)
                else:
                    answer = lim.admit(address, (k, True), level_sets.get(k) or levels(k), True, 300, 300)
            except limiting.Unavailable:
                counts["unavailable"] += 1
                continue
            if not answer.get("ok"):
                counts["refused"] += 1
                gevent.sleep(0.001)
                continue
            counts["admitted"] += 1
            lim.settle(address, answer.get("r"), 250, 250)

    began = time.monotonic()
    gevent.joinall([gevent.spawn(requests, lim, random.Random(w * AT_ONCE + i))
                    for w, lim in enumerate(limiters) for i in range(AT_ONCE)])
    elapsed = time.monotonic() - began
    for each in limiters:
        each.stop()  # hands back what allowances hold, confirmed by a question answered
    if parts:  # each part's share of the messages, in the order of the parts
        counts["part_shares"] = [round(by_part[p] / max(1, counts["messages"]), 3) for p in parts]
    print(json.dumps({**counts, "seconds": round(elapsed, 3)}))


class Accountant:
    """The accountant of ROOT in its own process on CPU 0 (KEYS: a file of the key pairs parts share)."""

    def __init__(self, tmp: str, root: str, keys: str | None = None):
        self.found = os.path.join(tmp, f"accountant-{os.getpid()}-{time.monotonic_ns()}.json")
        self.procs = [subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", SERVE, root, self.found,
                                        *([keys] if keys else [])])]
        wait_for("the accountant listening", 60, lambda: os.path.exists(self.found),
                 alive=lambda: self.procs[0].poll() is None)

    def cpu(self) -> float:
        return sum(cpu_seconds(proc.pid) for proc in self.procs)

    def run(self, workers: int, traffic: str, seconds: float) -> dict:
        before, began = self.cpu(), time.monotonic()
        done = subprocess.run(["taskset", "-c", "1", sys.executable, __file__, "--drive", self.found, str(workers),
                               traffic, str(seconds)], capture_output=True, text=True, timeout=seconds + 120)
        if done.returncode != 0:
            raise RuntimeError(f"the simulated workers failed: {done.stderr[-2000:]}")
        cpu = (self.cpu() - before) / (time.monotonic() - began)
        out = json.loads(done.stdout.strip().splitlines()[-1])
        rate = out["messages"] / out["seconds"]
        out.update(requests_per_s=round(out["admitted"] / out["seconds"]), messages_per_s=round(rate),
                   accountant_cpu=round(cpu, 3))
        if out["messages"]:
            out["cpu_us_per_message"] = round(cpu * 1e6 / rate, 1)
            out["messages_per_core"] = round(rate / cpu) if cpu else None
            out["requests_per_message"] = round(out["admitted"] / out["messages"], 2)
        return out

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


class Parts(Accountant):
    """This checkout's accountant split into COUNT parts, a process each, all on CPU 0, sharing one key pair."""

    def __init__(self, tmp: str, count: int):
        import zmq

        server, worker = zmq.curve_keypair(), zmq.curve_keypair()
        keys = os.path.join(tmp, f"parts-keys-{time.monotonic_ns()}.json")
        with os.fdopen(os.open(keys, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            json.dump({"server": server[0].decode(), "server_secret": server[1].decode(),
                       "public": worker[0].decode(), "secret": worker[1].decode()}, f)
        each = [Accountant(tmp, ROOT, keys) for _ in range(count)]
        self.procs = [a.procs[0] for a in each]
        found = [json.loads(Path(a.found).read_text()) for a in each]
        self.found = os.path.join(tmp, f"parts-{time.monotonic_ns()}.json")
        with os.fdopen(os.open(self.found, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            json.dump({**found[0], "parts": [where["address"] for where in found]}, f)


def measure(size: int, seconds: float, baseline: str | None, parts: int = 1) -> dict:
    def figures() -> dict:
        out = {}
        with tempfile.TemporaryDirectory(prefix="llmgw-accountant-") as tmp:
            for which, root in (("this", ROOT), ("baseline", baseline)):
                if root is None:
                    continue
                result = out[which] = {}
                for traffic in (*TRAFFIC, "exact"):
                    accountant = Accountant(tmp, root)  # a fresh one each time: no windows carried over
                    try:
                        result[traffic] = accountant.run(size, traffic, seconds)
                    finally:
                        accountant.stop()
                print(f"{size} workers, {which}: {json.dumps(result)}", file=sys.stderr)
            if parts > 1:
                split_out = out["parts"] = {}
                for traffic in SPLIT_TRAFFIC:
                    accountant = Parts(tmp, parts)
                    try:
                        split_out[traffic] = accountant.run(size, traffic, seconds)
                    finally:
                        accountant.stop()
                print(f"{size} workers, {parts} parts: {json.dumps(split_out)}", file=sys.stderr)
        return out

    return curves.under_load(size, figures)


ROWS = (("requests admitted a second", "requests_per_s", ","),
        ("accountant messages a second", "messages_per_s", ","),
        ("requests a message", "requests_per_message", ".2f"),
        ("accountant CPU (share of a core)", "accountant_cpu", ".2f"),
        ("accountant CPU a message (µs)", "cpu_us_per_message", ".1f"),
        ("messages one accountant core takes a second", "messages_per_core", ","))


def report(results: list[dict]) -> str:
    row = curves.row
    lines = [curves.header(results, "workers")]
    for which, label in (("this", "this checkout"), ("baseline", "baseline")):
        if which not in results[0]:
            continue
        for traffic in TRAFFIC:
            for name, key, form in ROWS:
                lines.append(row(f"{label}, {traffic}: {name}", (
                    "-" if r[which][traffic].get(key) is None else format(r[which][traffic][key], form)
                    for r in results)))
        lines.append(row(f"{label}: admitted of a key allowing {EXACT_LIMIT:,} a minute, asked by every worker",
                         (f"{r[which]['exact']['admitted']:,}" for r in results)))
    if "parts" in results[0]:
        for traffic in SPLIT_TRAFFIC:
            for name, key, form in ROWS:
                lines.append(row(f"parts on one core, {traffic}: {name}", (
                    "-" if r["parts"][traffic].get(key) is None else format(r["parts"][traffic][key], form)
                    for r in results)))
            lines.append(row(f"parts on one core, {traffic}: each part's share of the messages", (
                " / ".join(f"{share:.0%}" for share in r["parts"][traffic].get("part_shares", ()))
                for r in results)))
    lines.append(curves.load_row(results))
    return "".join(lines)


def chart(results: list[dict]) -> str:
    series = {}
    for which, name in (("this", "this checkout"), ("baseline", "baseline")):
        if which in results[0]:
            for traffic in TRAFFIC:
                series[f"{traffic}: accountant CPU a message (µs), {name}"] = [
                    r[which][traffic].get("cpu_us_per_message") for r in results]
    series["hot: requests a message"] = [r["this"]["hot"].get("requests_per_message") for r in results]
    return log_lines("The accountant as gateway workers multiply", "simulated gateway workers",
                     "microseconds, requests", [r["size"] for r in results], series)


def main() -> int:
    if sys.argv[1:2] == ["--drive"]:
        found, workers, traffic, seconds = sys.argv[2:6]
        drive(found, int(workers), traffic, float(seconds))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    curves.arguments(parser, "simulated gateway workers", SIZES, f"{QUICK_SIZES} workers and 3 s: a smoke run",
                     "seconds each traffic runs [10; --quick 3]")
    parser.add_argument("--parts", type=int, default=PARTS,
                        help=f"accountant parts of the split runs (1: none) [{PARTS}]")
    args = parser.parse_args()
    if args.parts < 1:
        parser.error("--parts: at least 1")
    if args.baseline and not os.path.isfile(os.path.join(args.baseline, "llmgw", "control", "accountserver.py")):
        parser.error(f"--baseline: {args.baseline} holds no llmgw/control/accountserver.py")
    sizes = curves.sizes_of(args, SIZES, QUICK_SIZES)
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    results = [measure(size, seconds, args.baseline, args.parts) for size in sizes]
    curves.finish(args, sizes, seconds, results, report(results), chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
