"""Allowances: a worker admits requests from what the accountant set aside for it, and limits still hold to
the request. The accountant's rules with their numbers worked out, then a real worker's limiter against a
real accountant's socket."""

import random
import time

import gevent
import pytest

from llmgw.control.accountant import SHARE, Accountant, Reservation
from llmgw.control.accountserver import AccountServer
from llmgw.gateway.limiter import FIRST_GRANT, Allowance, Limiter, Unavailable
from llmgw.wire.accounting import GRANT_SECONDS
from tests.test_accountant import Clock, level

WAIT = 30.0  # seconds: generous, for a loaded machine


def test_an_allowance_is_counted_at_once_and_what_it_did_not_use_is_handed_back():
    a = Accountant(Clock())
    chain = [level("key:k", rpm=10_000, tpm=1_000_000), level("team:t", budget=10**9)]
    r = a.admit(chain, True, 100, cost=50, grant=64)
    assert isinstance(r, Reservation) and r.size == 64
    assert a.requests["key:k"].used(a.clock()) == 64 and a.tokens["key:k"].used(a.clock()) == 6400
    assert a.reserved[r.budgets[0]] == 64 * 50
    # Ten of its requests were made, with 700 tokens and 300 micro-units between them.
    assert a.settle(r.id, 700, 300, requests=10) is None
    assert a.requests["key:k"].used(a.clock()) == 10 and a.tokens["key:k"].used(a.clock()) == 700
    assert a.spent("team:t", "month") == 300 and not a.reserved and not a.reservations


def test_an_allowance_takes_a_sixteenth_of_what_is_left_and_none_near_a_limit():
    a = Accountant(Clock())
    chain = [level("key:k", rpm=100)]
    assert a.admit(chain, False, 0, grant=64).size == 100 // SHARE  # 6
    while a.requests["key:k"].left(100, a.clock()) >= 2 * SHARE:
        a.admit(chain, False, 0)
    assert a.admit(chain, False, 0, grant=64).size == 1  # 32 left: an allowance of two would be a sixteenth
    # Tokens and budgets bound it alike: a sixteenth of 1,000 tokens is six requests of ten.
    assert a.admit([level("key:t", tpm=1000)], False, 10, grant=64).size == 6
    budgeted = [level("key:b", budget=950)]
    assert a.admit(budgeted, True, 1, cost=10, grant=64).size == 5
    assert a.admit(budgeted, False, 1, cost=10, grant=64).size == 64  # no price: the budget does not bind


def test_however_workers_use_their_allowances_a_minute_never_holds_more_than_the_limit():
    rng = random.Random(7)
    a = Accountant(Clock())
    chain = [level("key:k", rpm=1000), level("org:o", rpm=5000)]
    made, holding = 0, []
    while True:
        # Four workers: each asks (for an allowance or alone), uses some of what it was granted, settles.
        granted = [a.admit(chain, False, 0, grant=rng.choice([1, 4, 64, 1024])) for _ in range(4)]
        admitted = [g for g in granted if isinstance(g, Reservation)]
        if not admitted:
            break
        for g in admitted:
            used = rng.randint(1, g.size) if g.size > 1 else 1
            made += used
            if g.size > 1:
                holding.append((g.id, used))
        for rid, used in holding:
            assert a.settle(rid, 0, 0, requests=used) is None
        holding.clear()
    assert made <= 1000 and a.requests["key:k"].used(a.clock()) == made
    assert made >= 1000 - 4 * SHARE  # what was refused was refused near the limit


def test_an_allowance_counts_in_the_minute_after_its_last_possible_request():
    clock = Clock()
    a = Accountant(clock)
    chain = [level("key:k", rpm=10_000)]
    r = a.admit(chain, False, 0, grant=16)
    assert a.settle(r.id, 0, 0, requests=16) is None
    clock.t += 60 + GRANT_SECONDS / 2  # its last request may have been made less than a minute ago
    assert a.requests["key:k"].used(clock.t) == 16
    clock.t += GRANT_SECONDS / 2
    assert a.requests["key:k"].used(clock.t) == 0


