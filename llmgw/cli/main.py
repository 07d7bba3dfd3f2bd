"""The `llmgw` command: keys, the simulated engine, and `llmgw up`.

Commands find the store through the same configuration the gateway reads
(`--config`, or `$LLMGW_CONFIG`), so `llmgw keys create` on the gateway's
machine needs no other flag. What a script wants (a secret, JSON) goes to
standard output; everything said to the person goes to standard error.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

import click

from llmgw import settings, store
from llmgw.cli.ctl import ctl
from llmgw.cli.debug import debug
from llmgw.cli.init import init, mirror_init
from llmgw.cli.login import login
from llmgw.cli.mirror import mirror
from llmgw.cli.org import limits_cli, org, prices
from llmgw.cli.storecmd import store_cli
from llmgw.cli.tables import print_table
from llmgw.cli.users import users


class Context:
    def __init__(self, config_path: str | None, store_url: str | None):
        self.config_path = config_path
        self.store_url = store_url
        self.admin = None  # set by `llmgw ctl`

    def config(self) -> settings.Config:
        try:
            return settings.load(self.config_path, {"store.url": self.store_url})
        except settings.ConfigError as e:
            raise click.ClickException(str(e)) from None

    def engine(self):
        cfg = self.config()
        url = cfg["store.url"]
        if cfg.source == "defaults" and self.store_url is None:
            _refuse_a_new_default_store(url)
        try:
            return store.writing_first(store.open_store(url))
        except Exception as e:
            raise click.ClickException(f"cannot open the store {store.describe(url)}: {e}") from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", envvar="LLMGW_CONFIG", type=click.Path(dir_okay=False),
              help="TOML configuration file, the gateway's (also $LLMGW_CONFIG).")
@click.option("--store", "store_url", help="Database URL, overriding store.url.")
@click.version_option(package_name="llmgw")
@click.pass_context
def main(ctx, config_path, store_url):
    """llmgw: one OpenAI-compatible endpoint in front of your own LLM servers."""
    ctx.obj = Context(config_path, store_url)


def _refuse_a_new_default_store(url: str) -> None:
    """Refuse to make the default SQLite store here when nothing said which store to use: run in the
    wrong directory, `llmgw keys list` once made an empty store there and listed nothing, silently."""
    path = url[len("sqlite:///"):] if url.startswith("sqlite:///") else None
    if path is None or os.path.exists(path):
        return
    raise click.ClickException(
        f"no configuration was given and there is no store at {os.path.abspath(path)} (the default, {url}). "
        "Name the gateway's configuration with --config FILE or LLMGW_CONFIG=FILE (`llmgw up` writes var/up.toml), "
        "or the database with --store URL.")


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts)) if ts else "-"


@main.group()
def keys():
    """Make, list and revoke API keys."""


@keys.command("create")
@click.argument("name")
@click.option("--project", help="Project it spends against (id, path or unique name); may be left out where "
              "there is only one project, or with --for (a personal key).")
@click.option("--for", "owner", metavar="EMAIL", help="The person the key belongs to; alone, a personal key.")
@click.option("--expires-in", metavar="DURATION", help="Lifetime such as 30d, 12h or 2w; none by default.")
@click.option("--band", type=click.Choice(["high", "normal", "low"]), help="Admission band when replicas are full.")
@click.option("--models", help="Comma-separated models the key may use (default: every model its scopes allow); "
              "each a name or alias the catalog holds.")
@click.option("--allow-unknown-models", is_flag=True, help="Take --models names the catalog does not hold (yet).")
@click.option("--profile", metavar="NAME", help="The routing profile its requests go by (a gateway's "
              "[[routing_profiles]] entry); default: its project's, team's or organisation's, else its model's.")
@click.option("--claim", is_flag=True, help="Print a one-time link that shows the key, instead of the key.")
@click.option("--claim-ttl", metavar="DURATION", default="7d", show_default=True,
              help="How long the --claim link works if nobody opens it.")
@click.option("--base-url", metavar="URL", help="Where people reach the gateway, for the --claim link "
              "(default: gateway.public_url, or else its listen address).")
@click.pass_obj
def keys_create(obj: Context, name, project, owner, expires_in, band, models, allow_unknown_models, profile, claim,
                claim_ttl, base_url):
    """Make a key called NAME and print its secret (on standard output, alone; it is shown only now)."""
    from llmgw.people import accounts
    from llmgw.people import keys as keymod

    lifetime = _duration(expires_in, "--expires-in") if expires_in else None
    link_lifetime = _duration(claim_ttl, "--claim-ttl")
    if base_url is not None and not (claim and _is_base_url(base_url)):
        raise click.BadParameter("give the http:// or https:// address people reach the gateway at, with --claim"
                                 if claim else "is for the --claim link: give --claim too", param_hint="--base-url")
    engine = obj.engine()
    allowed = models.split(",") if models else None
    if allowed and not allow_unknown_models:
        from llmgw.cli.keys import check_models

        check_models(obj.config(), engine, allowed)
    try:
        user_id = accounts.find(engine, owner).id if owner else None
        where = project if project else (None if owner else _only_project(engine))
        record, secret = keymod.create_key(engine, name, where, lifetime, user_id=user_id, band=band,
                                           models=allowed, profile=profile)
    except (keymod.KeyRefused, accounts.AccountError) as e:
        raise click.ClickException(str(e)) from None
    if profile:
        from llmgw.cli.org import note_unknown_profile

        note_unknown_profile(obj.config(), profile)
    expiry = f", expires {_when(record.expires_at)} UTC" if record.expires_at else ""
    spends = "a personal key" if record.project_id is None else f"in project {record.project}"
    click.echo(f"created key {record.id} ({record.prefix}...), {spends}{owner and f' for {owner}' or ''}{expiry}.",
               err=True)
    if claim:
        token = keymod.make_claim(engine, record.id, secret, link_lifetime)
        click.echo("Send this link to whoever should have the key. It works once, until "
                   f"{_when(time.time() + link_lifetime)} UTC, and shows the key only to whoever opens it:", err=True)
        click.echo(f"{(base_url or obj.config().public_url()).rstrip('/')}/claim/{token}")
        return
    click.echo("The secret is below and will not be shown again; keep it somewhere safe.", err=True)
    click.echo(secret)


def _duration(text: str, option: str) -> float:
    from llmgw.people import keys as keymod

    try:
        return keymod.parse_duration(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint=option) from None


def _is_base_url(text: str) -> bool:
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not (parts.query or parts.fragment)


def _only_project(engine) -> str:
    """The tree's one project, where it has exactly one: a key with no --project spends there. A tree built
    on the pages may have none called default, and with several the choice is the operator's."""
    from llmgw.people.orgtree import Tree

    projects = Tree.load(engine).of_kind("project")
    if len(projects) == 1:
        return projects[0].id
    if not projects:
        raise click.UsageError("there is no project for the key to spend in: add one (`llmgw org add project "
                               "NAME --in ORG/TEAM`), or make a personal key with --for EMAIL")
    shown = ", ".join(p.path for p in projects[:10]) + (f" and {len(projects) - 10} more" if len(projects) > 10 else "")
    raise click.UsageError(f"say which project the key spends in with --project; there are {len(projects)}: "
                           f"{shown}")


