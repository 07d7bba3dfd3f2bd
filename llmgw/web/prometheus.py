"""Series read back from Prometheus' query API (`monitoring.prometheus`), for the pages' history charts.

Every query is bounded: Prometheus is told to give up after QUERY_SECONDS, the whole exchange must end
within them too, and an answer larger than ANSWER_BYTES is not read on. Whatever goes wrong is said to
the page as one sentence with what to check (`Unavailable`), never as Prometheus' or urllib's error
text, which is logged for the operator instead. NaN and infinite values are dropped where they are
read: Prometheus writes them as strings ("NaN" for a quantile of no requests), and one of them once
broke a whole chart's drawing in the Go llmgw.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import math
import time
import urllib.error
import urllib.parse
import urllib.request

log = logging.getLogger("llmgw.prometheus")

QUERY_SECONDS = 5.0  # one chart's query, asked and answered; a page stops at the first that fails
ANSWER_BYTES = 4 << 20  # 60 points of 50 series is about 150 KiB; far more means a query gone wrong
MOST_SERIES = 50  # series kept of one answer, those with the largest values (a chart draws seven)
CHUNK = 64 * 1024


class Unavailable(Exception):
    """No series could be had; the message is the page's sentence."""


@dataclasses.dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    points: dict[float, float]  # unix time -> value; times with no value (or NaN) are absent


def query_range(base: str, query: str, start: float, end: float, step: float, seconds: float = QUERY_SECONDS,
                most_bytes: int = ANSWER_BYTES) -> list[Series]:
    """QUERY's series from START to END every STEP (unix seconds) from the Prometheus at BASE, largest first;
    raises Unavailable with the page's sentence."""
    params = urllib.parse.urlencode({"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                     "step": f"{step:g}", "timeout": f"{seconds:g}s"})
    url = f"{base.rstrip('/')}/api/v1/query_range?{params}"
    deadline = time.monotonic() + seconds
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "application/json"}),
                                    timeout=seconds) as resp:
            body = _read(resp, most_bytes, deadline, base)
    except urllib.error.HTTPError as e:
        with e:
            body = e.read(CHUNK)
        raise _refusal(base, query, e.code, body) from None
    except (OSError, http.client.HTTPException) as e:
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            raise Unavailable(f"Prometheus at {base} did not answer within {seconds:g} s; a shorter window asks "
                              "less of it, and its own log says what keeps it busy.") from None
        log.warning("Prometheus at %s cannot be reached: %s", base, e)
        raise Unavailable(f"Prometheus at {base} cannot be reached from this gateway. Check that it runs there "
                          "and that monitoring.prometheus names it (such as http://prometheus:9090).") from None
    try:
        answer = json.loads(body)
        if answer.get("status") != "success" or answer["data"]["resultType"] != "matrix":
            raise ValueError(f"status {answer.get('status')!r}")
        return _series(answer["data"]["result"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("Prometheus at %s answered %r with something unreadable: %s", base, query, e)
        raise Unavailable(f"What answers at {base} is not Prometheus' query API; monitoring.prometheus is its "
                          "base address, such as http://prometheus:9090.") from None


def _read(resp, most_bytes: int, deadline: float, base: str) -> bytes:
    # A read from a socket has the timeout each time; a Prometheus that trickles its answer must not hold
    # the page past the deadline.
    parts, size = [], 0
    while True:
        chunk = resp.read(CHUNK)
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        if size > most_bytes:
            limit = f"{most_bytes >> 20} MiB" if most_bytes >= 1 << 20 else f"{most_bytes} bytes"
            raise Unavailable(f"Prometheus at {base} answered one chart with more than {limit}, more than a chart "
                              "can show; a shorter window asks for less.")
        if time.monotonic() > deadline:
            raise TimeoutError
        parts.append(chunk)


def _refusal(base: str, query: str, status: int, body: bytes) -> Unavailable:
    try:
        answer = json.loads(body)
        kind, text = answer.get("errorType"), answer.get("error")
    except (ValueError, AttributeError):
        kind, text = None, None
    log.warning("Prometheus at %s answered %s to %r: %s %s", base, status, query, kind, text)
    if kind == "timeout" or status == 503:
        return Unavailable(f"Prometheus at {base} gave up on a chart's query (it answered {status}); a shorter "
                           "window asks less of it.")
    if kind is None:
        return Unavailable(f"What answers at {base} is not Prometheus' query API (it answered {status}); "
                           "monitoring.prometheus is its base address, such as http://prometheus:9090.")
    return Unavailable(f"Prometheus at {base} refused a chart's query ({kind}, {status}); this gateway's log "
                       "has its words. Prometheus 2.x or later answers these queries.")


def _value(text) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _series(result: list) -> list[Series]:
    found = []
    for item in result:
        labels = {str(k): str(v) for k, v in item["metric"].items()}
        points = {}
        for t, text in item["values"]:
            value = _value(text)
            if value is not None:
                points[float(t)] = value
        if points:
            found.append(Series(labels, points))
    found.sort(key=lambda s: max(s.points.values()), reverse=True)
    return found[:MOST_SERIES]
