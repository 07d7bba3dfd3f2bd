"""What a node shows of its logs: the agent's own last 2,000 lines, and each engine's output, by name.

A source is a name the agent lists (`agent`, or a shard id it has a log of), never a path: the name is
looked up among those, and nothing asked for is ever joined onto a directory. Before, the shard's log
was found by joining the name asked for onto the shards folder, and `llmgw ctl logs NODE --source
/var/log/dpkg` printed the node's dpkg log.

Every read takes a cursor, so a reader can follow a source: a reply says where it ends (`cursor`), and
a request with `after` gets only what came since. Replies are bounded in lines and in bytes; a reply
that had to leave lines out says so (`skipped`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time

AGENT = "agent"
KEPT = 2000  # the agent's own lines kept: an engine install or a failed start fits; the journal keeps the rest
LONGEST_LINE = 2000  # characters of one line; a longer one is cut, marked with "…"
REPLY_BYTES = 256 * 1024  # text in one reply at most, whatever the lines asked for
FILE_WINDOW = 64 * 1024  # the end of an engine's log read at most, as the shard's last_output always has
LISTED = 200  # source names in one reply at most: live shards first, then past ones, newest first


@dataclasses.dataclass(frozen=True)
class Page:
    """What one read found: LINES, oldest first; CURSOR, to send as `after` for what comes next; SKIPPED,
    whether lines written after the `after` asked for were left out (more than asked, or no longer kept)."""
    lines: list[str]
    cursor: int
    skipped: bool = False


def _cut(line: str) -> str:
    return line if len(line) <= LONGEST_LINE else line[:LONGEST_LINE - 1] + "…"


def _within_bytes(lines: list[str]) -> list[str]:
    """The newest of LINES whose text fits REPLY_BYTES."""
    total = 0
    for i in range(len(lines) - 1, -1, -1):
        total += len(lines[i].encode("utf-8", "replace")) + 1
        if total > REPLY_BYTES:
            return lines[i + 1:]
    return lines


class LogRing(logging.Handler):
    """A logging handler keeping the agent's last KEPT lines, each with its number.

    Numbers start at the agent's start time in microseconds, so a cursor from before a restart is below
    every number of the new agent: a reader following across a restart gets the new agent's lines, told
    that some were skipped, instead of waiting for the numbers to catch up with its cursor."""

    def __init__(self, kept: int = KEPT):
        super().__init__()
        self.kept: collections.deque[tuple[int, str]] = collections.deque(maxlen=kept)
        self.next = time.time_ns() // 1000
        self.mutex = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # a record that cannot be formatted must not take the agent down
            self.handleError(record)
            return
        with self.mutex:
            for line in text.splitlines() or [""]:
                self.kept.append((self.next, _cut(line)))
                self.next += 1

    def read(self, after: int | None, most: int) -> Page:
        """The last MOST lines; with AFTER (an earlier cursor), only those numbered above it."""
        with self.mutex:
            kept = list(self.kept)
            last = self.next - 1
        if after is None or after > last:  # none asked, or a cursor this agent never gave (a clock set back)
            chosen = _within_bytes([text for _, text in kept[-most:]])
            return Page(chosen, last, after is not None)
        newer = [(n, text) for n, text in kept if n > after]
        chosen = _within_bytes([text for _, text in newer[-most:]])
        skipped = bool(newer) and (newer[0][0] != after + 1 or len(chosen) < len(newer))
        return Page(chosen, last, skipped)


def read_file(path: str, after: int | None, most: int) -> Page:
    """The last MOST lines of the file at PATH (an engine's log), its cursor a byte offset. With AFTER, only
    the whole lines written since: a line still being written waits for its end, so a progress line is not
    shown in pieces. A cursor beyond the end (the file was replaced) reads the new file's tail."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            following = after is not None and 0 <= after <= size
            start = after if following else max(0, size - FILE_WINDOW)
            begin = max(start, size - FILE_WINDOW)
            cut = begin > start or (begin > 0 and not following)  # the window may start inside a line
            f.seek(begin - 1 if cut else begin)
            data = f.read(size - begin + (1 if cut else 0))  # not what was written since the size was taken
    except OSError:
        return Page([], 0, after is not None)
    skipped = after is not None and (not following or begin > start)
    if cut:
        # The byte before the window says whether it starts a line; a line whose start is not in it is left out.
        newline = data.find(b"\n")
        data = data[newline + 1:] if newline != -1 else b""
        begin = size - len(data)
    end = len(data)
    if following:
        end = data.rfind(b"\n") + 1
        if end == 0 and len(data) >= FILE_WINDOW:
            end = len(data)  # one line longer than the window: shown cut rather than never
    lines = [_cut(line) for line in data[:end].decode("utf-8", "replace").splitlines()]
    chosen = _within_bytes(lines[-most:])
    return Page(chosen, begin + end, skipped or (after is not None and len(chosen) < len(lines)))


class LogSources:
    """The sources a node can read: its own log (RING) and the engines' logs ENGINE_LOGS() lists, as
    {shard id: log path}, live shards first."""

    def __init__(self, ring: LogRing, engine_logs):
        self.ring = ring
        self.engine_logs = engine_logs

    def names(self) -> list[str]:
        return [AGENT, *list(self.engine_logs())[:LISTED - 1]]

    def read(self, name: str, after: int | None, most: int) -> Page | None:
        """NAME's lines (see `LogRing.read` and `read_file`); None when the node has no source by that name."""
        if name == AGENT:
            return self.ring.read(after, most)
        path = self.engine_logs().get(name)
        return None if path is None else read_file(path, after, most)
