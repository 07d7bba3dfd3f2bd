"""The accountant split across processes by organisation: each pool counted by one part, a request held in
two parts admitted by each in order and handed back by the first when the second refuses, limits exact
across the split. The rules and the accountant's hand-back worked out; a worker's limiter against two real
accountant sockets; then a real controller with two parts and two real gateways."""

import os
import signal

import pytest

from llmgw import rules, store
from llmgw.control.accountant import Accountant, Reservation
from llmgw.control.accountserver import AccountServer
from llmgw.gateway.limiter import Held, Limiter, Unavailable, merged
from llmgw.people import accounts, keys, limits, orgtree
from tests.conftest import post, wait_until
from tests.test_accountant import Clock, level
from tests.test_allowances import WAIT, wait_green
from tests.test_limits_global import BODY, fire, start


def test_a_projects_pools_live_with_its_organisation_and_a_persons_own_with_the_person():
    ruleset = rules.Rules({("org", "o"): rules.Limits(rpm=10), ("team", "t"): rules.Limits(rpm=10),
                           ("project_member", "p"): rules.Limits(rpm=10), ("key", "k"): rules.Limits(rpm=10),
                           ("user", "u"): rules.Limits(rpm=10), ("personal", ""): rules.Limits(rpm=10),
                           ("cluster", ""): rules.Limits(tpm=10)},
                          {"p": ("t", "o")}, {"t": "o"})
    project_key = ruleset.access("k", "p", "u")
    assert {lv.counter: lv.home for lv in project_key.levels} == {
        "key:k": "o", "project_member:p/u": "o", "team:t": "o", "org:o": "o", "user:u": "u", "default:user:u": "u"}
    personal_key = ruleset.access("k", None, "u")
    assert {lv.home for lv in personal_key.levels} == {"u"}  # a personal key's pools all live with its person
    assert ruleset.tree_home("project", "p") == ruleset.tree_home("team", "t") == ruleset.tree_home("org", "o") == "o"
    # Every process places a home in the same part; one part holds everything; the parts come in order.
    assert rules.part_of("o", 1) == 0 and rules.part_of("o", 7) == rules.part_of("o", 7) < 7
    home_part, person_part = rules.part_of("o", 64), rules.part_of("u", 64)
    split = project_key.parts(64)
    assert [part for part, _ in split] == sorted({home_part, person_part})
    assert project_key.parts(64) is split  # worked out once a principal and a count of parts
    assert project_key.parts(1) == [(0, project_key.wire)]


def test_a_request_admitted_to_be_handed_back_is_counted_until_it_is_and_keeps_its_request_if_asked():
    a = Accountant(Clock())
    chain = [level("org:o", rpm=10, tpm=1000, budget=10**6)]
    held = a.admit(chain, True, 100, cost=50, undo=True)
    assert isinstance(held, Reservation) and held.held
    assert a.requests["org:o"].used(a.clock()) == 1 and a.reserved[held.budgets[0]] == 50
    assert a.settle(held.id, 0, 0, requests=0) is None  # refused by the other part: as if never made
    assert a.requests["org:o"].used(a.clock()) == 0 and a.tokens["org:o"].used(a.clock()) == 0
    assert not a.reserved and not a.reservations and a.spent("org:o", "month") == 0
    kept = a.admit(chain, True, 100, cost=50, undo=True)
    assert a.settle(kept.id, 0, 0, requests=1) is None  # refused elsewhere for its tokens: it did arrive
    assert a.requests["org:o"].used(a.clock()) == 1 and a.tokens["org:o"].used(a.clock()) == 0
    again = a.admit(chain, True, 100, cost=50, undo=True)
    assert "holds 1 request(s), settled as 2" in a.settle(again.id, 0, 0, requests=2)
    # Without UNDO nothing changes: a request that took no tokens or budget is not held at all.
    assert not a.admit([level("key:k", rpm=10)], False, 0).held


