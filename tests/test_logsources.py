"""The agent's log ring and the engines' log files, read with a cursor: what a follower sees and what it is told
it missed."""

from __future__ import annotations

import logging
import time

from llmgw.node import logsources
from llmgw.node.logsources import LogRing, read_file


def log(ring: LogRing, *messages: str) -> None:
    for message in messages:
        ring.emit(logging.LogRecord("llmgw.agent", logging.INFO, __file__, 1, message, None, None))


def test_the_ring_keeps_the_newest_lines_in_order_and_follows_them():
    ring = LogRing(kept=3)
    empty = ring.read(None, 10)
    assert empty.lines == [] and not empty.skipped
    log(ring, "line 1", "line 2")
    assert ring.read(empty.cursor, 10).lines == ["line 1", "line 2"]
    log(ring, "line 3", "line 4", "line 5")
    assert ring.read(None, 10).lines == ["line 3", "line 4", "line 5"]
    assert ring.read(None, 2).lines == ["line 4", "line 5"]
    first = ring.read(None, 10)
    log(ring, "line 6")
    then = ring.read(first.cursor, 10)
    assert then.lines == ["line 6"] and not then.skipped
    assert ring.read(then.cursor, 10).lines == []
    # More came than are kept: the follower gets what is kept, and is told the rest was lost.
    log(ring, "line 7", "line 8", "line 9", "line 10")
    lost = ring.read(then.cursor, 10)
    assert lost.lines == ["line 8", "line 9", "line 10"] and lost.skipped
    # More came than asked for: the newest, and skipped.
    log(ring, "line 11", "line 12")
    short = ring.read(lost.cursor, 1)
    assert short.lines == ["line 12"] and short.skipped


def test_a_record_of_several_lines_is_several_lines_and_a_long_one_is_cut():
    ring = LogRing()
    log(ring, "Traceback:\n  File x\nValueError", "x" * 5000)
    lines = ring.read(None, 10).lines
    assert lines[:3] == ["Traceback:", "  File x", "ValueError"]
    assert len(lines[3]) == logsources.LONGEST_LINE and lines[3].endswith("…")


def test_a_cursor_from_before_a_restart_reads_the_new_agents_lines():
    before = LogRing()
    log(before, "old agent")
    cursor = before.read(None, 10).cursor
    while time.time_ns() // 1000 <= cursor:  # a restart takes seconds; here, at least the clock's next tick
        pass
    after = LogRing()  # the agent started again: numbers start at its start time
    log(after, "new agent 1", "new agent 2")
    page = after.read(cursor, 10)
    assert page.lines == ["new agent 1", "new agent 2"] and page.skipped
    # A cursor this agent never gave (the clock was set back before it started): its lines, skipped.
    assert after.read(after.read(None, 1).cursor + 10**6, 10).lines == ["new agent 1", "new agent 2"]


def test_a_reply_holds_a_bounded_amount_of_text(monkeypatch):
    monkeypatch.setattr(logsources, "REPLY_BYTES", 100)
    ring = LogRing()
    log(ring, *(f"{i:02d}" + "x" * 20 for i in range(10)))
    page = ring.read(0, 2000)
    assert [line[:2] for line in page.lines] == ["06", "07", "08", "09"] and page.skipped


def test_an_engines_log_is_followed_by_whole_lines(tmp_path):
    path = tmp_path / "s.log"
    assert read_file(str(path), None, 10).lines == []  # not written yet
    path.write_bytes(b"one\ntwo\nthr")
    tail = read_file(str(path), None, 10)
    assert tail.lines == ["one", "two", "thr"] and tail.cursor == path.stat().st_size
    start = read_file(str(path), 0, 10)
    assert start.lines == ["one", "two"] and start.cursor == 8  # "thr" is still being written
    with open(path, "ab") as f:
        f.write(b"ee\nfour\nfi")
    more = read_file(str(path), start.cursor, 10)
    assert more.lines == ["three", "four"] and not more.skipped
    assert read_file(str(path), more.cursor, 10).lines == []
    # The file was replaced by a shorter one: its tail, and skipped.
    path.write_bytes(b"new\n")
    replaced = read_file(str(path), more.cursor, 10)
    assert replaced.lines == ["new"] and replaced.skipped and replaced.cursor == 4


def test_only_the_end_of_a_long_engine_log_is_read_and_no_half_line(tmp_path, monkeypatch):
    monkeypatch.setattr(logsources, "FILE_WINDOW", 16)
    path = tmp_path / "s.log"
    path.write_bytes(b"aaaaaaaa\nbbbbbbbb\ncccccccc\n")  # 27 bytes: the window starts inside "bbbbbbbb"
    assert read_file(str(path), None, 10).lines == ["cccccccc"]
    behind = read_file(str(path), 0, 10)
    assert behind.lines == ["cccccccc"] and behind.skipped and behind.cursor == 27
    path.write_bytes(b"aaaaaaaaaa\nbbbb\ncccc\n")  # 21 bytes: the window starts exactly at "bbbb"
    assert read_file(str(path), None, 10).lines == ["bbbb", "cccc"]
    assert read_file(str(path), None, 1).lines == ["cccc"]


def test_bytes_that_are_not_utf8_are_shown_not_refused(tmp_path):
    path = tmp_path / "s.log"
    path.write_bytes(b"caf\xe9\n")
    assert read_file(str(path), None, 10).lines == ["caf\ufffd"]
