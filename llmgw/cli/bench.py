"""`llmgw ctl bench MODEL` and `llmgw ctl capacity`: how many requests at once each replica serves well.

The bench asks the controller for the model's ready replicas and measures
them one at a time through a gateway, naming each in `X-Llmgw-Replica`: the
other replicas go on serving everyone, and the one measured is loaded past
any limit it had (so a replica can be measured again and found to take
more). Its people meanwhile get slower answers there, which the bench says
before it starts. Its requests carry an administrator's key, the only kind a
gateway lets name a replica; they are held to that key's limits and
recorded as its usage, like anyone's.

Levels are searched as llmgw/cli/ramp.py says, each measured by
llmgw/cli/benchload.py; a line per level goes to standard error while it
runs, the results to standard output (a table, or `--json`). With `--save`
the last level that held is filed under each replica's profile (the lowest,
where several replicas share one) and gateways hold every replica of that
profile to it. `llmgw ctl capacity` lists what was saved.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request

import click

from llmgw import filemodes
from llmgw.apiclient import segment
from llmgw.cli import benchload, ramp
from llmgw.cli.tables import print_table, printable
from llmgw.wire.gateways import MAX_IN_FLIGHT

SLO_MOST = 3600.0  # seconds: an SLO beyond an hour is a mistyped unit


def _seconds(what: str, example: str):
    """A click callback for an SLO in seconds: more than 0, at most an hour, with an example when it is not."""
    def check(_ctx, param, value):
        if value is None or 0 < value <= SLO_MOST:
            return value
        raise click.BadParameter(f"{value:g} is not a {what} in seconds: give more than 0 and at most "
                                 f"{SLO_MOST:.0f}, such as {example}", param=param)
    return check


def _rows_of(result: list[dict], percentile: int) -> list[tuple]:
    rows = [("REPLICA", "NODE", "PROFILE", "AT ONCE", f"TTFT p{percentile}", f"TPOT p{percentile}", "REQ/S",
             "TOK/S")]
    for r in result:
        held = r["held"] or {}
        rows.append((r["replica"], r["node"], r["profile"] or "(stale profile)", r["max_in_flight"] or "none at SLO",
                     _s(held.get("ttft_s")), _ms(held.get("tpot_s")), _n(held.get("requests_per_s"), 2),
                     _n(held.get("tokens_per_s"), 0)))
    return rows


def _s(value) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _n(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _figures(level: ramp.Level | None) -> dict | None:
    if level is None:
        return None
    return {"ttft_s": level.ttft, "tpot_s": level.tpot, "requests_per_s": level.requests_per_s,
            "tokens_per_s": level.tokens_per_s, "samples": level.samples}


def _check_gateway(url: str) -> None:
    """Refuse now, with where it looked, when nothing answers at URL."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=10):
            return
    except urllib.error.HTTPError as e:
        e.close()
        return  # something answers; what it says to requests is judged on the first one
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise click.ClickException(f"the gateway at {url} does not answer ({reason}). Give --gateway URL of a "
                                   "gateway that follows this controller (default: gateway.public_url, else "
                                   "gateway.listen, of --config)") from None


def _no_key_option(value) -> None:
    """Refuse the --key of earlier versions saying what to use instead."""
    if value is not None:
        raise click.UsageError("--key is gone: a command line is shown to every user of this machine (ps). Put the "
                               "key in $LLMGW_API_KEY, or in a file only you can read and give --key-file PATH")


def _api_key(key_file: str | None) -> str:
    """The administrator's API key: KEY_FILE's text (a file others may read is refused, as every llmgw file
    holding a secret is), else $LLMGW_API_KEY. Never an option's value, which every local user sees in ps."""
    if key_file is None:
        key = os.environ.get("LLMGW_API_KEY", "").strip()
        if not key:
            raise click.UsageError("give an administrator's API key in $LLMGW_API_KEY or in a file named by "
                                   "--key-file PATH (make one with `llmgw keys create bench --for ADMIN-EMAIL`): "
                                   "only such a key may name the replica a request goes to")
        return key
    try:
        filemodes.refuse_loose({key_file: filemodes.OTHERS})
        with open(key_file, encoding="utf-8") as f:
            key = f.read().strip()
    except filemodes.LooseFiles as e:
        raise click.ClickException(f"--key-file: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise click.ClickException(f"--key-file: cannot read {key_file} ({getattr(e, 'strerror', None) or e}); "
                                   "give a file holding the key, or set $LLMGW_API_KEY") from None
    if not key:
        raise click.ClickException(f"--key-file: {key_file} is empty; write an administrator's API key into it")
    return key


