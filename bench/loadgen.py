"""Load for the benchmarks and the concurrency test: many greenlets, keep-alive connections, timings.

    python bench/loadgen.py --url http://127.0.0.1:8080 --key sk-... --model sim [--api chat] \
        [--stream] [--concurrency 1] [--requests N | --duration S] [--max-tokens 16]

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

from llmgw.gateway.upstream import Pool, Target, UpstreamError  # noqa: E402
from llmgw.loadloop import closed_loop, percentile  # noqa: E402
from llmgw.procs import raise_fd_limit  # noqa: E402

# The client APIs it speaks: the path, the body of one request, and what ends a whole stream.
APIS = {
    "chat": ("/v1/chat/completions", lambda model, limit, stream: {
        "model": model, "max_tokens": limit, "stream": stream, "messages": [{"role": "user", "content": "benchmark"}]},
        (b"[DONE]",)),
    "responses": ("/v1/responses", lambda model, limit, stream: {
        "model": model, "max_output_tokens": limit, "stream": stream, "input": "benchmark"},
        (b"event: response.completed", b"event: response.incomplete")),
    "messages": ("/v1/messages", lambda model, limit, stream: {
        "model": model, "max_tokens": limit, "stream": stream, "messages": [{"role": "user", "content": "benchmark"}]},
        (b"event: message_stop",)),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", default="")
    parser.add_argument("--model", default="sim")
    parser.add_argument("--api", choices=sorted(APIS), default="chat")
    parser.add_argument("--path", help="instead of the API's own (an engine's, or a gateway's)")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=0, help="stop after this many (0: use --duration)")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    raise_fd_limit()

    path, make_body, ends = APIS[args.api]
    path = args.path or path
    body = json.dumps(make_body(args.model, args.max_tokens, args.stream)).encode()
    headers = f"Authorization: Bearer {args.key}\r\n".encode() if args.key else b""
    target = Target(args.url)
    pool = Pool(connect_timeout=10, max_idle=args.concurrency + 16)
    latencies, ttfbs, errors = [], [], []
    state = {"sent": 0}
    deadline = time.monotonic() + args.duration

    def one():
        started = time.perf_counter()
        try:
            resp = pool.request(target, "POST", path, body, first_byte=args.timeout, headers=headers,
                                deadline=time.monotonic() + args.timeout)
            first = None
            done = not args.stream
            for piece in resp.iter_body(idle=args.timeout):
                if first is None:
                    first = time.perf_counter() - started
                if args.stream and any(end in piece for end in ends):
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

    def next_one() -> bool:
        # Greenlets switch only on I/O, so the count needs no lock.
        if args.requests:
            if state["sent"] >= args.requests:
                return False
        elif time.monotonic() >= deadline:
            return False
        state["sent"] += 1
        one()
        return True

    # With as many clients as requests, every request is sent at once: the concurrency test's shape.
    elapsed = closed_loop(min(args.concurrency, args.requests) if args.requests else args.concurrency, next_one)
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
