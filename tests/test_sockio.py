"""Sends tried on the system socket first (llmgw/gateway/sockio.py): what it does not take still goes, whole
and in order, through gevent's wait for room."""

import gevent
import gevent.socket
import pytest

from llmgw.gateway.sockio import send_all


def test_a_send_larger_than_the_buffer_arrives_whole():
    ours, theirs = gevent.socket.socketpair()
    data = bytes(range(256)) * 40_000  # 10 MB: far more than a socket buffer takes at once
    got = []

    def read():
        while len(b"".join(got)) < len(data):
            got.append(theirs.recv(65536))
            gevent.sleep(0)

    reader = gevent.spawn(read)
    send_all(ours, b"head")
    send_all(ours, data[4:])
    reader.join(timeout=30)
    assert b"".join(got) == b"head" + data[4:]
    ours.close()
    theirs.close()


def test_a_wait_for_room_is_bounded_by_the_sockets_timeout():
    ours, theirs = gevent.socket.socketpair()
    ours.settimeout(0.2)
    with pytest.raises(TimeoutError):
        send_all(ours, b"x" * 50_000_000)  # nobody reads
    ours.close()
    theirs.close()