def test_the_fullest_pool_of_several_parts_is_what_the_headers_show():
    assert merged([{"rpm": (100, 50), "tpm": (1000, 10)}, {"rpm": (10, 9), "budget": (5, 5)}]) == {
        "rpm": (100, 50), "tpm": (1000, 10), "budget": (5, 5)}  # half left of 100 is fuller than 9 of 10


@pytest.fixture
def two_parts():
    """Two real accountant sockets, as two parts, and a worker's limiter talking to both."""
    servers = [AccountServer(Accountant(), "127.0.0.1:0").start() for _ in range(2)]
    limiter = Limiter(timeout=WAIT)
    yield limiter, servers, tuple(f"127.0.0.1:{s.port}" for s in servers)
    limiter.close()
    for server in servers:
        server.stop()


def used(server, counter):
    return server.accountant.requests[counter].used(server.accountant.clock())


def test_a_request_the_second_part_refuses_is_handed_back_by_the_first(two_parts):
    limiter, (first, second), parts = two_parts
    split = [(0, [level("org:o", rpm=1000, tpm=10**6)]), (1, [level("user:u", rpm=3)])]
    answers = [limiter.admit_split(parts, ("k",), split, False, 10, 0) for _ in range(5)]
    assert [a["ok"] for a in answers] == [True, True, True, False, False]
    assert "this person may make 3 requests a minute" in answers[3]["message"]
    # The first part admitted from its allowance, and took back what the refused requests took from it.
    assert isinstance(answers[0]["r"], Held) and answers[0]["status"]["rpm"] == (3, 2)
    for answer in answers[:3]:
        limiter.settle(None, answer["r"], 7, 0)
    limiter.stop()  # hands back the allowance, confirmed by each part
    assert used(first, "org:o") == 3 and used(second, "user:u") == 3
    assert first.accountant.tokens["org:o"].used(first.accountant.clock()) == 21
    assert not first.accountant.reservations and not second.accountant.reservations


def test_asked_alone_a_handed_back_request_leaves_the_first_part_as_it_was(two_parts):
    limiter, (first, second), parts = two_parts
    # Near its limit the first part grants no allowance: each request is a reservation it can hand back.
    split = [(0, [level("org:o", rpm=20, tpm=100)]), (1, [level("user:u", tpm=25)])]
    made = [limiter.admit_split(parts, ("k",), split, False, 10, 0) for _ in range(3)]
    assert [a["ok"] for a in made] == [True, True, False] and made[2]["limit"] == "tpm"
    wait_green("the refused request's tokens handed back", lambda: first.accountant.tokens["org:o"].used(
        first.accountant.clock()) == 20)
    # Refused for its tokens, it did arrive: it stays in the first part's requests a minute.
    assert used(first, "org:o") == 3
    split = [(0, [level("org:o", rpm=20)]), (1, [level("user:v", rpm=0)])]
    refused = limiter.admit_split(parts, ("v",), split, False, 0, 0)
    assert not refused["ok"] and refused["limit"] == "rpm"
    wait_green("the refused request's slot handed back", lambda: used(first, "org:o") == 3)


def test_a_second_part_that_does_not_answer_hands_the_first_back_and_says_unavailable(two_parts):
    limiter, (first, second), parts = two_parts
    limiter.timeout = 0.3
    second.stop()
    split = [(0, [level("org:o", rpm=20, budget=10**6)]), (1, [level("user:u", rpm=10)])]
    with pytest.raises(Unavailable):
        limiter.admit_split(parts, ("k",), split, True, 10, 5)
    wait_green("the first part's reservation handed back", lambda: not first.accountant.reservations)
    assert used(first, "org:o") == 0 and not first.accountant.reserved


