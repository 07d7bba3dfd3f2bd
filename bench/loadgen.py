"""Load for the benchmarks and the concurrency test: many greenlets, keep-alive connections, timings.

    python bench/loadgen.py --url http://127.0.0.1:8080 --key sk-... --model sim \
        [--stream] [--concurrency 1] [--requests N | --duration S] [--max-tokens 16] [--path P --body FILE]

Prints one JSON object: requests sent, answered, failed (with a sample of the
errors), latency and time to first byte percentiles in milliseconds, and
requests a second. Exits 1 when any request failed. Uses llmgw's own engine
client, which is the cheapest HTTP/1.1 client at hand, so the generator
spends as little as possible of the machine it shares.
"""

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402
from gevent.pool import Pool as GreenletPool  # noqa: E402

from llmgw.gateway.upstream import Pool, Target, UpstreamError  # noqa: E402
from llmgw.procs import raise_fd_limit  # noqa: E402


def percentile(values, p):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", default="")
    parser.add_argument("--model", default="sim")
    parser.add_argument("--path", default="/v1/chat/completions")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=0, help="stop after this many (0: use --duration)")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--body", help="a JSON file with the request to send (its model, max_tokens and stream "
                        "are set from the options), instead of a one-word chat")
    args = parser.parse_args(argv)
    raise_fd_limit()

    request = {"messages": [{"role": "user", "content": "benchmark"}]}
    if args.body:
        with open(args.body) as f:
            request = json.load(f)
    body = json.dumps({**request, "model": args.model, "max_tokens": args.max_tokens,
                       "stream": args.stream}).encode()
    headers = f"Authorization: Bearer {args.key}\r\n".encode() if args.key else b""
    target = Target(args.url)
    pool = Pool(connect_timeout=10, max_idle=args.concurrency + 16)
    latencies, ttfbs, errors = [], [], []
    state = {"sent": 0}
    deadline = time.monotonic() + args.duration

    def one():
        started = time.perf_counter()
        try:
            resp = pool.request(target, "POST", args.path, body, first_byte=args.timeout, headers=headers,
                                deadline=time.monotonic() + args.timeout)
            first = None
            done = not args.stream
            for piece in resp.iter_body(idle=args.timeout):
                if first is None:
                    first = time.perf_counter() - started
                # A chat stream ends with [DONE], a Messages stream with message_stop.
                if args.stream and (b"[DONE]" in piece or b"event: message_stop" in piece):
                    done = True
            resp.release()
            if resp.status != 200 or not done:
                errors.append(f"status {resp.status}, finished: {done}")
                return
        except (UpstreamError, OSError) as e:
            errors.append(f"{type(e).__name__}: {e}")
            return
        latencies.append(time.perf_counter() - started)
        ttfbs.append(first if first is not None else latencies[-1])

    def worker():
        while True:
            if args.requests:
                if state["sent"] >= args.requests:
                    return
            elif time.monotonic() >= deadline:
                return
            state["sent"] += 1
            one()

    started = time.perf_counter()
    if args.requests and args.concurrency >= args.requests:
        # Everything at once: the concurrency test's shape.
        group = GreenletPool(args.requests)
        for _ in range(args.requests):
            state["sent"] += 1
            group.spawn(one)
        group.join()
    else:
        gevent.joinall([gevent.spawn(worker) for _ in range(args.concurrency)])
    elapsed = time.perf_counter() - started
    pool.close()
    ms = lambda v: round(v * 1000, 3) if v is not None else None  # noqa: E731
    result = {
        "requests": state["sent"], "ok": len(latencies), "failed": len(errors), "errors": errors[:5],
        "seconds": round(elapsed, 3), "rps": round(len(latencies) / elapsed, 1) if elapsed else None,
        "p50_ms": ms(percentile(latencies, 50)), "p99_ms": ms(percentile(latencies, 99)),
        "ttfb_p50_ms": ms(percentile(ttfbs, 50)), "ttfb_p99_ms": ms(percentile(ttfbs, 99)),
    }
    print(json.dumps(result))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
