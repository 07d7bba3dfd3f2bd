"""Load for the benchmarks and the concurrency test: many greenlets, keep-alive connections, timings.

    python bench/loadgen.py --url http://127.0.0.1:8080 --key sk-... --model sim [--api chat] \
        [--stream] [--concurrency 1] [--requests N | --duration S] [--max-tokens 16] \
        [--conversations TURNS [--system-words W] [--user-words W]] [--spread F] [--warmup S]

Every request is the same one, or, with --conversations, each client holds
conversations of TURNS turns one after another: a system prompt every
conversation shares, then each turn a user message of words no other request
has, and the answer sent back as the assistant's message, so a conversation's
history grows as a chat client's does. One turn and no system prompt is a load
in which no two requests share a prefix. --spread F asks each conversation's
turns for a number of tokens drawn between (1 - F) and (1 + F) times
--max-tokens: answers vary in length, as real ones do, and clients fall out of
the lockstep in which round-robin sent every client's next turn to the replica
of its last.

Prints one JSON object: requests sent, answered, failed (with a sample of the
errors), latency and time to first byte percentiles (and the mean) in
milliseconds, and requests a second, over the requests started after the
warm-up. Exits 1 when any request failed. Uses llmgw's own engine
client, which is the cheapest HTTP/1.1 client at hand, so the generator
spends as little as possible of the machine it shares.
"""

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import gevent  # noqa: E402

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


def words(tag: str, count: int) -> str:
    """COUNT words, each TAG and its number: no two tags make a word in common."""
    return " ".join(f"{tag}{i}" for i in range(count))


def answer_text(raw: bytes, stream: bool) -> str:
    """The text of a chat answer: a whole one's message, or a stream's deltas joined."""
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"] or ""
    text = []
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            choices = json.loads(event[6:]).get("choices") or [{}]
            text.append(choices[0].get("delta", {}).get("content") or "")
    return "".join(text)


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
    parser.add_argument("--conversations", type=int, default=0, metavar="TURNS",
                        help="hold conversations of TURNS turns (chat only) instead of sending one body")
    parser.add_argument("--system-words", type=int, default=0, help="the system prompt every conversation shares")
    parser.add_argument("--user-words", type=int, default=32, help="each turn's user message")
    parser.add_argument("--spread", type=float, default=0.0, help="with --conversations: vary each answer's "
                        "length by up to this fraction of --max-tokens")
    parser.add_argument("--warmup", type=float, default=0.0, help="seconds whose requests are not counted")
    args = parser.parse_args(argv)
    if args.conversations and (args.api != "chat" or not args.duration or args.requests):
        parser.error("--conversations holds chats for a --duration: use it with --api chat and without --requests")
    raise_fd_limit()

    path, make_body, ends = APIS[args.api]
    path = args.path or path
    body = json.dumps(make_body(args.model, args.max_tokens, args.stream)).encode()
    headers = f"Authorization: Bearer {args.key}\r\n".encode() if args.key else b""
    target = Target(args.url)
    pool = Pool(connect_timeout=10, max_idle=args.concurrency + 16)
    latencies, ttfbs, errors = [], [], []
    state = {"sent": 0}
    counted_from = time.monotonic() + args.warmup
    deadline = time.monotonic() + args.warmup + args.duration

    def one(body=body, keep=False):
        """Send BODY once; with KEEP, return the answer's text (None when it failed)."""
        state["sent"] += 1
        counted = time.monotonic() >= counted_from
        started = time.perf_counter()
        kept = []
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
                if keep:
                    kept.append(piece)
            resp.release()
            if resp.status != 200 or not done:
                errors.append(f"status {resp.status}, finished: {done}")
                return None
        except (UpstreamError, OSError) as e:
            errors.append(f"{type(e).__name__}: {e}")
            return None
        if counted:
            latencies.append(time.perf_counter() - started)
            ttfbs.append(first if first is not None else latencies[-1])
        return answer_text(b"".join(kept), args.stream) if keep else ""

    def more() -> bool:
        return state["sent"] < args.requests if args.requests else time.monotonic() < deadline

    def worker(client: int):
        system = [{"role": "system", "content": words("s", args.system_words)}] if args.system_words else []
        draw = random.Random(client)  # the same lengths in every run
        for number in itertools.count():
            messages = list(system)
            for turn in range(args.conversations):
                if not more():
                    return
                messages.append({"role": "user", "content": words(f"c{client}n{number}t{turn}w", args.user_words)})
                limit = max(1, round(args.max_tokens * draw.uniform(1 - args.spread, 1 + args.spread)))
                answer = one(json.dumps({**make_body(args.model, limit, args.stream),
                                         "messages": messages}).encode(), keep=True)
                if answer is None:
                    break  # a conversation whose turn failed is left; the next starts afresh
                messages.append({"role": "assistant", "content": answer})

    def next_one() -> bool:
        # Greenlets switch only on I/O, so the count needs no lock.
        if not more():
            return False
        one()  # counts itself as sent before its first wait
        return True

    if args.conversations:
        started = time.perf_counter()
        gevent.joinall([gevent.spawn(worker, client) for client in range(args.concurrency)])
        elapsed = time.perf_counter() - started
    else:
        # With as many clients as requests, every request is sent at once: the concurrency test's shape.
        elapsed = closed_loop(min(args.concurrency, args.requests) if args.requests else args.concurrency, next_one)
    pool.close()
    ms = lambda v: round(v * 1000, 3) if v is not None else None  # noqa: E731
    result = {
        "requests": state["sent"], "ok": len(latencies), "failed": len(errors), "errors": errors[:5],
        "seconds": round(elapsed, 3), "rps": round(len(latencies) / elapsed, 1) if elapsed else None,
        "p50_ms": ms(percentile(latencies, 50)), "p99_ms": ms(percentile(latencies, 99)),
        "ttfb_p50_ms": ms(percentile(ttfbs, 50)), "ttfb_p99_ms": ms(percentile(ttfbs, 99)),
        "ttfb_p95_ms": ms(percentile(ttfbs, 95)), "ttfb_mean_ms": ms(sum(ttfbs) / len(ttfbs) if ttfbs else None),
    }
    print(json.dumps(result))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