KEYS_PAGE = 100  # keys in one table of `llmgw keys list`: a terminal's worth, read without reading them all


@keys.command("list")
@click.option("--project", help="Only the keys that spend in this project (id, path or unique name).")
@click.option("--all", "show_all", is_flag=True, help="Revoked and expired keys too.")
@click.option("--limit", type=click.IntRange(min=0), metavar="N",
              help=f"At most N keys [{KEYS_PAGE} in the table; every key with --json]; 0: every key.")
@click.option("--after", metavar="ID", help="Begin after the key with this id: the last of the page before.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per key, for scripts.")
@click.pass_obj
def keys_list(obj: Context, project, show_all, limit, after, as_json):
    """List the keys that work (never their secrets), in the order they were made: where each spends, and whose
    it is. A page at a time: the table shows the first 100 and says how to see the next."""
    from llmgw.people import keys as keymod
    from llmgw.people.orgtree import Tree, TreeError

    engine = obj.engine()
    where = None
    if project:
        try:
            where = Tree.load(engine).find("project", project)
        except TreeError as e:
            raise click.BadParameter(str(e), param_hint="--project") from None
    now = time.time()
    limit = (None if as_json else KEYS_PAGE) if limit is None else limit or None
    scope = dict(project_ids={where.id} if where else None, working_at=None if show_all else now)
    try:
        # One more than the page, to know whether another follows.
        shown = keymod.page_of_keys(engine, after=after, limit=None if limit is None else limit + 1, **scope)
        if limit is not None:
            shown = list(shown)
            more, shown = len(shown) > limit, shown[:limit]
        if as_json:
            for r, email in shown:
                click.echo(json.dumps({"id": r.id, "name": r.name, "project": r.project, "owner": email,
                                       "prefix": r.prefix, "created_at": r.created_at, "expires_at": r.expires_at,
                                       "revoked_at": r.revoked_at}))
            return
        rows = [("ID", "NAME", "SPENDS IN", "OWNER", "PREFIX", "CREATED", "STATE")]
        for r, email in shown:
            state = ("revoked " + _when(r.revoked_at) if r.revoked_at else
                     "expired " + _when(r.expires_at) if r.expires_at and r.expires_at <= now else
                     "expires " + _when(r.expires_at) if r.expires_at else "active")
            rows.append((r.id, r.name, r.project, email or "-", r.prefix + "...", _when(r.created_at), state))
    except keymod.KeyRefused as e:
        raise click.BadParameter(str(e), param_hint="--after") from None
    place = f" in {where.path}" if where else ""
    if len(rows) == 1 and after is None:
        everything = keymod.count_keys(engine, scope["project_ids"]) if not show_all else 0
        if everything:
            click.echo(f"no key{place} works now; --all lists the {everything:,} revoked or expired", err=True)
        else:
            click.echo(f"no keys{place} yet; make one with `llmgw keys create NAME"
                       + (f" --project {where.path}`" if where else "`"), err=True)
        return
    print_table(rows)
    if limit is not None and more:
        total = keymod.count_keys(engine, **scope)
        options = (f" --project {shlex.quote(where.path)}" if where else "") + (" --all" if show_all else "")
        click.echo(f"{len(rows) - 1:,} of {total:,} keys{place} shown; the next: llmgw keys list{options} "
                   f"--after {rows[-1][0]}" + ("; every key: --limit 0" if limit == KEYS_PAGE else ""), err=True)


