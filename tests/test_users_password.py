"""`llmgw users create` takes its password as its help says: one line piped on standard input, or asked
for twice at a terminal. Run as an operator runs it, in a process of its own, with a real pipe and a
real pseudo-terminal.

click's password_option asked twice wherever it was: `echo pw | llmgw users create bob@example.com`
warned that the input could not be hidden (GetPassWarning), and the second asking met the end of the
pipe and aborted, though the help said standard input is read."""

import os
import pty
import select
import subprocess
import sys
import time

from llmgw import store
from llmgw.people import accounts
from tests.conftest import ROOT

PASSWORD = "a long enough password"


def llmgw(url: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmgw", "--store", url, "users", "create", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, **kwargs)


def signs_in(url: str, email: str, password: str) -> bool:
    engine = store.open_engine(url)
    try:
        return isinstance(accounts.authenticate(engine, email, password), accounts.User)
    finally:
        engine.dispose()


def test_a_password_piped_on_standard_input(tmp_path):
    url = f"sqlite:///{tmp_path}/users.db"
    done = subprocess.run(f"echo '{PASSWORD}' | {sys.executable} -m llmgw --store {url} users create "
                          "bob@example.com", shell=True, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "created bob@example.com" in done.stderr and "Warning" not in done.stderr
    assert signs_in(url, "bob@example.com", PASSWORD)


def test_nothing_on_standard_input_is_refused_saying_what_to_do(tmp_path):
    url = f"sqlite:///{tmp_path}/users.db"
    done = llmgw(url, "bob@example.com", stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and "no password came on standard input" in done.stderr
    assert 'echo "$PASSWORD" | llmgw users create EMAIL' in done.stderr


def _read_until(fd: int, text: bytes, seen: bytearray, limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while text not in seen:
        assert time.monotonic() < deadline, f"waited for {text!r}; the terminal showed {bytes(seen)!r}"
        if select.select([fd], [], [], 0.2)[0]:
            seen.extend(os.read(fd, 4096))


def test_a_terminal_is_asked_twice(tmp_path):
    url = f"sqlite:///{tmp_path}/users.db"
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "llmgw", "--store", url, "users", "create", "ann@example.com"],
                            cwd=ROOT, stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    seen = bytearray()
    try:
        _read_until(leader, b"Password: ", seen)
        os.write(leader, PASSWORD.encode() + b"\n")
        _read_until(leader, b"Repeat for confirmation: ", seen)
        os.write(leader, PASSWORD.encode() + b"\n")
        assert proc.wait(timeout=60) == 0
        _read_until(leader, b"created ann@example.com", seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    assert PASSWORD.encode() not in seen  # hidden as it was typed
    assert signs_in(url, "ann@example.com", PASSWORD)