def test_a_part_started_again_elsewhere_leaves_the_other_parts_connections_and_what_they_hold(two_parts):
    limiter, (first, second), parts = two_parts
    spent = first.accountant.spend
    spent[("org:o", "month", first.accountant._start("month", first.accountant.clock()))] = 900
    near = [(0, [level("org:o", budget=1000)]), (1, [level("user:u", rpm=100)])]
    far = [(0, [level("org:big", budget=10**9)]), (1, [level("user:v", rpm=10**6)])]
    alone = limiter.admit_split(parts, ("near",), near, True, 10, 50)["r"]  # near its budget: a reservation
    allowed = limiter.admit_split(parts, ("far",), far, True, 10, 1000)["r"]  # far from it: an allowance
    moved = AccountServer(Accountant(), "127.0.0.1:0").start()  # part 1, started again on another port
    try:
        now_parts = (parts[0], f"127.0.0.1:{moved.port}")
        assert limiter.admit_split(now_parts, ("w",), [(1, [level("user:w", rpm=100)])], False, 1, 0)["ok"]
        limiter.settle(None, alone, 10, 50)
        limiter.settle(None, allowed, 10, 1000)
        limiter.stop()  # hands back the allowance over part 0's connection, which stayed
        assert first.accountant.spent("org:o", "month") == 950 and first.accountant.spent("org:big", "month") == 1000
        assert not first.accountant.reservations and not first.accountant.reserved
        assert first.dropped["settle"] == 0  # nothing settled over a new connection that did not admit it
    finally:
        moved.stop()


def test_a_request_asked_again_for_its_tokens_is_counted_by_the_parts_the_refusal_did_not_reach(two_parts):
    import types

    from llmgw.gateway.admit import Admission
    from llmgw.gateway.caller import Caller
    from llmgw.gateway.errors import ApiError

    limiter, (first, second), parts = two_parts
    org = next(f"o{i}" for i in range(1000) if rules.part_of(f"o{i}", 2) == 0)
    person = next(f"u{i}" for i in range(1000) if rules.part_of(f"u{i}", 2) == 1)
    ruleset = rules.Rules({("org", org): rules.Limits(tpm=5000), ("user", person): rules.Limits(rpm=3)},
                          {"p": ("t", org)}, {"t": org})
    access = ruleset.access("k", "p", person)
    ns = types.SimpleNamespace
    runtime = ns(limiter=limiter, cfg={"limits.output_estimate": 16, "gateway.controller": None},
                 router=ns(snapshot=ns(parts=parts, accountant=parts[0]), pick=lambda *a: "replica"),
                 keys=ns(prices=rules.Prices({})), metrics=ns(limited=ns(labels=lambda *_: ns(inc=lambda: None))))
    admission = Admission(runtime, ns(counted_prompt=lambda req, model, replica: 10))  # a replica counts 10
    # Another request holds 4,000 of the organisation's 5,000 tokens this minute: a prompt of 1,500 bytes is
    # refused by its bound, and let in when counted; the person's own 3 a minute, in part 1, still hold.
    first.accountant.admit([[f"org:{org}", None, 5000, None, "month"]], False, 4000)
    admitted = 0
    for _ in range(6):
        request = ns(raw=b"x" * 1500, max_tokens=16, kind="chat",
                     body={"messages": [{"role": "user", "content": "hi"}]})
        caller = Caller("k", "p", person, access)
        try:
            admission.admit(caller, request, ns(name="m", max_output=None))
        except ApiError as e:
            assert "this person may make 3 requests a minute" in str(e)
            continue
        admitted += 1
        limiter.settle(None, caller.reservation, 26, 0)
    assert admitted == 3 and used(second, f"user:{person}") == 3


def test_a_part_that_leaves_its_lease_unread_is_killed_to_be_started_again(monkeypatch):
    import subprocess

    from llmgw.control import accountparts

    monkeypatch.setattr(accountparts, "DEAF_AFTER", 0.0)
    part = accountparts.Part(1, 2, {})
    part.proc = subprocess.Popen(["sleep", "600"], stdin=subprocess.PIPE)  # reads nothing
    os.set_blocking(part.proc.stdin.fileno(), False)
    try:
        told = [part.tell(1, 1e9, now) for now in range(10_000)]  # until its pipe is full, and then
        assert told[0] and not told[-1]
        assert part.proc.wait(timeout=WAIT) == -signal.SIGKILL
    finally:
        part.stop()