@keys.command("revoke")
@click.argument("which")
@click.pass_obj
def keys_revoke(obj: Context, which):
    """Revoke the key with id, prefix or name WHICH. Every gateway refuses it within seconds."""
    from llmgw.people import keys as keymod

    asked_at = time.time()
    try:
        record = keymod.revoke_key(obj.engine(), which)
    except keymod.KeyRefused as e:
        raise click.ClickException(str(e)) from None
    if record.revoked_at < asked_at:  # revoke_key leaves a revoked key as it was
        click.echo(f"key {record.id} ({record.prefix}..., {record.name}) was already revoked, on "
                   f"{_when(record.revoked_at)} UTC; nothing changed.", err=True)
        return
    click.echo(f"revoked key {record.id} ({record.prefix}..., {record.name}).", err=True)


@keys.command("threads")
@click.option("--project", help="The project (id, path or unique name). Without it: list the projects that "
              "keep conversations.")
@click.option("--retain-hours", type=float, metavar="N", help="Keep its conversations N hours after their last turn.")
@click.option("--off", is_flag=True, help="Keep none: new turns are refused now, kept ones go at the next sweep.")
@click.pass_obj
def keys_threads(obj: Context, project, retain_hours, off):
    """Let a project's keys keep conversations (`x-llmgw-thread`, Responses' `store`), or stop it."""
    _keeping(obj, "threads", project, retain_hours, off)


@keys.command("memory")
@click.option("--project", help="The project (id, path or unique name). Without it: list the projects that "
              "keep notes.")
@click.option("--retain-hours", type=float, metavar="N", help="Keep each note N hours after it was last written.")
@click.option("--off", is_flag=True, help="Keep none: the notes API is refused now, kept notes go at the next sweep.")
@click.pass_obj
def keys_memory(obj: Context, project, retain_hours, off):
    """Let a project's agents keep notes (`/v1/memory` and the gateway's MCP tools), or stop it."""
    _keeping(obj, "memory", project, retain_hours, off)