def test_an_allowance_is_settled_only_with_how_many_of_its_requests_were_made():
    a = Accountant(Clock())
    r = a.admit([level("key:k", rpm=10_000)], False, 0, grant=8, owner="w1")
    assert "say how many" in a.settle(r.id, 0, 0, owner="w1")
    assert "say how many" in a.settle(r.id, 0, 0, owner="w1", requests=9)
    assert "another gateway" in a.settle(r.id, 0, 0, owner="w2", requests=1)
    assert a.settle(r.id, 0, 0, owner="w1", requests=8) is None and not a.reservations


def test_a_request_that_does_not_fit_an_allowance_takes_nothing_from_it():
    allowance = Allowance("tcp://a", None, 1, 4, 40, 20, time.monotonic() + 60, {})
    assert allowance.take(41, 1, time.monotonic()) is None  # more tokens than are left
    assert allowance.take(1, 21, time.monotonic()) is None  # more cost
    assert allowance.take(10, 5, time.monotonic())["ok"] and (allowance.requests, allowance.tokens) == (3, 30)
    assert allowance.take(1, 1, allowance.until) is None  # its time is up


def test_a_charge_waiting_behind_an_allowance_to_expire_is_settled_into_the_total_it_is_in():
    # A request admitted alone just after an allowance was granted expires behind it, up to a second late.
    # Settled in that second, its new count must replace its estimate in the total, or the total drifts
    # for good: up when requests use less than their estimates, below zero when more.
    clock = Clock()
    a = Accountant(clock)
    team = level("team:t", tpm=100_000)
    a.admit([level("key:a", rpm=10_000), team], False, 10, grant=64)
    clock.t += 0.5
    alone = a.admit([level("key:b"), team], False, 1000)
    clock.t += 60.2  # past its own minute, not past the allowance's
    assert a.settle(alone.id, 10, 0) is None
    clock.t += 5
    assert a.tokens["team:t"].used(clock.t) == 0
    again = a.admit([level("key:b"), team], False, 10)
    clock.t += 0.3
    assert a.settle(again.id, 50_000, 0) is None  # more than its estimate: counted, never below zero
    assert a.tokens["team:t"].used(clock.t) == 50_000


def test_a_window_already_past_its_tokens_grants_no_allowance():
    # Requests refused before admission count with no token estimate; a tokens window a settle took past its
    # limit must not hand them an allowance of requests it would then refuse, keeping all of them charged.
    a = Accountant(Clock())
    chain = [level("key:k", rpm=10_000, tpm=100)]
    r = a.admit(chain, False, 10)
    assert a.settle(r.id, 500, 0) is None
    refused = a.admit(chain, False, 0, grant=64)
    assert not isinstance(refused, Reservation) and a.requests["key:k"].used(a.clock()) == 2


@pytest.fixture
def worker():
    """A real accountant's socket and a worker's limiter talking to it; the accountant counts its admits."""
    server = AccountServer(Accountant(), "127.0.0.1:0").start()
    asked = []
    admit = server.accountant.admit
    server.accountant.admit = lambda *args, **kw: asked.append(kw.get("grant", 1)) or admit(*args, **kw)
    limiter = Limiter(timeout=WAIT)
    yield limiter, server, f"127.0.0.1:{server.port}", asked
    limiter.close()
    server.stop()


def wait_green(what, done):
    deadline = time.monotonic() + WAIT
    while not done():
        assert time.monotonic() < deadline, what
        gevent.sleep(0.05)


def test_a_worker_asks_once_for_many_requests_and_settles_what_they_used_when_its_time_is_up(worker):
    limiter, server, address, asked = worker
    chain = [level("key:k", rpm=100_000, tpm=10**8), level("team:t", budget=10**12)]
    key = ("k-levels", True)
    for _ in range(60):
        answer = limiter.admit(address, key, chain, True, 100, 30)
        assert answer["ok"] and answer["status"]["rpm"][0] == 100_000
        limiter.settle(address, answer["r"], 10, 3)
    # Four, then twice what each used: 4 + 8 + 16 + 32 covers 60 requests in four questions.
    assert asked == [FIRST_GRANT, 8, 16, 32]
    accountant = server.accountant
    wait_green("the last allowance handed back", lambda: not accountant.reservations)
    now = accountant.clock()
    assert accountant.requests["key:k"].used(now) == 60 and accountant.tokens["key:k"].used(now) == 600
    assert accountant.spent("team:t", "month") == 180 and not accountant.reserved


