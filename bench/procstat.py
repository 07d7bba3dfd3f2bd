"""What the benchmarks read about processes from /proc: CPU time, children, resident memory."""

import os
import re
import time

CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """PID's threads now: thread id -> (its name, CPU seconds it has spent)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                name, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
        except OSError:
            continue  # it ended
        fields = rest.split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / CLK)
    return out


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except OSError:
                pass
    return out


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def settled_rss_kib(pid: int, interval: float = 0.5, calm: int = 3, limit: float = 15.0) -> int:
    """PID's resident memory once it stops growing: the most of its readings, taken when CALM readings
    INTERVAL apart in a row added nothing (or after LIMIT seconds). A worker still writing its streams'
    first events grows for a second or two more; read at once, 500 held streams were anywhere between
    22 and 32 KiB each on one commit."""
    most, still, started = rss_kib(pid), 0, time.monotonic()
    while still < calm and time.monotonic() - started < limit:
        time.sleep(interval)
        now = rss_kib(pid)
        still = still + 1 if now <= most else 0
        most = max(most, now)
    return most