def test_more_parts_than_a_snapshot_carries_are_refused():
    from llmgw import settings

    with pytest.raises(settings.ConfigError, match="accountant_parts is at most 64"):
        settings.load(None, {"controller.accountant_parts": 65})


def test_a_part_rebuilds_the_spend_of_its_own_pools_only(tmp_path):
    from llmgw.gateway.usage import insert_rows

    engine = store.open_store(f"sqlite:///{tmp_path}/spend.db")
    org = orgtree.add(engine, "org", "north")
    team = orgtree.add(engine, "team", "ml", org.id)
    project = orgtree.add(engine, "project", "chat", team.id)
    person = accounts.create_user(engine, "ayse@example.org", "a long enough password", state="active")
    record, _ = keys.create_key(engine, "k", project.id, user_id=person.id)
    limits.set_limits(engine, "org", org.id, "test", budget=10**9)
    limits.set_limits(engine, "user", person.id, "test", budget=10**9)
    import time
    with store.writing(engine) as conn:
        insert_rows(conn, [(time.time() - 5, record.id, project.id, "m", "m", "r", "chat", False, 200, 1, 1, 1.0,
                            None, person.id, 7)])
    homes = {rules.part_of(org.id, 64), rules.part_of(person.id, 64)}
    for part in range(64):
        a = Accountant()
        a.restore(engine, part, 64)
        spent = {pool[0] for pool, cost in a.spend.items() if cost}
        if part == rules.part_of(org.id, 64):
            assert f"org:{org.id}" in spent and f"key:{record.id}" in spent
        if part == rules.part_of(person.id, 64):
            assert f"user:{person.id}" in spent
        if part not in homes:
            assert not spent
    engine.dispose()


def _in_part(count, part, make):
    """Things MAKE makes until one whose id is in PART of COUNT: where a test needs a home in a given part."""
    while True:
        made = make()
        if rules.part_of(made.id, count) == part:
            return made


def test_limits_are_exact_across_two_accountant_processes_and_a_part_killed_is_started_again(
        tmp_path, make_sim, make_gateway):
    def prepare(engine):
        names = iter(range(1000))
        org = _in_part(2, 0, lambda: orgtree.add(engine, "org", f"org{next(names)}"))
        team = orgtree.add(engine, "team", "ml", org.id)
        project = orgtree.add(engine, "project", "chat", team.id)
        ayse, deniz = (_in_part(2, 1, lambda: accounts.create_user(engine, f"p{next(names)}@example.org",
                                                                   "a long enough password", state="active"))
                       for _ in range(2))
        limits.set_limits(engine, "org", org.id, "test", rpm=130)
        limits.set_limits(engine, "user", ayse.id, "test", rpm=100)
        return (keys.create_key(engine, "ayse", project.id, user_id=ayse.id)[1],
                keys.create_key(engine, "deniz", project.id, user_id=deniz.id)[1],
                keys.create_key(engine, "ayse-own", None, user_id=ayse.id)[1])

    controller, gws, engine, (ayse, deniz, ayse_own) = start(tmp_path, make_sim, make_gateway, prepare,
                                                             controller_settings={"accountant_parts": 2})
    url = gws[0].url + "/v1/chat/completions"
    try:
        said = controller.log()
        assert "the accountant's pools are split across 2 parts" in said, said
        children = _parts_of(controller.proc.pid)
        assert len(children) == 1
        # Each of ayse's requests is held by her organisation's pool (part 0) and her own (part 1): her own
        # lets at most 100 of 160 in, and the organisation's hands back the rest...
        statuses = [s for s, _ in fire([gw.url for gw in gws], ayse, 160)]
        served = statuses.count(200)
        assert 96 <= served <= 100 and statuses.count(429) == 160 - served, statuses
        # ...so it has exactly what is left of its 130 for deniz, who has no limit of his own: never more,
        # and all of it once the allowances the workers held for ayse's requests are handed back.
        left = 130 - served
        seen = []

        def one_more():
            seen.append(post(url, BODY, deniz)[0])
            assert seen.count(200) <= left, seen
            return seen.count(200) == left

        wait_until("deniz served what the organisation has left", 40, one_more)
        assert [post(url, BODY, deniz)[0] for _ in range(3)] == [429] * 3
        assert post(url, BODY, ayse_own)[0] == 429  # her own pool, in part 1, is full
        # A signal to the controller's group is the controller's: the part answers on (a part gone would be
        # waited for, then its limits waived).
        os.kill(children[0], signal.SIGTERM)
        assert post(url, BODY, ayse_own)[0] == 429 and _parts_of(controller.proc.pid) == children

        # A part killed is started again on a new port, which the gateways learn from the next snapshot. Its
        # minute windows start empty: ayse's key of her own (counted in part 1 alone) is let in again.
        os.kill(children[0], signal.SIGKILL)
        wait_until("the part started again", 60, lambda: _parts_of(controller.proc.pid) not in ([], children))
        wait_until("ayse's own key counted by the new part", 60, lambda: post(url, BODY, ayse_own)[0] == 200)
        assert "accountant part 1 stopped" in controller.log()
        assert post(url, BODY, deniz)[0] == 429  # the organisation's part kept its count
    finally:
        engine.dispose()
        controller.stop()
    assert not _parts_of(controller.proc.pid)