def _keeping(obj: Context, kind: str, project, retain_hours, off) -> None:
    """`llmgw keys threads|memory`: set, end or list what projects keep of KIND."""
    from llmgw.people import keeping
    from llmgw.people.orgtree import TreeError

    what = keeping.KINDS[kind][1]
    since = "their last turn" if kind == "threads" else "it was last written"
    engine = obj.engine()
    if project is None:
        if retain_hours is not None or off:
            raise click.UsageError("say which project: --project P")
        rows = keeping.kept(engine, kind)
        if not rows:
            click.echo(f"no project keeps {what}; turn them on with "
                       f"`llmgw keys {kind} --project P --retain-hours N`", err=True)
            return
        print_table([("PROJECT", "KEPT FOR")] + [(path, f"{hours:g} h") for path, hours in rows])
        return
    if off == (retain_hours is not None):
        raise click.UsageError(f"give either --retain-hours N (how long a {what[:-1]} is kept after {since}) "
                               "or --off")
    try:
        node, before = keeping.set_keeping(engine, kind, project, None if off else retain_hours)
    except (keeping.KeepingRefused, TreeError) as e:
        raise click.ClickException(str(e)) from None
    was = "kept none" if before is None else f"kept them {before:g} h"
    if off:
        click.echo(f"{node.path} keeps no {what} now ({was} before); those kept are deleted at the next "
                   "hourly sweep.", err=True)
    else:
        click.echo(f"{node.path} keeps {what} {retain_hours:g} h after {since} ({was} before). "
                   "Their text is stored; docs/security.md says who can read it.", err=True)


@main.command()
@click.option("--by", type=click.Choice(["org", "team", "project", "person", "model", "key"]), default="project",
              show_default=True, help="What to group by.")
@click.option("--since", default="7d", show_default=True, metavar="DURATION", help="How far back: 24h, 7d, 4w.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per group, with its series.")
@click.pass_obj
def usage(obj: Context, by, since, as_json):
    """Requests, tokens and spend per organisation, team, project, person, model or key."""
    from llmgw import rules
    from llmgw.people import keys as keymod
    from llmgw.people import usagereport

    try:
        span = keymod.parse_duration(since)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--since") from None
    found = usagereport.report(obj.engine(), by, time.time() - span)
    if as_json:
        for line in found.lines:
            click.echo(json.dumps({by: line.label, "requests": line.requests, "errors": line.errors,
                                   "prompt_tokens": line.prompt_tokens, "completion_tokens": line.completion_tokens,
                                   "cost_micros": line.cost_micros,
                                   "budget_micros": line.budget[0] if line.budget else None,
                                   "budget_period": line.budget[1] if line.budget else None,
                                   "series": {str(int(k)): v for k, v in sorted(line.series.items())}}))
        return
    if not found.lines:
        click.echo(f"no use in the last {since}", err=True)
        return
    budgets = any(line.budget for line in found.lines)  # a column only where some row's own level sets one
    rows = [(by.upper(), "REQUESTS", "ERRORS", "PROMPT TOKENS", "COMPLETION TOKENS", "SPENT") + (("BUDGET",) if budgets
                                                                                               else ())]
    rows += [(line.label, f"{line.requests:,}", f"{line.errors:,}", f"{line.prompt_tokens:,}",
              f"{line.completion_tokens:,}", rules.show_money(line.cost_micros))
             + ((f"{rules.show_money(line.budget[0])} a {line.budget[1]}" if line.budget else "-",) if budgets else ())
             for line in found.lines]
    print_table(rows)


@main.command()
@click.option("--listen", default="127.0.0.1:0", show_default=True, help="HOST:PORT; port 0 picks a free one.")
@click.option("--model", default="sim", show_default=True, help="The model name it serves.")
@click.option("--replica", default="sim", show_default=True, help="Its name in answers (system_fingerprint).")
@click.option("--ttft-ms", type=float, default=50.0, show_default=True,
              help="Time to first token of a prompt whose every token is cached (see --prefill-ms-per-token).")