def _ready_replicas(admin, model: str, only: str | None) -> list[dict]:
    if model not in {m["name"] for m in admin.call("GET", "/api/v1/models")["models"]}:
        raise click.ClickException(f"no model {model!r} in the catalog; `llmgw ctl models` lists them")
    mine = [r for r in admin.call("GET", "/api/v1/replicas")["replicas"] if r["model"] == model]
    ready = [r for r in mine if r["state"] == "ready" and r["url"]]
    if only is not None:
        chosen = [r for r in ready if r["shard_id"] == only]
        if not chosen:
            raise click.ClickException(f"{only} is not a ready replica of {model}; ready: "
                                       f"{printable(', '.join(r['shard_id'] for r in ready) or 'none')}")
        return chosen
    if not ready:
        states = ", ".join(f"{r['shard_id']} {r['state']}" for r in mine) or "none is placed"
        raise click.ClickException(f"{model} has no ready replica to measure ({printable(states)}). Wait until `llmgw ctl "
                                   f"replicas --model {model}` shows one ready; `llmgw ctl models` says why none "
                                   "can be placed")
    return ready


def _ramp(target: benchload.Target, slo: ramp.SLO, most: int, samples: int) -> ramp.Ramp:
    """Search one replica's capacity, a line on standard error per level."""
    search = ramp.Ramp(slo, most)
    while (level := search.next_level()) is not None:
        click.echo(f"  {level} at once ...", nl=False, err=True)
        started = time.monotonic()
        try:
            # Four requests a client at least: requests of one size run in lock-step rounds, one round's
            # waiters are a fixed share of it, and two rounds could show one waiter fewer than that share
            # (at 5 on 4 slots, 1 of 10 rather than 2: under p90 by luck of the order).
            measured = benchload.measure(target, level, max(samples, 4 * level), slo.percentile)
        except (benchload.Refused, KeyboardInterrupt):
            click.echo(" stopped", err=True)  # the line ends before the reason (or click's "Aborted!")
            raise
        why = search.record(measured)
        click.echo(f" TTFT p{slo.percentile} {_s(measured.ttft)}, TPOT p{slo.percentile} {_ms(measured.tpot)}, "
                   f"{_n(measured.requests_per_s, 2)} req/s, {_n(measured.tokens_per_s, 0)} tok/s "
                   f"({measured.samples} measured, {time.monotonic() - started:.0f} s): "
                   + ("held" if why is None else f"broke: {why}"), err=True)
    return search


@click.command()
@click.argument("model")
@click.option("--slo-ttft", type=float, default=2.0, show_default=True, callback=_seconds("time to first token", "2"),
              help="Seconds to the first token the service level allows, at --percentile.")
@click.option("--slo-tpot", type=float, default=0.1, show_default=True,
              callback=_seconds("time per output token", "0.05"),
              help="Seconds per output token after the first the service level allows, at --percentile.")
@click.option("--percentile", type=click.IntRange(50, 99), default=90, show_default=True,
              help="Of each level's requests, the one the SLO is held to.")
@click.option("--save", is_flag=True, help="File each replica's result under its profile; gateways then admit at "
                                           "most that many requests at once to every replica of the profile.")
@click.option("--replica", "only", help="Measure only this replica (default: every ready one, in turn).")
@click.option("--gateway", "gateway_url", help="The gateway to send through [gateway.public_url, else "
                                               "gateway.listen, of --config].")
@click.option("--key-file", type=click.Path(dir_okay=False),
              help="A file holding an administrator's API key, yours alone (mode 0600); else $LLMGW_API_KEY. Its "
                   "limits hold the bench and its usage records it.")
@click.option("--key", hidden=True, expose_value=False, callback=lambda _ctx, _param, value: _no_key_option(value))
@click.option("--max-concurrency", type=click.IntRange(1, MAX_IN_FLIGHT), default=256, show_default=True,
              help="The most requests at once tried.")
@click.option("--samples", type=click.IntRange(3, 100_000), default=20, show_default=True,
              help="Requests measured at each level, at least (four times the level when that is more).")
@click.option("--max-tokens", type=click.IntRange(1, 1_000_000), default=128, show_default=True,
              help="Tokens each request asks for (all of them: ignore_eos).")
@click.option("--prompt-words", type=click.IntRange(1, 1_000_000), default=200, show_default=True,
              help="Words in each prompt, after a random start no prefix cache has seen.")
@click.option("--timeout", type=click.FloatRange(1, 3600), default=300, show_default=True,
              help="Seconds one request may take before it counts as failed.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per replica.")
