"""The accountant split across processes: each part the only writer of its pools.

One accountant thread admits about 6,000 limited requests a second that
allowances cannot serve (many people each sending a few), which is one core
(docs/scaling.md). With `controller.accountant_parts` above one, the pools are
split by their home (`rules.part_of`): an organisation's tree, its keys and its
members' pools live in one part, a person's own pools (theirs, personal use,
the cluster's default) in the part of that person. Part 0 is the controller's
own `AccountServer`; each other part is a process of its own, running the same
server on a free port of `controller.accountant_listen`'s host, with its own
ZAP handler admitting the gateway keys read from the store.

Each pool still has one writer, so each part's limits are exact as one
accountant's are; a request held to pools of two parts is admitted by each in
the order of the parts, and handed back by the first if the second refuses
(llmgw/gateway/limiter.py). The gateways learn the parts' ports from the
snapshots (`accountant_ports`).

A part answers only while the controller leads: the controller writes its
lease (term, and until when on the machine's monotonic clock) to each part's
standard input at every look, and a part that comes to lead starts afresh,
rebuilding the spend of its own pools from the store (`Accountant.restore`).
Its standard input closing (the controller gone, however it went) stops it,
and nothing else does (signals to the controller's group are the controller's
to act on): no part outlives its controller. A part that dies, or stops
reading, is started again (killed first), on a new port that the next snapshot
carries, trying again less often while it fails. A restarted part's minute
windows start empty, and what requests it admitted before spend counts from
the usage rows at the next rebuild, as at a controller's restart; the other
parts keep what they hold. What a part needs that is secret (the store's URL,
with any password) comes on its standard input, never its command line, which
every user on the host can read.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from prometheus_client.core import CounterMetricFamily

from llmgw import addresses
from llmgw.control.accountserver import DROPPED, AccountServer

log = logging.getLogger("llmgw.accountparts")

TELL_EVERY = 0.25  # seconds between the lease's lines to each part
PORT_WAIT = 60.0  # seconds a part may take to say its port (it imports, opens the store, binds)
KEYS_EVERY = 5.0  # seconds between a part's reads of the issued gateway keys (a revoked one is refused after)
DROPPED_EVERY = 5.0  # seconds between a part's counts of dropped messages, for the controller's metrics
DEAF_AFTER = 4.0  # seconds a part may leave the lease's lines unread (its pipe full) before it is killed
PIPE_BYTES = 4096  # the lease's pipe to a part: what it may leave unread before `tell` finds it full
RETRY_AT_MOST = 60.0  # seconds between tries to start a part that fails, at most (1, 2, 4, ... before)


class Part:
    """One part's process, as the controller holds it."""

    def __init__(self, index: int, count: int, settings: dict):
        self.index = index
        self.count = count
        self.settings = settings
        self.port: int | None = None
        self.dropped = dict.fromkeys(DROPPED, 0)  # the last count it said; its restart's counts add to `past`
        self.past = dict.fromkeys(DROPPED, 0)
        self.proc: subprocess.Popen | None = None
        self.unread_since: float | None = None  # when a lease line last found the part's pipe full
        self.restarting = False

    def start(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        # -P: the working directory is not searched for modules (one planted there would read the store's URL).
        # A session of its own: a terminal's ^C is the controller's, which stops its parts itself.
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", "llmgw.control.accountparts"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({**self.settings, "part": self.index, "parts": self.count}).encode() + b"\n")
        self.proc.stdin.flush()
        # From now on only lease lines, each written whole or not at all: a part that stops reading cannot
        # hold up the controller's thread that tells every part.
        os.set_blocking(self.proc.stdin.fileno(), False)
        # A page of them (about 160 lines, 40 s) rather than the 64 KiB default (16 minutes) before a part that
        # stopped reading is found out.
        fcntl.fcntl(self.proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self.unread_since = None
        for name, value in self.dropped.items():
            self.past[name] += value
        self.dropped = dict.fromkeys(DROPPED, 0)
        said = _line_within(self.proc.stdout, PORT_WAIT)
        if not said.startswith(b"port "):
            self.stop()
            raise RuntimeError(f"accountant part {self.index} did not start (it said {said.strip()!r}); its log "
                               "is above this line")
        self.port = int(said.split()[1])
        threading.Thread(target=self._listen, args=(self.proc,), name=f"accountant-part-{self.index}",
                         daemon=True).start()

    def _listen(self, proc: subprocess.Popen) -> None:
        """Take what the part says after its port: its counts of dropped messages."""
        assert proc.stdout is not None
        for line in proc.stdout:
            kind, _, body = line.partition(b" ")
            if kind == b"dropped":
                counts = json.loads(body)
                self.dropped = {name: int(counts.get(name, 0)) for name in DROPPED}

    def tell(self, term: int, until: float, now: float) -> bool:
        """Write the lease to the part; False when it is gone, or has left the lease unread too long."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            assert self.proc.stdin is not None
            os.write(self.proc.stdin.fileno(), f"{term} {until}\n".encode())  # a short line: whole or not at all
            self.unread_since = None
        except BlockingIOError:  # its pipe is full: it has stopped reading (a store read that hangs, say)
            self.unread_since = self.unread_since or now
            if now - self.unread_since > DEAF_AFTER:
                log.error("accountant part %d has not read its lease for %g s: killing it", self.index, DEAF_AFTER)
                self.proc.kill()
                return False
        except OSError:
            return False
        return True

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # its end of the lease's lines: it stops
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class AccountParts:
    """The controller's accountant: part 0 in this process, the rest in processes of their own."""

    def __init__(self, main: AccountServer, count: int, settings: dict, lease):
        """SETTINGS: what a part needs to start (`serve_part`): store_url, keys_dir (None: plaintext), listen,
        log_level."""
        self.main = main
        self.lease = lease
        self.parts = [Part(i, count, settings) for i in range(1, count)]
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._tell, name="accountant-parts", daemon=True)

    def start(self) -> "AccountParts":
        self.main.start()
        for part in self.parts:
            part.start()
        if self.parts:
            log.info("the accountant's pools are split across %d parts, on ports %s", len(self.ports),
                     ", ".join(map(str, self.ports)))
            self.thread.start()
        return self

    @property
    def port(self) -> int:
        return self.main.port

    @property
    def ports(self) -> list[int]:
        """Each part's port, in the order of the parts (a part restarting: its last)."""
        return [self.main.port] + [p.port or 0 for p in self.parts]

    def _tell(self) -> None:
        while not self.stopping.wait(TELL_EVERY):
            term, until, now = self.lease.term, self.lease.valid_until, time.monotonic()
            for part in self.parts:
                if not part.restarting and not part.tell(term, until, now) and not self.stopping.is_set():
                    part.restarting = True
                    threading.Thread(target=self._restart, args=(part,), name=f"accountant-part-{part.index}-start",
                                     daemon=True).start()

    def _restart(self, part: Part) -> None:
        """Start PART again, trying less often while it fails; in a thread of its own, so the other parts are
        told the lease meanwhile."""
        log.error("accountant part %d stopped (exit status %s); starting it again", part.index,
                  part.proc.poll() if part.proc else None)
        wait = 1.0
        while not self.stopping.is_set():
            part.stop()
            try:
                part.start()
                break
            except Exception as e:
                log.error("accountant part %d could not start again (%s); next try in %g s", part.index, e, wait)
                if self.stopping.wait(wait):
                    break
                wait = min(RETRY_AT_MOST, wait * 2)
        if self.stopping.is_set():
            part.stop()  # begun as the controller stopped: it does not outlive it
        part.restarting = False

    def stop(self) -> None:
        """Stop answering, every part: before the controller gives its lease up, so no part answers once a
        standby may lead."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        for part in self.parts:
            part.stop()
        self.main.stop()

    def collect(self):
        """The messages every part dropped, for a Prometheus registry."""
        family = next(iter(self.main.collect()))
        if not self.parts:
            yield family
            return
        total = {why: self.main.dropped[why] + sum(p.past[why] + p.dropped[why] for p in self.parts)
                 for why in DROPPED}
        summed = CounterMetricFamily(family.name, family.documentation, labels=["why"])
        for why in DROPPED:
            summed.add_metric([why], total[why])
        yield summed


def _line_within(stream, seconds: float) -> bytes:
    """The next line of STREAM, or b"" when none comes within SECONDS."""
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(seconds)
    return got[0] if got else b""


class Mirror:
    """The controller's lease as a part sees it: what the controller last wrote."""

    def __init__(self):
        self.term = 0
        self.valid_until = 0.0

    def held(self) -> bool:
        return time.monotonic() < self.valid_until


def serve_part() -> None:
    """A part's process: settings on the first line of standard input, then the lease, a line at a time."""
    import zmq

    from llmgw import keyfiles, store
    from llmgw.control import authenticator, curvekeys
    from llmgw.control.accountant import Accountant

    # Stopped by its standard input's end alone: a signal to the controller's group (systemd's stop, a
    # terminal's ^C) is for the controller, which stops its parts after it stops answering itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    settings = json.loads(sys.stdin.readline())
    part, count = settings["part"], settings["parts"]
    logging.basicConfig(level=settings.get("log_level", "INFO").upper(),
                        format=f"%(asctime)s [%(process)d] %(levelname)s %(name)s (part {part}): %(message)s")
    engine = store.open_store(settings["store_url"])
    context = zmq.Context()
    curve, ring = None, None
    if settings.get("keys_dir"):
        ring = authenticator.KeyRing(curvekeys.gateway_keys(engine), "gateway",
                                     reload=lambda: curvekeys.gateway_keys(engine))
        authenticator.Authenticator(context, {authenticator.GATEWAYS: ring}).start()
        curve = (keyfiles.controller_keypair(settings["keys_dir"]), authenticator.GATEWAYS)
    host, _port = addresses.parse(settings["listen"], "controller.accountant_listen")

    def fresh() -> Accountant:
        accountant = Accountant()
        accountant.restore(engine, part, count)
        return accountant

    def reload_keys() -> None:
        # Apart from the lease's lines: a read of the store that hangs must not leave the lease unread.
        while True:
            time.sleep(KEYS_EVERY)
            try:  # a key revoked through the controller is refused here from now on
                ring.replace(curvekeys.gateway_keys(engine))
            except Exception as e:
                log.warning("could not read the issued gateway keys from the store: %s", str(e).splitlines()[0])

    if ring is not None:
        threading.Thread(target=reload_keys, name="gateway-keys", daemon=True).start()
    mirror = Mirror()
    server = AccountServer(Accountant(), addresses.join(host, 0), context, curve, lease=mirror, fresh=fresh).start()
    print(f"port {server.port}", flush=True)
    said = time.monotonic()
    for line in sys.stdin:  # until the controller closes it, whatever way it ends
        term, until = line.split()
        mirror.term, mirror.valid_until = int(term), float(until)
        now = time.monotonic()
        if now - said >= DROPPED_EVERY:
            said = now
            print("dropped " + json.dumps(server.dropped), flush=True)
    server.stop()
    engine.dispose()


if __name__ == "__main__":
    serve_part()
