"""The limit rules, each with its numbers worked out. The accountant is pure counting; the
tests that resolve chains from a store run on SQLite and PostgreSQL."""

import calendar
import time

import pytest
import sqlalchemy as sa

from llmgw import rules, store
from llmgw.control.accountant import Accountant, Refused, Reservation, Window
from llmgw.gateway.keytable import KeyTable
from llmgw.people import accounts, keys, limits, memberships, orgtree


class Clock:
    def __init__(self, t=1_800_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def level(counter, rpm=None, tpm=None, budget=None, period="month"):
    return [counter, rpm, tpm, budget, period]


def test_a_window_admits_at_most_its_limit_in_any_sixty_seconds():
    clock = Clock()
    w = Window()
    # 3 a minute: three at t=0, the fourth refused until the first is 60 s old.
    assert all(w.allow(3, 1, clock.t) for _ in range(3))
    assert w.allow(3, 1, clock.t + 59.9) is None
    assert w.retry_after(clock.t + 30) == 30
    assert w.allow(3, 1, clock.t + 60.0) is not None


def test_a_team_budget_is_one_pool_for_all_its_keys():
    # Team budget 3000 micro-units; k1 spends 2000, then 1500 (crossing: served, budgets stop once
    # reached); now 3500 >= 3000, so k2 in the same team is refused. Per-key pools would allow 3000 each.
    a = Accountant(Clock())
    team = level("team:t1", budget=3000)
    for cost in (2000, 1500):
        r = a.admit([level("key:k1"), team], priced=True, estimate=10)
        a.settle(r.id, 10, cost)
    refused = a.admit([level("key:k2"), team], priced=True, estimate=10)
    assert isinstance(refused, Refused) and refused.limit == "budget" and refused.counter == "team:t1"


def test_the_sum_of_teams_cannot_exceed_their_organisation():
    # Org budget 2000, each of four teams 2000, each request costs 800: spend goes 0, 800, 1600,
    # 2400; the fourth request sees 2400 >= 2000 at the org and is refused. Exactly three are served,
    # and the org is overspent by at most one request (400 < 800).
    a = Accountant(Clock())
    served = 0
    for i in range(4):
        r = a.admit([level(f"team:t{i}", budget=2000), level("org:o", budget=2000)], priced=True, estimate=1)
        if isinstance(r, Reservation):
            a.settle(r.id, 1, 800)
            served += 1
    assert served == 3


def test_requests_in_flight_hold_their_estimated_cost():
    # Budget 1000; each request may cost 300. Four are admitted before any settles (held: 0, 300,
    # 600, 900 < 1000); the fifth sees 1200 >= 1000 and is refused. All four then cost 300: 1200
    # spent, 200 over, less than one request. Without the hold, every concurrent request would pass.
    a = Accountant(Clock())
    chain = [level("key:k", budget=1000)]
    admitted = [a.admit(chain, True, 10, cost=300) for _ in range(5)]
    assert [isinstance(r, Reservation) for r in admitted] == [True] * 4 + [False]
    for r in admitted[:4]:
        a.settle(r.id, 10, 300)
    assert a.spent("key:k", "month") == 1200 and not a.reserved


def test_a_budget_without_a_price_never_binds():
    a = Accountant(Clock())
    for _ in range(5):
        r = a.admit([level("key:k", budget=0)], priced=False, estimate=1)
        assert isinstance(r, Reservation)
        a.settle(r.id, 1, 0)


def test_a_budget_refusal_charges_no_other_pool():
    # Budget 0 is spent at once; the refusal must leave the key's rpm pool untouched (0 of 1 used).
    a = Accountant(Clock())
    refused = a.admit([level("key:k", rpm=1), level("team:t", budget=0)], priced=True, estimate=5)
    assert refused.limit == "budget"
    assert a.status([level("key:k", rpm=1)])["rpm"] == (1, 1)


def test_a_refusal_hands_back_what_the_narrower_levels_took():
    # Team rpm 100, org rpm 1: the first request takes one of each; the second is refused by the org
    # and the team's slot it took is handed back, so the team shows 1 used, not 2.
    a = Accountant(Clock())
    chain = [level("team:t1", rpm=100), level("org:o", rpm=1)]
    assert isinstance(a.admit(chain, False, 1), Reservation)
    refused = a.admit(chain, False, 1)
    assert (refused.limit, refused.counter) == ("rpm", "org:o")
    assert a.requests["team:t1"].used(a.clock()) == 1


def test_a_token_refusal_keeps_the_request_but_hands_back_the_tokens():
    # rpm 10, tpm 100 at the key, tpm 50 at the team. A first request estimated at 10 leaves both
    # at 10; a second estimated at 60 fits the key (70 <= 100) but not the team (70 > 50).
    a = Accountant(Clock())
    chain = [level("key:k", rpm=10, tpm=100), level("team:t", tpm=50)]
    first = a.admit(chain, False, 10)
    refused = a.admit(chain, False, 60)
    assert (refused.limit, refused.counter) == ("tpm", "team:t")
    assert a.tokens["key:k"].used(a.clock()) == 10  # the 60 it took was handed back
    assert a.requests["key:k"].used(a.clock()) == 2  # the request did arrive
    a.settle(first.id, 30, 0)  # estimated 10, used 30: every token pool it went through now says 30
    assert a.tokens["key:k"].used(a.clock()) == a.tokens["team:t"].used(a.clock()) == 30


def test_status_reports_the_pool_nearest_to_refusing():
    # Team budget 9000 with 8000 spent by another key (1000 left, 11%); the key's own budget 5000
    # untouched (100% left). The key is told about the team's: the fuller pool, not the smaller number.
    a = Accountant(Clock())
    r = a.admit([level("key:other"), level("team:t", budget=9000)], True, 1)
    a.settle(r.id, 1, 8000)
    status = a.status([level("key:mine", budget=5000), level("team:t", budget=9000)])
    assert status["budget"] == (9000, 1000)


def test_periods_start_at_midnight_utc_in_any_time_zone(monkeypatch):
    # 2026-07-15 12:00 UTC, on a machine in Berlin's summer time (UTC+2): the day began at 00:00 UTC,
    # the month on the 1st at 00:00 UTC, not two hours off (local time less the winter offset).
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        noon = calendar.timegm((2026, 7, 15, 12, 0, 0))
        assert rules.period_start("day", noon) == calendar.timegm((2026, 7, 15, 0, 0, 0))
        assert rules.period_start("month", noon) == calendar.timegm((2026, 7, 1, 0, 0, 0))
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_budgets_start_again_with_their_period():
    clock = Clock(calendar.timegm((2026, 11, 30, 23, 59, 0)))
    a = Accountant(clock)
    chain = [level("key:k", budget=100, period="day")]
    a.settle(a.admit(chain, True, 1).id, 1, 100)
    assert a.admit(chain, True, 1).limit == "budget"
    clock.t += 120  # past midnight UTC
    assert isinstance(a.admit(chain, True, 1), Reservation)


def test_a_remembered_period_start_follows_the_clock_both_ways():
    # The start of each period is remembered until the next (it was worked out at every level of every
    # admission); a clock set back, or moved a month on, must still find the pools of its own period.
    clock = Clock(calendar.timegm((2026, 12, 31, 23, 59, 30)))
    a = Accountant(clock)
    month = [level("key:k", budget=100, period="month")]
    a.settle(a.admit(month, True, 1).id, 1, 100)
    assert a.admit(month, True, 1).limit == "budget" and a.spent("key:k", "month") == 100
    clock.t += 60  # January
    assert isinstance(a.admit(month, True, 1), Reservation) and a.spent("key:k", "month") == 0
    clock.t -= 60  # set back into December
    assert a.admit(month, True, 1).limit == "budget" and a.spent("key:k", "month") == 100
    clock.t += 40 * 86400  # February, past the January remembered
    assert a.spent("key:k", "month") == 0 and a.periods["month"][0] == calendar.timegm((2027, 2, 1, 0, 0, 0))


# --- chains resolved from the store -------------------------------------------------------------

def tree_with_people(engine):
    orgtree.add(engine, "org", "Acme")
    orgtree.add(engine, "team", "ml", "Acme")
    project = orgtree.add(engine, "project", "training", "Acme/ml")
    people = {}
    for name in ("ayse", "deniz"):
        user = accounts.create_user(engine, f"{name}@example.com", "a long enough password", state=accounts.ACTIVE)
        memberships.join(engine, user.email, "project", "Acme/ml/training")
        people[name] = user
    return project, people


def access_of(engine, key_record):
    return KeyTable.from_message(keys.key_set(engine)).access(key_record)


def wire(access):
    return [lv.wire() for lv in access.levels]


def test_a_persons_limit_is_one_pool_across_their_keys(engine):
    # ayse: 2 requests a minute as a person. Her personal key and her project key take one each;
    # a third request on either is refused. deniz is not affected.
    project, people = tree_with_people(engine)
    ayse, deniz = people["ayse"], people["deniz"]
    limits.set_limits(engine, "user", ayse.id, "test", rpm=2)
    personal, _ = keys.create_key(engine, "laptop", None, user_id=ayse.id)
    in_project, _ = keys.create_key(engine, "ci", project.id, user_id=ayse.id)
    theirs, _ = keys.create_key(engine, "d", project.id, user_id=deniz.id)
    a = Accountant()
    assert isinstance(a.admit(wire(access_of(engine, personal)), False, 1), Reservation)
    assert isinstance(a.admit(wire(access_of(engine, in_project)), False, 1), Reservation)
    assert a.admit(wire(access_of(engine, personal)), False, 1).counter == f"user:{ayse.id}"
    assert isinstance(a.admit(wire(access_of(engine, theirs)), False, 1), Reservation)


def test_a_per_member_limit_counts_each_member_apart(engine):
    # 1 request a minute for each member of the project: ayse's second is refused, deniz still
    # gets one, and ayse's personal key (outside the project) is not held to it at all.
    project, people = tree_with_people(engine)
    limits.set_limits(engine, "project_member", project.id, "test", rpm=1)
    ayse_key, _ = keys.create_key(engine, "a", project.id, user_id=people["ayse"].id)
    deniz_key, _ = keys.create_key(engine, "d", project.id, user_id=people["deniz"].id)
    personal, _ = keys.create_key(engine, "p", None, user_id=people["ayse"].id)
    a = Accountant()
    assert isinstance(a.admit(wire(access_of(engine, ayse_key)), False, 1), Reservation)
    assert a.admit(wire(access_of(engine, ayse_key)), False, 1).limit == "rpm"
    assert isinstance(a.admit(wire(access_of(engine, deniz_key)), False, 1), Reservation)
    assert access_of(engine, personal).levels == ()


def test_cluster_defaults_apply_only_where_nothing_else_limits(engine):
    project, _ = tree_with_people(engine)
    limits.set_limits(engine, "cluster", "", "test", rpm=60, tpm=200_000)
    limits.set_limits(engine, "team", orgtree.Tree.load(engine).find("team", "Acme/ml").id, "test", rpm=10)
    plain, _ = keys.create_key(engine, "plain")  # in default/default/default: nothing limits it
    in_team, _ = keys.create_key(engine, "ml", project.id)
    assert wire(access_of(engine, plain)) == [[f"default:key:{plain.id}", 60, 200_000, None, "month"]]
    # The team sets rpm, so the default rpm does not apply; the default tpm still does.
    levels = wire(access_of(engine, in_team))
    assert [lv[0].split(":")[0] for lv in levels] == ["team", "default"]
    assert levels[1][1:3] == [None, 200_000]


def test_a_persons_keys_share_the_cluster_defaults(engine):
    _, people = tree_with_people(engine)
    limits.set_limits(engine, "cluster", "", "test", rpm=2)
    mine = [keys.create_key(engine, f"k{i}", None, user_id=people["ayse"].id)[0] for i in range(3)]
    service, _ = keys.create_key(engine, "service")  # no person behind it: its own pool
    a = Accountant()
    admitted = [isinstance(a.admit(wire(access_of(engine, key)), False, 1), Reservation) for key in mine * 2]
    assert admitted.count(True) == 2  # not 2 for each of three keys
    assert isinstance(a.admit(wire(access_of(engine, service)), False, 1), Reservation)


def test_personal_use_is_one_pool_a_person_and_can_be_turned_off(engine):
    # `auth.personal` of the Go version: limits for what a person does on their own (personal keys and the
    # chat page), each person their own pool; a project key of theirs is not held to them.
    project, people = tree_with_people(engine)
    ayse, deniz = people["ayse"], people["deniz"]
    limits.set_limits(engine, "cluster", "", "test", rpm=60, tpm=1000)
    limits.set_limits(engine, "personal", "", "test", rpm=2)
    laptop, _ = keys.create_key(engine, "laptop", None, user_id=ayse.id)
    phone, _ = keys.create_key(engine, "phone", None, user_id=ayse.id)
    theirs, _ = keys.create_key(engine, "d", None, user_id=deniz.id)
    in_project, _ = keys.create_key(engine, "ci", project.id, user_id=ayse.id)
    # Personal use sets rpm, so the default rpm does not apply to it; the default tpm still does.
    assert wire(access_of(engine, laptop)) == [[f"personal:{ayse.id}", 2, None, None, "month"],
                                               [f"default:user:{ayse.id}", None, 1000, None, "month"]]
    table = KeyTable.from_message(keys.key_set(engine))
    assert [lv.counter for lv in table.person(ayse.id).levels][0] == f"personal:{ayse.id}"  # the chat page
    a = Accountant()
    admitted = [isinstance(a.admit(wire(access_of(engine, key)), False, 1), Reservation) for key in (laptop, phone) * 2]
    assert admitted == [True, True, False, False]
    assert isinstance(a.admit(wire(access_of(engine, theirs)), False, 1), Reservation)
    assert isinstance(a.admit(wire(access_of(engine, in_project)), False, 1), Reservation)

    limits.set_limits(engine, "personal", "", "test", disabled=True)
    assert access_of(engine, laptop).personal_off and not access_of(engine, in_project).personal_off
    assert KeyTable.from_message(keys.key_set(engine)).person(ayse.id).personal_off
    with pytest.raises(keys.KeyRefused, match="personal use is turned off here"):
        keys.create_key(engine, "another", None, user_id=ayse.id)
    with pytest.raises(rules.LimitError, match="only personal use can be turned off"):
        limits.set_limits(engine, "project", project.id, "test", disabled=True)
    limits.set_limits(engine, "personal", "", "test", disabled=None)
    assert not access_of(engine, laptop).personal_off


def test_allowlists_intersect_and_the_nearest_band_and_routing_profile_win(engine):
    project, _ = tree_with_people(engine)
    team = orgtree.Tree.load(engine).find("team", "Acme/ml")
    limits.set_limits(engine, "team", team.id, "test", models=["small", "large"], band="low", profile="batch")
    key, _ = keys.create_key(engine, "k", project.id, models=["large", "huge"], band="high", profile="chat")
    access = access_of(engine, key)
    assert access.models == frozenset({"large"})  # a key cannot add a model its team withheld
    assert (access.band, access.profile) == ("high", "chat")
    other, _ = keys.create_key(engine, "o", project.id)
    assert (access_of(engine, other).band, access_of(engine, other).profile) == ("low", "batch")
    with pytest.raises(rules.LimitError, match="routing profile"):
        limits.set_limits(engine, "team", team.id, "test", profile="no spaces allowed")
    with pytest.raises(rules.LimitError, match="routing.default_profile"):  # the gateways' own, below a model's
        limits.set_limits(engine, "cluster", "", "test", profile="batch")
    with pytest.raises(rules.LimitError, match="has no id"):
        limits.set_limits(engine, "personal", "someone", "test", rpm=1)
    # A person's own profile beats personal use's, on their own as on a personal key.
    ayse = accounts.find(engine, "ayse@example.com")
    limits.set_limits(engine, "personal", "", "test", profile="everyone")
    limits.set_limits(engine, "user", ayse.id, "test", profile="hers")
    assert KeyTable.from_message(keys.key_set(engine)).person(ayse.id).profile == "hers"


def test_every_limit_change_is_logged_with_who_and_what_it_was(engine):
    limits.set_limits(engine, "cluster", "", "alice", rpm=60)
    limits.set_limits(engine, "cluster", "", "bob", rpm=30, tpm=1000)
    limits.set_limits(engine, "cluster", "", "bob", rpm=None)
    with engine.connect() as conn:
        log = [(r.who, r.field, r.old, r.new) for r in reversed(limits.changes_log(conn))]
    assert log == [("alice", "rpm", None, "60"), ("bob", "rpm", "60", "30"), ("bob", "tpm", None, "1000"),
                   ("bob", "rpm", "30", None)]


def test_money_is_whole_units_in_and_micro_units_kept():
    assert rules.parse_money("50") == 50_000_000
    assert rules.parse_money("0.25") == 250_000
    assert rules.show_money(250_000) == "0.25"
    with pytest.raises(rules.LimitError, match="not an amount"):
        rules.parse_money("lots")
    # 0.5 a million in, 1.5 a million out: 1000 + 500 tokens cost 500 + 750 = 1250 micro-units.
    assert rules.Price(500_000, 1_500_000).cost(1000, 500) == 1250
    assert rules.Price(1, 0).cost(1, 0) == 1  # rounded up: nothing is free by being small


def test_spend_is_rebuilt_for_every_scope_after_a_restart(engine):
    # Usage today: 600 by ayse's project key, 500 by ayse on the chat page. After a "restart" the
    # team's pool holds 600 (only the project key spent in it), ayse's holds 1100, and a person's
    # budget of 1000 refuses her next request however she makes it.
    project, people = tree_with_people(engine)
    ayse = people["ayse"]
    key, _ = keys.create_key(engine, "ci", project.id, user_id=ayse.id)
    now = time.time()
    with engine.begin() as conn:
        for key_id, project_id, cost in ((key.id, project.id, 600), (f"session:{ayse.id}", None, 500)):
            conn.execute(store.usage.insert().values(at=now, key_id=key_id, project_id=project_id, user_id=ayse.id,
                                                     endpoint="chat", stream=False, status=200, latency_ms=1,
                                                     cost_micros=cost))
    team = orgtree.Tree.load(engine).find("team", "Acme/ml")
    a = Accountant()
    a.restore(engine)
    assert a.spent(f"team:{team.id}", "month") == 600
    # The same once the rows are rolled up, plus one more not yet rolled up (100 by the chat page):
    # each counted once, whether it is read from a roll-up or from the raw rows past the watermark.
    from llmgw.people import rollup
    assert rollup.roll_up(engine, now + rollup.SETTLE + 1) == 2
    with engine.begin() as conn:
        conn.execute(store.usage.insert().values(at=now, key_id=f"session:{ayse.id}", user_id=ayse.id,
                                                 endpoint="chat", stream=False, status=200, latency_ms=1,
                                                 cost_micros=100))
    again = Accountant()
    again.restore(engine)
    assert again.spent(f"team:{team.id}", "month") == 600 and again.spent(f"user:{ayse.id}", "day") == 1200
    assert a.spent(f"user:{ayse.id}", "month") == 1100
    assert a.spent(f"project_member:{project.id}/{ayse.id}", "day") == 600
    # Her share of a cluster default budget is rebuilt in the pool it is counted in, her own: the chat row
    # once went to "default:personal:..." and the key's to "default:key:...", both pools nobody reads.
    assert a.spent(f"default:user:{ayse.id}", "month") == 1100 and a.spent(f"personal:{ayse.id}", "month") == 500
    limits.set_limits(engine, "user", ayse.id, "test", budget=1000)
    table = KeyTable.from_message(keys.key_set(engine))
    assert a.admit(wire(table.person(ayse.id)), True, 1).limit == "budget"
    assert a.admit(wire(table.access(key)), True, 1).limit == "budget"
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(store.usage)).scalar() == 3


def test_only_the_gateway_that_admitted_a_request_settles_it_once_and_never_negative():
    a = Accountant(Clock())
    chain = [level("key:k", tpm=100, budget=1000)]
    r = a.admit(chain, True, 10, 10, owner=b"gateway-1")
    for tokens, cost, owner, words in ((-5, 0, b"gateway-1", "negative"), (5, -10**9, b"gateway-1", "negative"),
                                       (5, 10, b"gateway-2", "admitted by another gateway"),
                                       (5, 10, None, "admitted by another gateway")):
        assert words in a.settle(r.id, tokens, cost, owner=owner)
    assert a.reserved and a.tokens["key:k"].used(a.clock()) == 10  # the refusals changed nothing
    assert a.settle(r.id, 5, 10, owner=b"gateway-1") is None
    assert a.spent("key:k", "month") == 10 and a.tokens["key:k"].used(a.clock()) == 5 and not a.reserved
    assert "not held here" in a.settle(r.id, 5, 10, owner=b"gateway-1")  # settled already
    assert "not held here" in a.settle(999, 0, 10, owner=b"gateway-1")  # never admitted
    assert a.spent("key:k", "month") == 10
