"""What the gateway costs a request, beside vllm-router (Rust), LiteLLM's proxy and the engine itself, in one run.

    python bench/gateway.py [--quick] [--rounds N] [--seconds S] [--held-streams N] [--rivals vllm-router,litellm]
                            [--variant SETTING=VALUE] [--baseline CHECKOUT] [--calm LOAD]
                            [--out bench/results/gateway.json]

Every gateway measured runs pinned to CPU 0, alone there; the simulated engine (`llmgw sim`, no delay: it
answers as fast as it can write) and the closed-loop load generator (bench/loadgen.py) share CPU 1, so CPU 0
measures the gateway rather than programs fighting over a core. The subjects, all in front of the same
engine, with the same loads:

- the engine called directly (the baseline of latency);
- llmgw's gateway with a key nothing limits, and with a key limited at four levels (key, project, team,
  organisation, far from binding; its accountant the gateway master's, on CPU 0 too), authentication,
  usage rows and metrics on, as in service;
- vllm-router 0.1.17, round robin, and LiteLLM 1.108.7's proxy, each installed, pinned, into a virtual
  environment of its own (bench/rivals.py says what each does a request). A rival that cannot be installed
  or started here is reported as such, with why, and the rest is measured;
- with `--variant`, the gateway again with other settings; with `--baseline`, the gateway of another
  checkout (a change's before, measured beside its after), each in front of an engine of its own.

The loads, each for S seconds a subject: plain requests one at a time (p50 and p99 latency, CPU per
request); 32 clients (requests a second, p99, CPU per request); 16-token streams one at a time (time to
first byte, CPU per stream) and at 32 clients. A round runs every load on every subject in turn, and the
figures are the median of the rounds, so a machine that gets busier mid-run weighs on every subject alike.
CPU is the CPU time the subject's processes spent over a load (from /proc, all threads) divided by the
requests answered: on a machine shared with other work it is the figure that holds up, where latency does
not; the load average over the run is reported beside the figures.

Last, held streams: N streams opened at once through one gateway worker, then each trickling a token every
five seconds, and the worker's memory while it holds them against the same worker idle. One worker holds
two open files a stream, so the open-file limit bounds N; the bench holds as many of the N asked as the
limit allows and says so.

The aims of issue 14 are printed with their verdicts: CPU per request at most twice vllm-router's, plain and
streamed, with limits at four levels; a limited request at most 1.15 times an unlimited one's CPU and added
latency; p99 at 32 clients at most twice vllm-router's; 10,000 held streams at 24 KiB each or less.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import rivals  # noqa: E402
from bench.curves import NOISY_LOAD  # noqa: E402
from bench.procstat import settled_rss_kib  # noqa: E402
from bench.rig import Rig, load  # noqa: E402
from llmgw import settings  # noqa: E402
from llmgw.procs import raise_fd_limit, wait_for  # noqa: E402

LOADS = {  # name: (what it is, loadgen options)
    "plain": ("plain request, one at a time", dict(concurrency=1)),
    "plain32": ("plain requests, 32 clients", dict(concurrency=32)),
    "stream": ("16-token stream, one at a time", dict(concurrency=1, stream=True)),
    "stream32": ("16-token streams, 32 clients", dict(concurrency=32, stream=True)),
}
GATEWAY, LIMITED, ENGINE = "gateway", "gateway, 4 levels", "engine directly"
VARIANT, VARIANT_LIMITED = "variant", "variant, 4 levels"  # --variant: the gateway with other settings
BASELINE, BASELINE_LIMITED = "baseline", "baseline, 4 levels"  # --baseline: another checkout's gateway
RIVAL_KINDS = {"vllm-router": rivals.VllmRouter, "litellm": rivals.LiteLLM}
ROUTER = rivals.VllmRouter.name
HELD_AIM, HELD_KIB_AIM = 10_000, 24
# Descriptors a gateway worker needs besides its streams' two each: its listener, store, metrics files,
# the accountant's socket, the interpreter's own.
WORKER_FDS = 200
HELD_TOKENS_PER_S, HELD_TOKENS = 0.2, 10  # a held stream lasts 45 s once all are open
HELD_OPEN_LIMIT = 300  # seconds for every held stream to open


class Subject:
    def __init__(self, name: str, url: str, key: str = "", cpu=None):
        """CPU: a function returning the CPU seconds the subject's processes have spent; None for the engine."""
        self.name, self.url, self.key, self.cpu = name, url, key, cpu

    def run(self, seconds: float, requests: int = 0, **options) -> dict:
        before = self.cpu() if self.cpu else None
        result = load(self.url, self.key, max_tokens=16, duration=seconds, requests=requests, **options)
        if self.cpu:
            result["cpu_ms"] = round((self.cpu() - before) * 1000 / max(1, result["ok"]), 4)
        return result