@click.pass_obj
def bench(obj, model, slo_ttft, slo_tpot, percentile, save, only, gateway_url, key_file, max_concurrency, samples,
          max_tokens, prompt_words, timeout, as_json):
    """Ramp the requests at once sent to each replica of MODEL, through a gateway, until the service level
    breaks; report the last level that held, per replica. It loads each replica in turn: its users get
    slower answers meanwhile."""
    key = _api_key(key_file)
    gateway_url = (gateway_url or obj.config().public_url()).rstrip("/")
    chosen = _ready_replicas(obj.admin, model, only)
    _check_gateway(gateway_url)
    slo = ramp.SLO(slo_ttft, slo_tpot, percentile)
    click.echo(f"measuring {len(chosen)} replica(s) of {model} through {gateway_url}, one at a time, up to "
               f"{max_concurrency} requests at once, past any limit they have: people using {model} there get "
               f"slower answers meanwhile. SLO: TTFT p{percentile} {slo_ttft:g} s, TPOT p{percentile} "
               f"{slo_tpot * 1000:g} ms. Ctrl-C stops (nothing is saved).", err=True)
    result = []
    for replica in chosen:
        click.echo(printable(f"{replica['shard_id']} on {replica['node']} (profile {replica['profile'] or 'stale'}):"),
                   err=True)
        try:
            target = benchload.Target(gateway_url, key, model, replica["shard_id"], max_tokens, prompt_words, timeout)
            search = _ramp(target, slo, max_concurrency, samples)
        except ValueError as e:
            raise click.ClickException(f"--gateway: {e}") from None
        except benchload.Refused as e:
            raise click.ClickException(printable(e)) from None  # it quotes the gateway's answer
        click.echo(f"  {search.conclusion()}", err=True)
        result.append({"model": model, "replica": replica["shard_id"], "node": replica["node"],
                       "profile": replica["profile"], "max_in_flight": search.capacity, "held": _figures(search.held),
                       "conclusion": search.conclusion(),
                       "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot, "percentile": percentile}})
    if as_json:
        for row in result:
            click.echo(json.dumps(row))
    else:
        print_table(_rows_of(result, percentile))
    if save:
        _save(obj.admin, model, result, gateway_url)


def _save(admin, model: str, result: list[dict], gateway_url: str) -> None:
    """File the lowest result of each profile's replicas under that profile."""
    by_profile: dict[str, dict] = {}
    for row in result:
        if row["profile"] is None:
            click.echo(f"not saved for {printable(row['replica'])}: it runs a profile edited since it started; measure a "
                       "replica started from the profile as it is", err=True)
        elif row["max_in_flight"] == 0:
            click.echo(f"not saved for {printable(row['replica'])}: not even one request at a time held the SLO, and a limit "
                       "of 0 would refuse everyone. Loosen the SLO or give the model a larger profile", err=True)
        elif row["profile"] not in by_profile or row["max_in_flight"] < by_profile[row["profile"]]["max_in_flight"]:
            by_profile[row["profile"]] = row
    for profile, row in sorted(by_profile.items()):
        body = {"replica": row["replica"], "max_in_flight": row["max_in_flight"], "gateway": gateway_url,
                "slo_ttft_s": row["slo"]["ttft_s"], "slo_tpot_s": row["slo"]["tpot_s"],
                "percentile": row["slo"]["percentile"],
                **{k: v for k, v in row["held"].items() if v is not None}}
        saved = admin.call("PUT", f"/api/v1/models/{segment(model)}/capacity", body)
        click.echo(f"saved: {model} on profile {profile} takes {saved['max_in_flight']} requests at once; gateways "
                   "hold each of its replicas to that from the controller's next snapshot", err=True)


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per measurement.")
@click.pass_context
def capacity(ctx, as_json):
    """What `llmgw ctl bench --save` measured: requests at once each model's profile takes."""
    if ctx.invoked_subcommand is not None:
        return
    rows = ctx.obj.admin.call("GET", "/api/v1/capacity")["capacities"]
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    if not rows:
        click.echo("nothing has been measured; `llmgw ctl bench MODEL --save` measures a model's replicas", err=True)
        return
    table = [("MODEL", "PROFILE", "AT ONCE", "TTFT", "TPOT", "REQ/S", "TOK/S", "SLO", "MEASURED", "USED")]
    for r in rows:
        slo = (f"p{r['percentile']} {r['slo_ttft_s']:g} s / {r['slo_tpot_s'] * 1000:g} ms"
               if {"percentile", "slo_ttft_s", "slo_tpot_s"} <= set(r) else "-")
        table.append((r["model"], r["profile"], r["max_in_flight"], _s(r.get("ttft_s")), _ms(r.get("tpot_s")),
                      _n(r.get("requests_per_s"), 2), _n(r.get("tokens_per_s"), 0), slo,
                      time.strftime("%Y-%m-%d %H:%M", time.gmtime(r["measured_at"])),
                      "yes" if r["current"] else "no: the profile changed since; measure again"))
    print_table(table)


@capacity.command("forget")
@click.argument("model")
@click.option("--profile", help="Only this profile's measurement (default: every one of MODEL's).")
@click.pass_obj
def capacity_forget(obj, model, profile):
    """Drop what was measured of MODEL: its replicas are admitted as if never measured."""
    result = obj.admin.call("DELETE", f"/api/v1/models/{segment(model)}/capacity"
                            + (f"?{urllib.parse.urlencode({'profile': profile})}" if profile else ""))
    click.echo(f"forgot {result['forgotten']} measurement(s) of {model}; gateways stop holding its replicas to them "
               "from the controller's next snapshot", err=True)
