"""The gateway with a probe in each worker: a CPU sampler (bench/cpuprofile.py) or memory snapshots
(bench/memprofile.py).

    python bench/probe.py cpu|memory OUT_PREFIX [gateway.py's options]

Runs gateway.py as `python gateway.py [options]` does; nothing in llmgw changes, the probe is wrapped
around the gateway's own `post_worker_init`, and SIGUSR2 to a worker drives it.

cpu: the worker samples its main thread's Python stack whenever the process has spent another millisecond
of CPU (`ITIMER_PROF`), weighing each sample by the CPU the main thread spent since the one before (its
own clock). The first SIGUSR2 starts the sampling; the next stops it and writes OUT_PREFIX.PID.json. A
sample costs about 8 µs (40 frames), under 1% of the worker's CPU at one a millisecond. Only the main
thread is seen, where a gevent worker runs everything but ZeroMQ's I/O thread; bench/cpuprofile.py gives
the other threads' CPU from /proc. Why not py-spy: it reads stacks from outside and counts a thread as busy
when the kernel says it is runnable, which on a machine shared with other work includes waiting for the
CPU. Over 4 s of load here it counted 3,448 samples in 4 s (86% of the time) while the worker spent 0.72 s
of CPU (18%), most of the rest put down to gevent's hub, where a woken worker waits its turn.

memory: the worker traces its allocations from its start (`tracemalloc`, which slows it and grows it, so
its own figures are not the benchmark's), and each SIGUSR2 writes OUT_PREFIX.PID.N.json: what is allocated
now, grouped by where (the stack of the allocation), and the greenlets alive with the stack each has saved
while switched out.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import runpy
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This folder's gateway.py is not the gateway; the checkout's llmgw is what it runs.
sys.path[0] = ROOT

INTERVAL = 0.001  # seconds of the process's CPU between samples
TRACE_DEPTH = 16  # frames kept of each allocation's stack: enough to reach the part of llmgw that asked


def write_json(path: str, value) -> None:
    with open(path + ".partial", "w") as f:
        json.dump(value, f)
    os.rename(path + ".partial", path)  # a reader never sees half a file


class CpuSampler:
    def __init__(self, prefix: str):
        self.path = f"{prefix}.{os.getpid()}.json"
        self.on = False
        self.ns: collections.Counter = collections.Counter()
        self.last = 0
        signal.signal(signal.SIGPROF, self.sample)

    def toggle(self, *_) -> None:
        if not self.on:
            self.ns.clear()
            self.last = time.thread_time_ns()
            self.on = True
            signal.setitimer(signal.ITIMER_PROF, INTERVAL, INTERVAL)
            return
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        self.on = False
        write_json(self.path, [{"stack": list(stack), "ns": ns} for stack, ns in self.ns.items()])

    def sample(self, _signum, frame) -> None:
        now = time.thread_time_ns()
        weight, self.last = now - self.last, now
        stack = []
        while frame is not None:
            stack.append((frame.f_code.co_filename, frame.f_code.co_name))
            frame = frame.f_back
        self.ns[tuple(reversed(stack))] += weight


class MemorySnapshots:
    def __init__(self, prefix: str):
        import tracemalloc

        self.prefix = prefix
        self.taken = 0
        tracemalloc.start(TRACE_DEPTH)

    def toggle(self, *_) -> None:
        import tracemalloc

        import greenlet

        self.taken += 1
        gc.collect()
        snapshot = tracemalloc.take_snapshot()
        sites = [{"stack": [(f.filename, f.lineno) for f in stat.traceback], "bytes": stat.size,
                  "blocks": stat.count} for stat in snapshot.statistics("traceback")]
        greenlets = [g for g in gc.get_objects() if isinstance(g, greenlet.greenlet)]
        write_json(f"{self.prefix}.{os.getpid()}.{self.taken}.json", {
            "traced_bytes": tracemalloc.get_traced_memory()[0], "sites": sites,
            "greenlets": len(greenlets), "greenlet_stacks_saved_bytes": sum(g._stack_saved for g in greenlets)})


PROBES = {"cpu": CpuSampler, "memory": MemorySnapshots}


def main() -> None:
    kind, prefix = sys.argv[1], sys.argv[2]
    gateway = os.path.join(ROOT, "gateway.py")
    sys.argv = [gateway, *sys.argv[3:]]
    from llmgw.gateway import server

    original = server._post_worker_init

    def post_worker_init(worker) -> None:
        original(worker)
        probe = PROBES[kind](prefix)
        signal.signal(signal.SIGUSR2, probe.toggle)

    server._post_worker_init = post_worker_init
    runpy.run_path(gateway, run_name="__main__")


if __name__ == "__main__":
    main()
