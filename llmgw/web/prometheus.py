"""Series read back from Prometheus' query API (`monitoring.prometheus`), for the pages' history charts.

Every query is bounded: Prometheus is told to give up after QUERY_SECONDS, the whole exchange must end
within them too, and an answer larger than ANSWER_BYTES is not read on. The exchange goes through the
gateway's own HTTP client (llmgw/gateway/upstream.py), whose every read waits only for what is left of
the deadline: urllib's timeout restarted at each read, so a server sending its headers, or a body
announced as 100,000 bytes, a byte a second held a page for as long as it kept on. Whatever goes wrong
is said to the page as one sentence with what to check (`Unavailable`), never as Prometheus' error
text, which is logged for the operator instead.

What is read is only what a chart can draw: NaN and infinite values are dropped (Prometheus writes
them as strings, "NaN" for a quantile of no requests, and one of them once broke a whole chart's
drawing in the Go llmgw), as are values no figure of ours reaches and times outside the window asked
for; a value too small for a float to hold is 0. A time of 1e999 and two series of 1e308 each made
the page a 500 before.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import ssl
import sys
import urllib.parse

from llmgw.gateway import upstream

log = logging.getLogger("llmgw.prometheus")

QUERY_SECONDS = 5.0  # one chart's query, asked and answered; a page stops at the first that fails
ANSWER_BYTES = 4 << 20  # 60 points of 50 series is about 150 KiB; far more means a query gone wrong
REFUSAL_BYTES = 64 * 1024  # of an answer other than 200: its error and errorType are near the start
MOST_SERIES = 50  # series kept of one answer, those with the largest values (a chart draws seven)
# No figure a chart shows comes near: 1e15 bytes is a petabyte of memory, 1e15 requests a minute
# more than the world sends. Past it a value is an error, and fifty of 1e308 summed are infinite.
LARGEST = 1e15


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
    status, headers, body = _get(base, f"/api/v1/query_range?{params}", seconds, most_bytes)
    if status != 200:
        raise _refusal(base, query, status, headers, body)
    try:
        answer = json.loads(body)
        if answer.get("status") != "success" or answer["data"]["resultType"] != "matrix":
            raise ValueError(f"status {answer.get('status')!r}")
        return _series(answer["data"]["result"], start - step, end + step)
    # RecursionError: 100,000 `[` nest deeper than the parser goes; OverflowError: a time of 10**400.
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
        log.warning("Prometheus at %s answered %r with something unreadable: %s", base, query, e)
        raise Unavailable(f"What answers at {base} is not Prometheus' query API; monitoring.prometheus is its "
                          "base address, such as http://prometheus:9090.") from None


def _get(base: str, path: str, seconds: float, most_bytes: int) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of GET PATH at BASE, the whole exchange within SECONDS. A body of 200 past
    MOST_BYTES raises Unavailable; of another status, it is cut."""
    try:
        return upstream.fetch(base, path, seconds=seconds, most_bytes=most_bytes, refusal_bytes=REFUSAL_BYTES,
                              headers=b"Accept: application/json\r\n")
    except ValueError:
        raise Unavailable(f"monitoring.prometheus ({base}) is not an http:// or https:// address; it is Prometheus' "
                          "base address, such as http://prometheus:9090.") from None
    except upstream.TooLarge:
        shown = f"{most_bytes >> 20} MiB" if most_bytes >= 1 << 20 else f"{most_bytes} bytes"
        raise Unavailable(f"Prometheus at {base} answered one chart with more than {shown}, more than "
                          "a chart can show; a shorter window asks for less.") from None
    except upstream.UpstreamError as e:
        log.warning("Prometheus at %s, asked %s: %s (%s)", base, path, e, e.phase)
        if e.phase in ("first_byte", "idle", "total"):
            raise Unavailable(f"Prometheus at {base} did not answer within {seconds:g} s; a shorter window asks "
                              "less of it, and its own log says what keeps it busy.") from None
        if e.phase == "protocol":
            raise Unavailable(f"What answers at {base} does not speak HTTP; monitoring.prometheus is Prometheus' "
                              "base address, such as http://prometheus:9090.") from None
        raise _unreachable(base) from None
    except ssl.SSLError as e:  # the client's TLS handshake, which is not one of its phases
        log.warning("Prometheus at %s: TLS failed: %s", base, e)
        raise Unavailable(f"Prometheus at {base} was not accepted over TLS (this gateway's log says why); check "
                          "its certificate, or that it serves https at that port.") from None
    except OSError as e:
        log.warning("Prometheus at %s: %s", base, e)
        raise _unreachable(base) from None


def _unreachable(base: str) -> Unavailable:
    return Unavailable(f"Prometheus at {base} cannot be reached from this gateway. Check that it runs there and "
                       "that monitoring.prometheus names it (such as http://prometheus:9090).")


def _refusal(base: str, query: str, status: int, headers: dict[str, str], body: bytes) -> Unavailable:
    if 300 <= status < 400 and headers.get("location"):
        # Not followed: the pages ask only the address they were given.
        where = headers["location"][:200]
        log.warning("Prometheus at %s answered %s to %r, to %s", base, status, query, where)
        return Unavailable(f"Prometheus at {base} sends the pages elsewhere ({status} to {where}); set "
                           "monitoring.prometheus to the address it leads to.")
    try:
        answer = json.loads(body)
        kind, text = answer.get("errorType"), answer.get("error")
    except (ValueError, AttributeError, RecursionError):
        kind, text = None, None
    log.warning("Prometheus at %s answered %s to %r: %s %s", base, status, query, kind, text)
    if kind == "timeout" or status == 503:
        return Unavailable(f"Prometheus at {base} gave up on a chart's query (it answered {status}); a shorter "
                           "window asks less of it.")
    if kind is None or not isinstance(kind, str):
        return Unavailable(f"What answers at {base} is not Prometheus' query API (it answered {status}); "
                           "monitoring.prometheus is its base address, such as http://prometheus:9090.")
    return Unavailable(f"Prometheus at {base} refused a chart's query ({kind[:60]}, {status}); this gateway's log "
                       "has its words. Prometheus 2.x or later answers these queries.")


def _value(text) -> float | None:
    """TEXT as a figure a chart can draw, or None: not a number, or past any figure of ours."""
    value = float(text)
    if not -LARGEST <= value <= LARGEST:  # NaN fails both
        return None
    # 5e-324 is a float, but no power of ten a chart's axis could use is as small.
    return value if abs(value) >= sys.float_info.min else 0.0


def _series(result: list, earliest: float, latest: float) -> list[Series]:
    found = []
    for item in result:
        labels = {str(k): str(v) for k, v in item["metric"].items()}
        points = {}
        for t, text in item["values"]:
            when, value = float(t), _value(text)
            if value is not None and earliest <= when <= latest:  # NaN is never inside
                points[when] = value
        if points:
            found.append(Series(labels, points))
    found.sort(key=lambda s: max(s.points.values()), reverse=True)
    return found[:MOST_SERIES]