def measure_rounds(subjects: list[Subject], rounds: int, seconds: float) -> tuple[dict, list]:
    """Every load on every subject, ROUNDS times: the raw results by subject and load, and the load
    average seen at the start of each round and at the end."""
    for s in subjects:  # warm every path (the first requests open connections and fill caches)
        s.run(0, requests=100)
        s.run(0, requests=50, stream=True)
    raw: dict = {s.name: {name: [] for name in LOADS} for s in subjects}
    loadavg = []
    for r in range(rounds):
        loadavg.append(os.getloadavg()[0])
        print(f"round {r + 1} of {rounds} (load average {loadavg[-1]:.1f})", file=sys.stderr)
        for name, (_, options) in LOADS.items():
            for s in subjects:
                raw[s.name][name].append(s.run(seconds, **options))
    loadavg.append(os.getloadavg()[0])
    return raw, loadavg


FIELDS = ("p50_ms", "p99_ms", "ttfb_p50_ms", "ttfb_p99_ms", "rps", "cpu_ms")


def medians(raw: dict) -> dict:
    """The median of each figure over the rounds, with the added p50 latency and time to first byte (the
    subject's minus the engine's, round by round) and the requests that failed."""
    out: dict = {}
    for subject, loads in raw.items():
        for name, runs in loads.items():
            m = {f: round(statistics.median(r[f] for r in runs), 4) for f in FIELDS
                 if all(r.get(f) is not None for r in runs)}
            m["ok"], m["failed"] = sum(r["ok"] for r in runs), sum(r["failed"] for r in runs)
            errors = [e for r in runs for e in r["errors"]]
            if errors:
                m["errors"] = errors[:5]
            if subject != ENGINE:
                base = raw[ENGINE][name]
                for f, added in (("p50_ms", "added_p50_ms"), ("ttfb_p50_ms", "added_ttfb_p50_ms")):
                    m[added] = round(statistics.median(r[f] - b[f] for r, b in zip(runs, base)), 4)
            out.setdefault(subject, {})[name] = m
    return out


def measure_held_streams(tmp: str, count: int, gateway_command: tuple = (), at=lambda rig, when: None) -> dict:
    """COUNT streams open at once through one worker; its memory before and while they are held.
    GATEWAY_COMMAND runs the gateway (bench/rig.py); AT(rig, "idle" or "held") is called once the worker's
    memory has been read idle and holding the streams (bench/memprofile.py takes its snapshots there)."""
    # The engine holds every stream's first token until all COUNT run (or HELD_OPEN_LIMIT has passed), then
    # each sends a token every five seconds. Opening 9,900 streams that trickled a token every two seconds
    # from the start took 97 s here, as long as the streams, and at 300 s a loaded machine had not opened
    # them all. The rate matters too: at a token every two seconds the worker fell behind relaying them and
    # its memory still grew 20 s after it first looked settled (25 KiB a stream read, 28 and rising later);
    # at one every five it levels off within seconds, at what streams trickling one every ten seconds from
    # the start reach (33.6 and 33.3 KiB a stream at 9,900, and 33 at 2,000).
    rig = Rig(tmp, tokens_per_s=HELD_TOKENS_PER_S, ttft_ms=HELD_OPEN_LIMIT * 1000, name="held",
              gateway_settings={"gateway.worker_connections": count + 64, "gateway.max_connections_per_address": 0},
              sim_args=("--gather", str(count)), warm_model=True, gateway_command=gateway_command)
    try:
        # Warmed through the other engine: the first would hold these, and stop gathering after.
        rig.load(rig.url, rig.key, requests=20, concurrency=1, max_tokens=1, model="warm")
        rig.load(rig.url, rig.key, requests=20, concurrency=1, max_tokens=4, model="warm", stream=True)
        idle = settled_rss_kib(rig.worker)
        at(rig, "idle")
        started = time.monotonic()
        running = rig.load(rig.url, rig.key, background=True, stream=True, requests=count, concurrency=count,
                           max_tokens=HELD_TOKENS, timeout=HELD_OPEN_LIMIT + HELD_TOKENS / HELD_TOKENS_PER_S + 60)

        def engine_running() -> float:
            with urllib.request.urlopen(rig.engine_url + "/metrics", timeout=10) as resp:
                text = resp.read().decode()
            return float(re.search(r"^vllm:num_requests_running\{.*\} (\S+)$", text, re.M).group(1))

        wait_for(f"{count} streams to be open", HELD_OPEN_LIMIT, lambda: engine_running() >= count,
                 alive=lambda: running.poll() is None, interval=0.2)
        opened = time.monotonic() - started
        held = settled_rss_kib(rig.worker)
        at(rig, "held")
        out, _ = running.communicate(timeout=HELD_TOKENS / HELD_TOKENS_PER_S + 120)
        result = json.loads(out)
        return {"streams": count, "completed": result["ok"], "failed": result["failed"],
                "errors": result["errors"], "opened_s": round(opened, 1),
                "worker_rss_idle_kib": idle, "worker_rss_held_kib": held,
                "kib_per_stream": round((held - idle) / count, 1)}
    finally:
        rig.stop()


