"""Socket calls without gevent's detours (llmgw/gateway/sockio.py): what a send does not take still goes, whole
and in order, through gevent's wait for room; a read's wait is bounded by its timer, and a socket closed from
another greenlet wakes it."""

import socket
import time

import gevent
import gevent.socket
import pytest

from llmgw.gateway.sockio import SendTimeout, recv, send_all


def test_a_send_larger_than_the_buffer_arrives_whole():
    ours, theirs = gevent.socket.socketpair()
    data = bytes(range(256)) * 40_000  # 10 MB: far more than a socket buffer takes at once
    got, left = [], len(data)

    def read():
        nonlocal left
        while left > 0:
            got.append(theirs.recv(65536))
            left -= len(got[-1])
            gevent.sleep(0)

    reader = gevent.spawn(read)
    send_all(ours, b"head")
    send_all(ours, data[4:])
    reader.join(timeout=30)
    assert b"".join(got) == b"head" + data[4:]
    ours.close()
    theirs.close()


def test_the_sockets_timeout_bounds_each_wait_for_room_not_the_whole_send():
    # A reader that takes a little every 10 ms gets all of 6 MB, which takes it longer than the timeout.
    ours, theirs = gevent.socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    ours.settimeout(1.0)
    data = b"x" * 6_000_000
    got = [0]

    def read():
        while got[0] < len(data):
            got[0] += len(theirs.recv(65536))
            gevent.sleep(0.01)

    reader = gevent.spawn(read)
    started = time.monotonic()
    send_all(ours, data)
    reader.join(timeout=60)
    assert got[0] == len(data) and time.monotonic() - started > 1.0
    ours.close()
    theirs.close()


def test_a_wait_for_room_is_bounded_by_the_sockets_timeout():
    ours, theirs = gevent.socket.socketpair()
    ours.settimeout(0.2)
    with pytest.raises(SendTimeout):
        send_all(ours, b"x" * 50_000_000)  # nobody reads
    ours.close()
    theirs.close()


@pytest.mark.parametrize("wait_first", [False, True])
def test_a_read_takes_what_comes_and_waits_no_longer_than_its_timeout(wait_first):
    ours, theirs = gevent.socket.socketpair()
    gevent.spawn_later(0.05, theirs.sendall, b"answer")
    assert recv(ours, 100, 10, wait_first) == b"answer"
    started = time.monotonic()
    with pytest.raises(socket.timeout):
        recv(ours, 100, 0.2, wait_first)
    assert 0.15 < time.monotonic() - started < 5
    theirs.sendall(b"late")  # the timed-out wait left nothing behind to miss it
    assert recv(ours, 100, 10, wait_first) == b"late"
    theirs.close()
    assert recv(ours, 100, None) == b""  # the other end closed
    ours.close()


def test_a_read_waiting_on_a_socket_closed_elsewhere_fails_at_once():
    ours, theirs = gevent.socket.socketpair()
    gevent.spawn_later(0.05, ours.close)
    started = time.monotonic()
    with pytest.raises(OSError):
        recv(ours, 100, 30, wait_first=True)
    assert time.monotonic() - started < 5
    with pytest.raises(OSError):
        recv(ours, 100, 30, wait_first=True)  # and every read after
    theirs.close()