def test_a_parts_socket_admits_issued_gateway_keys_only_and_an_earlier_key_stops_working(tmp_path):
    import re

    import zmq

    from llmgw import keyfiles
    from llmgw.wire import accounting
    from llmgw.wire.curve import ClientKeys, dial
    from tests.cluster import Controller

    controller = Controller(tmp_path, controller__accountant_parts=2)
    context = zmq.Context()
    try:
        wait_until("the parts' ports said", 60, lambda: "split across 2 parts" in controller.log())
        port = int(re.search(r"split across 2 parts, on ports \d+, (\d+)", controller.log()).group(1))
        server = keyfiles.controller_keypair(f"{tmp_path}/controller-keys")[0]

        def answered(public: bytes, secret: bytes, within: float) -> bool:
            """Whether part 1 answers a status asked over a new CURVE session with the key pair given."""
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            dial(sock, ClientKeys(server, public, secret))
            sock.connect(f"tcp://127.0.0.1:{port}")
            try:
                sock.send(accounting.encode("status", id=1, levels=[]))
                return bool(sock.poll(int(within * 1000)))
            finally:
                sock.close(0)

        def issued(name: str) -> tuple[bytes, bytes]:
            found = keyfiles.read_gateway_key_file(controller.gateway_key_file(name))
            return found["public_key"].encode(), found["secret_key"].encode()

        gateway = issued("gw-a")  # issued after the part started: it looks the key up in the store
        wait_until("an issued gateway key answered by the part", 30, lambda: answered(*gateway, within=2))
        # Refused, so never answered (2 s each: an answer comes in milliseconds): a key never issued, and a
        # node's key, which opens the agents' socket and no other.
        assert not answered(*zmq.curve_keypair(), within=2)
        node_file = tmp_path / "node.key"
        node_file.write_text(controller.issue_key("n1"))
        found = keyfiles.read_node_key_file(str(node_file))
        assert not answered(found["public_key"].encode(), found["secret_key"].encode(), within=2)
        # The gateway's key issued again: its earlier one opens no new session once the part reads the keys.
        issued("gw-a")
        wait_until("the earlier key refused by the part", 60, lambda: not answered(*gateway, within=1))
    finally:
        context.destroy(linger=0)
        controller.stop()


def _parts_of(pid: int) -> list[int]:
    """The accountant part processes whose parent is PID."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and b"llmgw.control.accountparts" in cmdline:
            found.append(int(entry))
    return found
