"""The mirror's two HTTP faces: files for nodes (read-only), and a management API for operators.

Files (`mirror.listen`): GET and HEAD only, anything else 405. `/MODEL/VERSION/`
answers a JSON manifest of the version's files (so a sharded model is fetched
as a set), and with `?format=links` the same files as an HTML page of links
with their sha256 (`FILE#sha256=...`), the page `pip --find-links` reads, so a
node installs an engine's wheels from the mirror; `/MODEL/VERSION/FILE` the file with Range support (206), so an
interrupted download resumes, and its sha256 in `X-Llmgw-Sha256`, so the
node can check what it got. Paths are matched against strict names: nothing
outside the directory can be reached.

Management (`mirror.api_listen`), for this machine and the addresses in
`mirror.api_allow` only (403), only by its own address or a name in
`mirror.api_names` in `Host` (421: a web page on this machine could otherwise
reach it by DNS rebinding), and only with its token (401). Every local account
reaches loopback, and before the token any of them could delete a version
nodes fetch, fill the disk, or delete one and fetch other bytes under its name.
The token (`mirror.token_file`, 0600) is read by `llmgw mirror` and the mirror
page. Listings need it too: they name sources, local paths and failure reasons
that the file port never tells. Only the health check is open, for `llmgw up`
and monitors to wait on.

    GET    /api/v1/models                    held, arriving (with bytes), failed (with reasons)
    POST   /api/v1/models                    {"source", "model", "version", "anyway"} -> 202 (a source
                                             `convert:MODEL/VERSION` converts a held GGUF); a source
                                             the mirror may not read -> 400, logged (llmgw/mirror/fetch.py);
                                             too many arriving -> 429, too little disk -> 507
    GET    /api/v1/models/MODEL/VERSION      present | fetching | failed | absent
    DELETE /api/v1/models/MODEL/VERSION      refused (409) while it downloads
    GET    /api/v1/health                    up, and able to read its directory (no token)
"""

from __future__ import annotations

import dataclasses
import html
import json
import logging
import os
import pwd
import urllib.parse

from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound
from werkzeug.routing import Map, Rule
from werkzeug.utils import send_file
from werkzeug.wrappers import Request, Response
from werkzeug.wsgi import FileWrapper

from llmgw import apiguard, settings
from llmgw.addresses import AddressList
from llmgw.apiguard import HostCheck
from llmgw.mirror.fetch import CONVERT, Manager, SourceRefused
from llmgw.mirror.store import NAME, MirrorDir, MirrorError
from llmgw.weights import SHA_HEADER

READ_SIZE = 1 << 20

log = logging.getLogger("llmgw.mirror")


def _json(body, status: int = 200) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json")


def _large_reads(file, buffer_size: int = 8192):
    return FileWrapper(file, READ_SIZE)


def files_app(store: MirrorDir, base_url: str, collector: "MirrorCollector | None" = None):
    """The read-only file server; COLLECTOR, when given, counts the bytes it sends."""

    def app(environ, start_response):
        request = Request(environ)
        try:
            if request.method not in ("GET", "HEAD"):
                raise MethodNotAllowed(["GET", "HEAD"], "the mirror is read-only")
            parts = request.path.strip("/").split("/")
            if len(parts) < 2 or len(parts) > 3 or not all(NAME.match(p) and ".." not in p for p in parts):
                raise NotFound()
            model, version = parts[0], parts[1]
            if not store.exists(model, version):
                raise NotFound()
            if len(parts) == 2:
                if not request.path.endswith("/"):
                    raise NotFound()
                if request.args.get("format") == "links":
                    response = _links(store, model, version)
                else:
                    response = _json(store.manifest(model, version, base_url))
            else:
                path = store.file_path(model, version, parts[2])
                # werkzeug reads files 8 KiB at a time by default; weights are gigabytes.
                environ["wsgi.file_wrapper"] = _large_reads
                try:
                    response = send_file(path, environ, mimetype="application/octet-stream", conditional=True,
                                         max_age=None)
                except FileNotFoundError:
                    raise NotFound() from None
                digest = store.sha256(model, version, parts[2])
                if digest:
                    response.headers[SHA_HEADER] = digest
                if collector is not None and request.method == "GET" and response.content_length:
                    collector.served += response.content_length
        except HTTPException as e:
            response = e.get_response(environ)
        return response(environ, start_response)

    return app


def _links(store: MirrorDir, model: str, version: str) -> Response:
    """A version's files as the HTML page of links pip reads (`--find-links`), each with its sha256. A file
    copied in by hand may have any name: each is quoted and escaped."""
    rows = "".join(f'<a href="{html.escape(urllib.parse.quote(f["name"]))}#sha256='
                   f'{store.sha256(model, version, f["name"])}">{html.escape(f["name"])}</a><br>\n'
                   for f in store.files(model, version))
    return Response(f"<!DOCTYPE html>\n<html><head><title>{model}/{version}</title></head><body>\n{rows}"
                    "</body></html>\n", mimetype="text/html")


class Allowed:
    """This machine (loopback), plus the addresses and networks it is told (`mirror.api_allow`)."""

    def __init__(self, allow: list[str]):
        self.listed = AddressList(["127.0.0.0/8", "::1", *allow], "mirror.api_allow")

    def __call__(self, address: str) -> bool:
        return self.listed.contains(address)