@click.option("--tokens-per-s", type=float, default=50.0, show_default=True, help="Token rate; 0 for no delay.")
@click.option("--max-concurrency", type=int, default=0, show_default=True,
              help="Requests generating at once; the rest wait. 0 for no limit.")
@click.option("--max-queue", type=int, default=-1, show_default=True,
              help="With --max-concurrency: requests allowed to wait; beyond, 429. -1 for no limit.")
@click.option("--default-tokens", type=int, default=16, show_default=True, help="Answer length without max_tokens.")
@click.option("--prefill-ms-per-token", type=float, default=0.0, show_default=True,
              help="Time to first token added for each prompt token not in the prefix cache. Prefills run one "
              "at a time, so long uncached prompts queue behind each other. 0: a prompt costs --ttft-ms alone.")
@click.option("--prefix-cache-tokens", type=click.IntRange(min=0), default=65536, show_default=True,
              help="Tokens the prefix cache holds, in blocks of 16, least recently used evicted first.")
@click.option("--no-prefix-cache", is_flag=True, help="Cache nothing: every prompt token is prefilled "
              "(--prefix-cache-tokens 0).")
@click.option("--fail-rate", type=float, default=0.0, show_default=True,
              help="Fraction of requests (and health checks) answered 500, as by a sick engine.")
@click.option("--die-after", type=int, default=0, show_default=True,
              help="Exit partway through the Nth request (0: never).")
@click.option("--stall-after-tokens", type=int, default=-1, show_default=True,
              help="Stop sending after K tokens of a stream, keeping the connection open (-1: never).")
@click.option("--keepalive-ms", type=click.FloatRange(min=0), default=0, show_default=True,
              help="While a stream's first token is awaited, send a comment event (`: keep-alive`) every this many "
              "ms, as llama.cpp's server does every 30 s while it reads a long prompt (0: never).")
@click.option("--loading", is_flag=True, help="Answer 503 \"Loading model\" to everything, as llama.cpp does while it loads.")
@click.option("--api-key", envvar="LLMGW_SIM_API_KEY", help="Answer only requests with Authorization: Bearer KEY "
              "(/health excepted), as a replica started by an agent does [$LLMGW_SIM_API_KEY].")
@click.option("--reply", help="The text of every answer, streamed a word a token, instead of tok0 tok1 ...")
@click.option("--tool-call", "tool_calls", type=(str, str), multiple=True, metavar="NAME ARGUMENTS",
              help="Answer a chat that offers tool NAME, and has no tool result yet, with a call of it with "
              "ARGUMENTS (a JSON object); a chat ending in a tool result with \"The tool said: \" and the result. "
              "Repeat it for several tools: the first one offered is called.")
@click.option("--reasoning", help="A chat answer's reasoning_content, streamed before its text, as vLLM streams a "
              "reasoning model's.")
@click.option("--reply-if", "reply_if", type=(str, str), multiple=True, metavar="WORD TEXT",
              help="Answer a prompt that holds WORD with TEXT (a judge that finds one word unsafe). Repeatable; "
              "the first that matches answers.")
@click.option("--max-context", type=int, default=0, show_default=True,
              help="Answer 400 to a prompt of more tokens than this, as llama.cpp does (0: no limit).")
@click.option("--gather", type=int, default=0, show_default=True,
              help="Hold each request's first token until this many requests run at once, or its time to first "
              "token has passed (0: never hold): a test of concurrency that does not depend on how fast "
              "clients connect.")
@click.option("--garbled", is_flag=True, help="Answer 200 with a body that is not JSON, and end a stream with an "
              "error event after its first token, as a broken engine (or a proxy in front of one) does.")
@click.option("--ranks", type=click.IntRange(1, 64), default=1, show_default=True,
              help="The ranks of a replica over several nodes, one engine each: rank 0 serves HTTP once every "
              "rank has joined it at --master; the others are headless.")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True, help="This engine's rank.")