def start_rivals(rig: Rig, names: list[str]) -> tuple[list[Subject], dict]:
    subjects, status = [], {}
    for name in names:
        try:
            rival = rivals.start(RIVAL_KINDS[name], rig, rig.engine_url)
        except rivals.Unavailable as e:
            status[name] = f"not measured: {e}"
            print(f"{name}: {status[name]}", file=sys.stderr)
            continue
        status[name] = "measured"
        subjects.append(Subject(rival.name, rival.url, rival.key, rival.cpu))
    return subjects, status


def parse_setting(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or "." not in name:
        raise ValueError(f"{text!r} is not SETTING=VALUE with a dotted setting, such as usage.flush_interval=3600")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def wait_calm(most: float, limit: float) -> None:
    """Wait (up to LIMIT seconds) for the 1-minute load average to fall to MOST or below."""
    deadline = time.monotonic() + limit
    while os.getloadavg()[0] > most and time.monotonic() < deadline:
        print(f"load average {os.getloadavg()[0]:.1f} > {most}: waiting", file=sys.stderr)
        time.sleep(30)


def shared_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """The options of both gateway benches (this one and bench/onecore.py), whose results go to NAME.json."""
    parser.add_argument("--rounds", type=int, help="rounds of every load on every subject [3; --quick 1]")
    parser.add_argument("--baseline", metavar="CHECKOUT",
                        help="also measure the gateway of another checkout of llmgw (its gateway.py, run with this "
                             "one's Python): a change's before and after from one run")
    parser.add_argument("--calm", type=float, help="first wait (up to 30 min) for the load average to fall to this")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", f"{name}.json"))


def baseline_gateway(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The gateway.py of the checkout `--baseline` names, if it names one; an error where it has none."""
    if not args.baseline:
        return None
    path = os.path.join(os.path.abspath(args.baseline), "gateway.py")
    if not os.path.isfile(path):
        parser.error(f"--baseline: {path} does not exist")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short round and 300 held streams: a smoke run")
    parser.add_argument("--seconds", type=float, help="seconds of each load on each subject [6; --quick 1.5]")
    parser.add_argument("--held-streams", type=int, help=f"streams held at once [{HELD_AIM:,}, or as many as "
                        "the open-file limit allows; --quick 300]; 0 skips it")
    parser.add_argument("--rivals", help="comma-separated, of: vllm-router, litellm [both; --quick vllm-router]")
    parser.add_argument("--variant", action="append", default=[], metavar="SETTING=VALUE",
                        help="also measure a second gateway with this setting (repeatable: all apply to it), "
                             "e.g. usage.flush_interval=3600; VALUE is read as JSON, else as a string")
    shared_arguments(parser, "gateway")
    args = parser.parse_args()
    names = [n.strip() for n in (args.rivals if args.rivals is not None else
                                 "vllm-router" if args.quick else "vllm-router,litellm").split(",") if n.strip()]
    unknown = [n for n in names if n not in RIVAL_KINDS]
    if unknown:
        parser.error(f"--rivals: unknown {', '.join(unknown)}; choose from {', '.join(RIVAL_KINDS)}")
    try:
        variant = dict(parse_setting(v) for v in args.variant)
        settings.load(None, variant)  # what the variant's gateway would refuse, refused before anything starts
    except (ValueError, settings.ConfigError) as e:
        parser.error(f"--variant: {str(e)[:300]}")
    baseline = baseline_gateway(parser, args)
    rounds = args.rounds or (1 if args.quick else 3)
    seconds = args.seconds or (1.5 if args.quick else 6.0)
    fd_limit = raise_fd_limit()
    most_held = (fd_limit - WORKER_FDS) // 2
    asked = args.held_streams if args.held_streams is not None else 300 if args.quick else HELD_AIM
    if args.calm is not None:
        wait_calm(args.calm, 1800)
    tmp = tempfile.mkdtemp(prefix="llmgw-bench-")
    results = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                           "processor": platform.processor() or platform.machine(), "open_files": fd_limit},
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": rounds, "seconds": seconds,
               "variant": variant, "baseline": args.baseline}
    rigs = [Rig(tmp)]
    try:
        rig = rigs[0]
        subjects = [Subject(ENGINE, rig.engine_url), Subject(GATEWAY, rig.url, rig.key, rig.gateway_cpu),
                    Subject(LIMITED, rig.url, rig.limited_key, rig.gateway_cpu)]
        # Each other gateway has a rig of its own, on CPU 0 too (idle while the others are measured).
        for wanted, (plain, limited), options in (
                (variant, (VARIANT, VARIANT_LIMITED), dict(gateway_settings=variant)),
                (baseline, (BASELINE, BASELINE_LIMITED), dict(gateway_command=(sys.executable, baseline or "")))):
            if wanted:
                rigs.append(Rig(tmp, name=plain, **options))
                other = rigs[-1]
                subjects += [Subject(plain, other.url, other.key, other.gateway_cpu),
                             Subject(limited, other.url, other.limited_key, other.gateway_cpu)]
        found, results["rivals"] = start_rivals(rig, names)
        raw, results["load_average"] = measure_rounds(subjects + found, rounds, seconds)
    finally:
        for rig in rigs:
            rig.stop()
    results["figures"], results["raw"] = medians(raw), raw
    if asked:
        results["held"] = measure_held_streams(tmp, min(asked, most_held))
        results["held"].update(asked=asked, most_the_fd_limit_allows=most_held)
    results["aims"] = aims(results)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(report(results))
    return 0


def ratio(a, b) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def verdict(what: str, value: float | None, bound: float, extra: str = "", busy: float | None = None) -> dict:
    """A ratio aim: met when VALUE is at most BOUND; when not, by how much the measured figure must fall. BUSY:
    the load average the run began at, where it was too high to judge (the ratio is shown, not judged)."""
    if value is None:
        return {"aim": what, "bound": bound, "ratio": None, "met": None, "says": f"{what}: not measured"}
    if busy is not None:
        return {"aim": what, "bound": bound, "ratio": value, "met": None, "says": (
            f"{what}: x{value:.2f} (aim x{bound:g}): not judged, the run began at a load average of {busy:.1f} "
            f"(above {NOISY_LOAD:g})" + extra)}
    met = value <= bound
    says = f"{what}: x{value:.2f} (aim x{bound:g}): " + (
        "met" if met else f"NOT met, {(1 - bound / value) * 100:.0f}% less needed")
    return {"aim": what, "bound": bound, "ratio": value, "met": met, "says": says + extra}


def aims(r: dict) -> list[dict]:
    f = r["figures"]
    gw, lim, router = f[GATEWAY], f[LIMITED], f.get(ROUTER)
    began = r["load_average"][0]
    busy = began if began > NOISY_LOAD else None
    out = []
    for name in LOADS:
        theirs = router[name]["cpu_ms"] if router else None
        out.append(verdict(f"CPU per request, {LOADS[name][0]}, 4 levels / vllm-router",
                           ratio(lim[name]["cpu_ms"], theirs), 2,
                           f" ({lim[name]['cpu_ms']} ms against {theirs} ms)" if theirs else "", busy))
    out.append(verdict("CPU per request, plain, one at a time, 4 levels / no limits",
                       ratio(lim["plain"]["cpu_ms"], gw["plain"]["cpu_ms"]), 1.15, busy=busy))
    out.append(verdict("added p50 latency, plain, one at a time, 4 levels / no limits",
                       ratio(lim["plain"]["added_p50_ms"], gw["plain"]["added_p50_ms"]), 1.15, busy=busy))
    out.append(verdict("CPU per request, plain, 32 clients, 4 levels / no limits",
                       ratio(lim["plain32"]["cpu_ms"], gw["plain32"]["cpu_ms"]), 1.15, busy=busy))
    for key, name in ((LIMITED, "4 levels"), (GATEWAY, "no limits")):
        theirs = router["plain32"]["p99_ms"] if router else None
        mine = f[key]["plain32"]["p99_ms"]
        out.append(verdict(f"p99 latency, 32 clients, {name} / vllm-router", ratio(mine, theirs), 2,
                           f" ({mine} ms against {theirs} ms)" if theirs else "", busy))
    held = r.get("held")
    if held:
        met = held["streams"] >= HELD_AIM and held["failed"] == 0 and held["kib_per_stream"] <= HELD_KIB_AIM
        if held["streams"] < held["asked"]:
            short = (f"; {held['asked']:,} asked: the open-file limit ({r['machine']['open_files']:,}, two a "
                     f"stream) lets one worker hold {held['streams']:,} here")
        else:
            short = f"; {held['asked']:,} asked" if held["streams"] < HELD_AIM else ""
        out.append({"aim": "held streams", "met": met, "says": (
            f"held streams: {held['streams']:,} in one worker ({held['completed']:,} completed, {held['failed']} "
            f"failed), {held['kib_per_stream']} KiB each (aim {HELD_AIM:,} at {HELD_KIB_AIM} KiB or less): "
            f"{'met' if met else 'NOT met'}; worker RSS {held['worker_rss_idle_kib']:,} KiB idle, "
            f"{held['worker_rss_held_kib']:,} KiB holding them{short}")})
    return out


def show(field: str, value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:,.0f}" if field == "rps" else f"{value:.3f}"


def report(r: dict) -> str:
    f = r["figures"]
    columns = [s for s in (ENGINE, GATEWAY, LIMITED, VARIANT, VARIANT_LIMITED, BASELINE, BASELINE_LIMITED, ROUTER,
                           rivals.LiteLLM.name) if s in f]
    rows = []
    for name, (what, _) in LOADS.items():
        shown = [("p50 latency (ms)", "p50_ms"), ("p99 latency (ms)", "p99_ms"), ("added p50 (ms)", "added_p50_ms")]
        if name.startswith("stream"):
            shown = [("p50 to first byte (ms)", "ttfb_p50_ms"), ("added to first byte (ms)", "added_ttfb_p50_ms"),
                     ("p50 to the last byte (ms)", "p50_ms"), ("p99 to the last byte (ms)", "p99_ms")]
        if name.endswith("32"):
            shown = [("answered a second", "rps"), ("p99 latency (ms)", "p99_ms")]
        cpu = "CPU per stream (ms)" if name.startswith("stream") else "CPU per request (ms)"
        for label, field in shown + [(cpu, "cpu_ms")]:
            cells = [show(field, f[s][name].get(field)) for s in columns]
            router = f.get(ROUTER, {}).get(name, {}).get(field)
            ratios = [ratio(f[s][name].get(field), router) for s in (GATEWAY, LIMITED)]
            rows.append([f"{what}: {label}", *cells, *("" if x is None else f"{x:.2f}" for x in ratios)])
    lines = ["| measure | " + " | ".join(columns) + " | gateway / vllm-router | 4 levels / vllm-router |",
             "| --- |" + " ---: |" * (len(columns) + 2)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    failed = [f"{s} {name}: {m['failed']} failed ({'; '.join(m.get('errors', []))})"
              for s, loads in f.items() for name, m in loads.items() if m["failed"]]
    avg = r["load_average"]
    lines += ["", f"{r['rounds']} round(s) of {r['seconds']:g} s a load and subject; medians. Load average (1 min) "
                  f"{min(avg):.1f} to {max(avg):.1f} over the run, on {r['machine']['cpus']} CPUs."]
    if r.get("variant"):
        lines.append("variant: " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in r["variant"].items()))
    if r.get("baseline"):
        lines.append(f"baseline: the gateway of {r['baseline']}. CPU, this checkout / baseline (no limits, 4 levels): "
                     + "; ".join(f"{what} x{ratio(f[GATEWAY][name].get('cpu_ms'), f[BASELINE][name].get('cpu_ms'))}, "
                                 f"x{ratio(f[LIMITED][name].get('cpu_ms'), f[BASELINE_LIMITED][name].get('cpu_ms'))}"
                                 for name, (what, _) in LOADS.items()))
    lines += [f"{name}: {said}" for name, said in r["rivals"].items() if said != "measured"]
    lines += [f"FAILED: {line}" for line in failed]
    lines += ["", "Aims (issue 14):"] + [f"- {a['says']}" for a in r["aims"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