def test_requests_in_flight_keep_an_allowance_until_the_last_of_them_settles(worker):
    limiter, server, address, asked = worker
    chain = [level("key:k", rpm=100_000)]
    ticket = limiter.admit(address, ("k", False), chain, False, 0, 0)["r"]
    held = ticket[0]
    assert isinstance(held, Allowance) and held.size == FIRST_GRANT
    wait_green("the sweep to close the allowance once its time is up", lambda: held.closed)
    assert not held.handed and server.accountant.reservations  # a request is still in flight
    limiter.settle(address, ticket, 0, 0)
    wait_green("the allowance handed back", lambda: not server.accountant.reservations)
    assert server.accountant.requests["key:k"].used(server.accountant.clock()) == 1


def test_a_worker_near_a_limit_asks_for_each_request(worker):
    limiter, server, address, asked = worker
    chain = [level("key:k", rpm=20)]
    answers = [limiter.admit(address, ("k", False), chain, False, 0, 0) for _ in range(21)]
    assert [a["ok"] for a in answers] == [True] * 20 + [False]
    assert len(asked) == 21 and not limiter.allowances  # twenty is within sixteen times two of its limit


def test_a_worker_that_stops_hands_back_its_allowances_with_requests_in_flight_at_their_estimates(worker):
    limiter, server, address, asked = worker
    chain = [level("key:k", rpm=100_000, tpm=10**8), level("team:t", budget=10**12)]
    done = limiter.admit(address, ("k", True), chain, True, 100, 30)["r"]
    limiter.settle(address, done, 10, 3)
    running = limiter.admit(address, ("k", True), chain, True, 60, 20)["r"]  # its own, smaller estimates
    assert running[0] is done[0] and server.accountant.reservations
    limiter.stop()  # before the allowance's second is up; one of its requests still runs
    accountant = server.accountant
    assert not accountant.reservations and not accountant.reserved  # confirmed before stop returned
    now = accountant.clock()
    assert accountant.requests["key:k"].used(now) == 2 and accountant.tokens["key:k"].used(now) == 70
    assert accountant.spent("team:t", "month") == 23
    limiter.settle(address, running, 10, 3)  # the request ends after: nothing more is sent


def test_an_allowance_granted_after_its_request_stopped_waiting_is_handed_back_at_once(worker):
    limiter, server, address, asked = worker
    limiter.timeout = 0.2
    chain = [level("key:k", rpm=100_000), level("team:t", budget=10**12)]
    admit = server.accountant.admit

    granted = []

    def slow(*args, **kw):
        time.sleep(0.6)  # the accountant's thread, busy past the worker's wait
        granted.append(admit(*args, **kw))
        return granted[-1]

    server.accountant.admit = slow
    with pytest.raises(Unavailable):
        limiter.admit(address, ("k", True), chain, True, 100, 30)
    wait_green("the accountant to answer late", lambda: granted)
    assert granted[0].size == FIRST_GRANT
    wait_green("the late allowance handed back", lambda: not server.accountant.reservations
               and not server.accountant.reserved)
    assert server.accountant.requests["key:k"].used(server.accountant.clock()) == 0


def test_the_rate_limit_headers_of_requests_sharing_a_status_are_made_once_and_stay_right():
    from llmgw.gateway.caller import Caller
    from llmgw.rules import Access, Price

    def caller(status, price):
        c = Caller("k", None, None, Access(levels=(), models=None, band="standard"))
        c.status, c.price = status, price
        return c

    shared = {"rpm": (100, 40), "budget": (10_000_000, 2_500_000)}
    first = caller(shared, Price(1, 1)).limit_headers()
    assert ("X-RateLimit-Remaining-Requests", "40") in first and ("X-Llmgw-Budget-Remaining", "2.5") in first
    assert caller(shared, Price(1, 1)).limit_headers() is first  # the allowance's next request
    assert ("X-Llmgw-Budget-Remaining", "2.5") not in caller(shared, Price()).limit_headers()  # a free model
    assert ("X-RateLimit-Remaining-Requests", "7") in caller({"rpm": (100, 7)}, Price()).limit_headers()
    assert caller({}, Price(1, 1)).limit_headers() == []
