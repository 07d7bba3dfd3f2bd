"""How fast the mirror hands out weights, beside reading the same file locally in the same run.

    python bench/mirror.py [--quick] [--size-mib 512] [--out bench/results/mirror.json]

A file of random bytes is placed in a mirror version; `mirror.py` runs as in
service; 1, 2, 4 and 8 fetchers (threads in this process, each its own
connection, reading in 1 MiB pieces and throwing the bytes away) download it at
once. The baseline is this process reading the file from disk (the page cache,
after the first read) in the same 1 MiB pieces. Reported: aggregate MiB/s, and
the ratio to the local read.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llmgw.procs import free_port, http_status, wait_for  # noqa: E402

CHUNK = 1 << 20


def read_local(path: str) -> float:
    started = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(CHUNK):
            pass
    return time.perf_counter() - started


def fetch(url: str) -> int:
    got = 0
    with urllib.request.urlopen(url, timeout=300) as resp:
        while True:
            piece = resp.read(CHUNK)
            if not piece:
                return got
            got += len(piece)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="A 64 MiB file.")
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "mirror.json"))
    args = parser.parse_args()
    size = (64 if args.quick else args.size_mib) << 20
    tmp = tempfile.mkdtemp(prefix="llmgw-mirror-bench-")
    folder = os.path.join(tmp, "models", "bench", "v1")
    os.makedirs(folder)
    path = os.path.join(folder, "weights.bin")
    with open(path, "wb") as f:
        for _ in range(size // CHUNK):
            f.write(os.urandom(CHUNK))
    files, api = free_port(), free_port()
    with open(os.path.join(tmp, "mirror.log"), "wb") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "mirror.py"), "--dir", os.path.join(tmp, "models"),
                                 "--listen", f"127.0.0.1:{files}", "--api-listen", f"127.0.0.1:{api}",
                                 "--metrics-listen", f"127.0.0.1:{free_port()}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for("the mirror", 20, lambda: http_status(f"http://127.0.0.1:{api}/api/v1/health") == 200)
        url = f"http://127.0.0.1:{files}/bench/v1/weights.bin"
        fetch(url)  # the checksum is computed on the first request for a file put in by hand; warm it too
        read_local(path)
        local = min(read_local(path) for _ in range(3))
        result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                  "file_mib": size >> 20, "local_read_mib_s": round((size >> 20) / local), "fetchers": {}}
        for n in (1, 2, 4, 8):
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                got = sum(pool.map(fetch, [url] * n))
            seconds = time.perf_counter() - started
            assert got == size * n
            rate = (got >> 20) / seconds
            result["fetchers"][str(n)] = {"mib_s": round(rate), "ratio_to_local": round(rate / result["local_read_mib_s"], 2)}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"local read {result['local_read_mib_s']} MiB/s; through the mirror: " + ", ".join(
        f"{n} fetcher(s) {r['mib_s']} MiB/s (x{r['ratio_to_local']})" for n, r in result["fetchers"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