@click.option("--group", default="", help="The replica the ranks belong to; a rank of another is not counted.")
@click.option("--master", help="HOST:PORT where the ranks meet: rank 0 listens there, the others dial it.")
def sim(listen, model, replica, ttft_ms, tokens_per_s, max_concurrency, max_queue, default_tokens,
        prefill_ms_per_token, prefix_cache_tokens, no_prefix_cache, fail_rate, die_after, stall_after_tokens,
        keepalive_ms, loading, api_key, reply, tool_calls, reasoning, reply_if, max_context, gather, garbled, ranks, rank, group, master):
    """Run a simulated OpenAI-compatible engine, for tests and benchmarks.

    A test instrument, never a model: it answers `tok0 tok1 ...` (or the
    scripted text), counts a word as a token, and times its answers as told.
    Time to first token is --ttft-ms plus --prefill-ms-per-token for each
    prompt token its prefix cache lacks; the cache is vLLM's in miniature:
    blocks of 16 tokens, a block reused only where every token before it
    matches, a prompt's blocks kept once prefilled and the answer's once
    complete (a conversation's next turn finds its history), the least
    recently used evicted first.
    """
    from llmgw.engines.sim import SimOptions, serve

    for name, arguments in tool_calls:
        try:
            assert isinstance(json.loads(arguments), dict)
        except (ValueError, AssertionError):
            raise click.BadParameter(f"the arguments of {name} are not a JSON object: {arguments!r}; "
                                     "write them as one, such as '{\"command\": \"echo hi\"}'",
                                     param_hint="--tool-call") from None
    options = SimOptions(model=model, replica=replica, ttft_ms=ttft_ms, tokens_per_s=tokens_per_s,
                         max_concurrency=max_concurrency, max_queue=max_queue, default_tokens=default_tokens,
                         prefill_ms_per_token=prefill_ms_per_token,
                         prefix_cache_tokens=0 if no_prefix_cache else prefix_cache_tokens, fail_rate=fail_rate,
                         die_after=die_after, stall_after_tokens=stall_after_tokens, keepalive_ms=keepalive_ms,
                         loading=loading, api_key=api_key or None,
                         reply=reply, tool_calls=tuple(tool_calls), reasoning=reasoning,
                         reply_if=tuple(reply_if), max_context=max_context, gather=gather,
                         garbled=garbled, ranks=ranks, rank=rank, group=group, master=master)
    if ranks > 1 and (not master or rank >= ranks):
        raise click.UsageError(f"--ranks {ranks} needs --master HOST:PORT, and --rank below {ranks}")
    serve(listen, options, announce=lambda line: click.echo(line) or sys.stdout.flush())


main.add_command(ctl)
main.add_command(users)
main.add_command(org)
main.add_command(limits_cli)
main.add_command(prices)
main.add_command(mirror)
main.add_command(store_cli)
main.add_command(debug)


@main.command()
@click.option("--listen", metavar="HOST:PORT",
              help="Where the gateway listens: gateway.listen from --config, else 127.0.0.1:8080. Use :8080 to "
                   "open it to others.")
@click.option("--workers", type=int, help="Gateway worker processes: gateway.workers from --config, else 2.")
@click.pass_obj
def up(obj: Context, listen, workers):
    """Serve the starter model on this machine: llama.cpp, a gateway in front, and a key to call it.

    Every process listens on 127.0.0.1 unless the configuration given with --config names an address
    for it (gateway.metrics_listen, controller.agent_listen, mirror.listen, ...); the rest of that
    configuration reaches the processes too. var/up.toml is what they read."""
    from llmgw.cli.up import Up

    Up(obj.config(), obj.config_path, listen, workers).run()


main.add_command(init)
main.add_command(login)
mirror.add_command(mirror_init)


@main.group()
def node():
    """Nodes reached over SSH: add them to this controller."""


@node.command("add")
@click.argument("hosts", nargs=-1, required=True, metavar="[USER@]HOST...")
@click.option("--admin", "admin_url", help="The controller's admin API [http://controller.admin_listen].")
@click.option("--controller", "controllers", multiple=True, metavar="HOST:PORT",
              help="Where the nodes dial the controller (repeatable) [controller.agent_listen's port, at the "
                   "address this machine has as each host sees it].")
@click.option("--name", help="The node's name (one host only) [the host's short host name].")
@click.option("--dir", "prefix", default="", help="Where llmgw goes on the host [/opt/llmgw as root, else ~/llmgw].")
@click.option("--python", default="python3", show_default=True,
              help="The host's Python (3.11 or later, the same minor version as here).")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="A label for placement (repeatable).")
