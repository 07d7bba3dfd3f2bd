"""What a held stream's memory is made of, in one gateway worker: by part of the request path, and by site.

    python bench/memprofile.py [--streams 2000] [--out bench/results/memprofile.json]

It holds STREAMS streams open at once as bench/gateway.py does (the same rig, engine and load), with the
gateway started through bench/probe.py's memory probe: the worker traces every allocation from its start,
and is asked for a snapshot idle (after the warm-up) and while it holds the streams. What the held streams
added is each allocation site's bytes held minus idle, divided by the streams, and put down to the part
of the request path that asked for it (bench/cpuprofile.py's PARTS, the innermost that an allocation's
stack passes through). Besides: the greenlets the streams added, with the stacks they keep while switched
out, and the worker's resident memory against what was traced (the rest is memory Python's allocator does
not see: the interpreter's own arenas, C libraries, fragmentation). Tracing slows and grows the worker, so
its resident memory here is not the benchmark's; bench/gateway.py's is.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.cpuprofile import part_of, short  # noqa: E402
from bench.gateway import measure_held_streams  # noqa: E402
from llmgw.procs import raise_fd_limit, wait_for  # noqa: E402


def snapshots(prefix: str) -> tuple[dict, callable]:
    """Where the snapshots land, and the AT hook of measure_held_streams that takes them."""
    taken: dict = {}

    def at(rig, when: str) -> None:
        path = f"{prefix}.{rig.worker}.{len(taken) + 1}.json"
        os.kill(rig.worker, signal.SIGUSR2)
        wait_for(f"the worker's snapshot {when}", 300, lambda: os.path.exists(path), interval=0.5)
        with open(path) as f:
            taken[when] = json.load(f)

    return taken, at


def added(idle: dict, held: dict, streams: int) -> dict:
    """What the held streams added, a stream: by part and by site."""
    by_stack = collections.Counter()
    blocks = collections.Counter()
    for sign, snap in ((-1, idle), (1, held)):
        for site in snap["sites"]:
            key = tuple(tuple(frame) for frame in site["stack"])
            by_stack[key] += sign * site["bytes"]
            blocks[key] += sign * site["blocks"]
    parts, sites = collections.Counter(), collections.Counter()
    for stack, n in by_stack.items():
        frames = [(short(file), "") for file, _ in stack]
        parts[part_of(frames)] += n
        leaf = f"{short(stack[-1][0])}:{stack[-1][1]}" if stack else "?"
        ours = next((f"{short(file)}:{line}" for file, line in reversed(stack)
                     if short(file).startswith("llmgw/")), None)
        sites[(leaf, ours)] += n
    kib = lambda n: round(n / 1024 / streams, 2)  # noqa: E731
    return {"traced_kib_per_stream": kib(held["traced_bytes"] - idle["traced_bytes"]),
            "greenlets_per_stream": round((held["greenlets"] - idle["greenlets"]) / streams, 2),
            "greenlet_stack_kib_per_stream": kib(held["greenlet_stacks_saved_bytes"] - idle["greenlet_stacks_saved_bytes"]),
            "parts": [{"part": p, "kib": kib(n)} for p, n in parts.most_common() if abs(kib(n)) >= 0.01],
            "sites": [{"allocated_at": leaf, "in_llmgw_at": ours, "kib": kib(n)}
                      for (leaf, ours), n in sites.most_common(20)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "memprofile.json"))
    args = parser.parse_args()
    raise_fd_limit()
    tmp = tempfile.mkdtemp(prefix="llmgw-memprofile-")
    prefix = os.path.join(tmp, "memory")
    taken, at = snapshots(prefix)
    held = measure_held_streams(tmp, args.streams, (sys.executable, os.path.join(ROOT, "bench", "probe.py"),
                                                     "memory", prefix), at)
    result = {"held": held, **added(taken["idle"], taken["held"], args.streams)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(report(result))
    return 0


def report(r: dict) -> str:
    h = r["held"]
    lines = [f"{h['streams']:,} streams held ({h['completed']:,} completed, {h['failed']} failed), traced worker: "
             f"{h['kib_per_stream']} KiB of resident memory a stream, {r['traced_kib_per_stream']} KiB of it traced "
             f"(Python's allocator); {r['greenlets_per_stream']} greenlets a stream, keeping "
             f"{r['greenlet_stack_kib_per_stream']} KiB of stack a stream while switched out", "",
             "| part | KiB a stream |", "| --- | ---: |"]
    lines += [f"| {p['part']} | {p['kib']:.2f} |" for p in r["parts"]]
    lines += ["", "| allocated at | from llmgw at | KiB a stream |", "| --- | --- | ---: |"]
    lines += [f"| {s['allocated_at']} | {s['in_llmgw_at'] or ''} | {s['kib']:.2f} |" for s in r["sites"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