@dataclasses.dataclass(frozen=True)
class Access:
    """Who the management API answers: ALLOWED addresses, by a Host HOSTS answers to, with TOKEN (kept in
    TOKEN_FILE, which only OWNER may read)."""

    allowed: Allowed
    hosts: HostCheck
    token: str
    token_file: str
    owner: str

    @classmethod
    def from_config(cls, cfg: settings.Config) -> "Access":
        """The allowed addresses and names from CFG, and the token, made on the first start."""
        path = apiguard.mirror_token_path(cfg)
        token = apiguard.ensure_token(path)
        uid = os.stat(path).st_uid
        try:
            owner = pwd.getpwuid(uid).pw_name
        except KeyError:
            owner = f"uid {uid}"
        return cls(Allowed(cfg["mirror.api_allow"]),
                   HostCheck(cfg["mirror.api_listen"], cfg["mirror.api_names"], "mirror.api_names"),
                   token, path, owner)

    def refusal(self, authorization: str | None) -> str | None:
        """None when AUTHORIZATION (the request's header) carries the token; else the sentence that refuses it."""
        if apiguard.bearer_matches(authorization, self.token):
            return None
        where = f"{self.token_file} (mode 0600: only {self.owner} may read it)"
        if authorization:
            return (f"that is not this mirror's token: use the one in {where}; it changes when the file is removed "
                    "and the mirror restarts")
        return (f"the mirror's management API wants its token: send Authorization: Bearer TOKEN. The mirror keeps it "
                f"in {where}, where llmgw mirror and the mirror page on its machine read it; elsewhere, set "
                "mirror.token_file to a copy of it")


HEALTH = "/api/v1/health"
API = Map([
    Rule(HEALTH, endpoint="health", methods=["GET"]),
    Rule("/api/v1/models", endpoint="listing", methods=["GET"]),
    Rule("/api/v1/models", endpoint="fetch", methods=["POST"]),
    Rule("/api/v1/models/<model>/<version>", endpoint="status", methods=["GET"]),
    Rule("/api/v1/models/<model>/<version>", endpoint="remove", methods=["DELETE"]),
])


def api_app(manager: Manager, base_url: str, access: Access):
    """The management API, for whom ACCESS lets in."""

    def app(environ, start_response):
        request = Request(environ)
        if not access.allowed(request.remote_addr or ""):
            response = _json({"error": "this mirror is managed from its own machine and the addresses in "
                                       "mirror.api_allow only"}, 403)
            return response(environ, start_response)
        # The Host first: a request by a name that is not ours is refused whatever it carries, a right token too.
        refused = access.hosts.refusal(request.headers.get("Host"))
        if refused:
            return _json({"error": refused}, 421)(environ, start_response)
        unauthorised = request.path != HEALTH and access.refusal(request.headers.get("Authorization"))
        if unauthorised:
            response = _json({"error": unauthorised}, 401)
            response.headers["WWW-Authenticate"] = 'Bearer realm="llmgw mirror"'
            return response(environ, start_response)
        try:
            endpoint, args = API.bind_to_environ(environ).match()
            response = _handle(manager, base_url, endpoint, args, request)
        except SourceRefused as e:
            log.warning("refused a fetch asked by %s: %s", request.remote_addr, e)
            response = _json({"error": str(e)}, 400)
        except MirrorError as e:
            response = _json({"error": str(e)}, e.status)
        except HTTPException as e:
            response = _json({"error": e.description or e.name}, e.code or 500)
        return response(environ, start_response)

    return app


def _handle(manager: Manager, base_url: str, endpoint: str, args: dict, request: Request) -> Response:
    if endpoint == "health":
        ok = manager.store.readable()
        return _json({"ok": ok, "dir": manager.store.root, "base_url": base_url}, 200 if ok else 503)
    if endpoint == "listing":
        return _json({"base_url": base_url, **manager.listing()})
    if endpoint == "status":
        found = manager.status(args["model"], args["version"])
        if found["state"] == "present":
            found["url"] = f"{base_url}/{args['model']}/{args['version']}/"
        return _json(found, 404 if found["state"] == "absent" else 200)
    if endpoint == "remove":
        manager.remove(args["model"], args["version"])
        return _json({"removed": f"{args['model']}/{args['version']}"})
    body = apiguard.json_body(request)
    if not isinstance(body, dict) or not all(isinstance(body.get(k), str) for k in ("source", "model", "version")):
        raise MirrorError('send {"source": ..., "model": ..., "version": ...}')
    view = manager.fetch(body["source"], body["model"], body["version"], anyway=bool(body.get("anyway")))
    files = view["files"]
    # A conversion's one file is what it reads; what it writes is a folder, named by its directory.
    one = files[0]["name"] if len(files) == 1 and not body["source"].startswith(CONVERT) else ""
    return _json({**view, "url": f"{base_url}/{body['model']}/{body['version']}/{one}"}, 202)


class MirrorCollector:
    """The mirror as Prometheus series, read at each scrape: what it holds, what arrives, what failed,
    the free disk, and the bytes it has served."""

    def __init__(self, manager: Manager):
        self.manager = manager
        self.served = 0  # bytes of files sent to nodes (added by the file server)

    def collect(self):
        import shutil

        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        listing = self.manager.listing()
        yield GaugeMetricFamily("llmgw_mirror_versions", "Model versions held.", value=len(listing["held"]))
        yield GaugeMetricFamily("llmgw_mirror_held_bytes", "Bytes of the versions held.",
                                value=sum(v["bytes"] for v in listing["held"]))
        yield GaugeMetricFamily("llmgw_mirror_downloads", "Versions being fetched now.", value=len(listing["arriving"]))
        yield GaugeMetricFamily("llmgw_mirror_failed", "Fetches that failed and are not yet retried or removed.",
                                value=len(listing["failed"]))
        usage = shutil.disk_usage(self.manager.store.root)
        yield GaugeMetricFamily("llmgw_mirror_disk_free_bytes", "Free space on the mirror's disk.", value=usage.free)
        yield CounterMetricFamily("llmgw_mirror_served_bytes", "Bytes of files sent to nodes.", value=self.served)