@click.option("--fabric", "fabrics", multiple=True, metavar="NAME[:HCA,...]",
              help="A fabric the hosts' adapters are on, for replicas over several nodes (repeatable): its name, the "
                   "same on every node of it, and its adapters (all of the host's where one fabric is given).")
@click.option("--ignore-checks", is_flag=True, help="Start the agent even when the doctor finds a failure there.")
@click.option("--new-key", is_flag=True, help="Issue a new key even where the host holds one (the old one stops "
                                             "working).")
@click.option("--no-wait", is_flag=True, help="Do not wait for the node to register.")
@click.option("--wait-timeout", type=float, default=180, show_default=True, help="Seconds to wait for it.")
@click.option("--wait-engine", "wait_engines", multiple=True, type=click.Choice(["llamacpp", "vllm", "sglang"]),
              help="Also install this engine there now, from the engine catalogue ([[engines]] in this machine's "
                   "configuration, copied to each node), and wait until it is installed (repeatable).")
@click.option("--engine-timeout", type=float, default=1800, show_default=True,
              help="Seconds to wait for each engine's install (vLLM is gigabytes).")
@click.option("--ssh-port", "port", type=int, help="The hosts' SSH port [ssh's configuration, else 22].")
@click.option("-i", "--identity", type=click.Path(exists=True, dir_okay=False), help="The SSH private key to use.")
@click.option("--known-hosts", type=click.Path(dir_okay=False), help="ssh's known-hosts file for the hosts' keys.")
@click.option("--accept-new-host-key", "accept_new", is_flag=True,
              help="Trust a host key ssh has never seen (first use); a changed key is still refused.")
@click.pass_obj
def node_add(obj: Context, hosts, admin_url, controllers, name, prefix, python, labels, fabrics, ignore_checks, new_key,
             no_wait, wait_timeout, wait_engines, engine_timeout, port, identity, known_hosts, accept_new):
    """Install llmgw on each HOST over SSH and start its agent, as a node of this controller.

    Uses the system's ssh in batch mode with your own keys. Each host gets a virtual environment with
    exactly the versions installed here (no package index needed), its key (0600), the agent's
    configuration, the doctor's checks and a running agent; one line per host says how it went."""
    from llmgw.apiclient import admin_client
    from llmgw.cli import nodeadd

    if name and len(hosts) > 1:
        raise click.UsageError("--name names one node; give one host with it, or leave it out to use host names")
    try:
        parsed_labels = dict(label.split("=", 1) for label in labels)
    except ValueError:
        raise click.BadParameter("write each label as KEY=VALUE, such as rack=r12", param_hint="--label") from None
    tables = [{"name": f.split(":", 1)[0], **({"adapters": [a for a in f.split(":", 1)[1].split(",") if a]}
                                              if ":" in f else {})} for f in fabrics]
    try:
        settings.validate_fabrics(tables, "--fabric")
    except settings.ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--fabric") from None
    cfg = obj.config()
    if no_wait and wait_engines:
        raise click.UsageError("--no-wait and --wait-engine: choose one")
    missing = [e for e in wait_engines if e not in {entry["name"] for entry in cfg.engines}]
    if missing:
        raise click.UsageError(f"this machine's configuration has no [[engines]] entry for {', '.join(missing)}, so "
                               "no node could install it: `llmgw mirror pack-engine` prints one to add")
    options = nodeadd.Options(
        admin=admin_client(cfg, admin_url or cfg["controller.admin_listen"],
                           "node add runs on the controller's machine, or give --admin URL"),
        agent_listen=cfg["controller.agent_listen"], controllers=controllers, name=name, prefix=prefix, python=python,
        labels=parsed_labels, fabrics=tables, ignore_checks=ignore_checks, new_key=new_key, wait=not no_wait, wait_timeout=wait_timeout,
        engines=cfg.engines, mirror_url=cfg["mirror.base_url"] or cfg["agent.mirror_url"], wait_engines=wait_engines,
        engine_timeout=engine_timeout, accept_new=accept_new, port=port, identity=identity, known_hosts=known_hosts)
    if not nodeadd.run(options, hosts):
        sys.exit(1)
