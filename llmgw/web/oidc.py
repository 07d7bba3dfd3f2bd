"""OpenID Connect with one identity provider, as the gateway's pages and `llmgw login` use it.

What the gateway asks of a provider, and checks of its answers:

- Discovery (`/.well-known/openid-configuration`), read when first needed and again after an hour. The
  document must name the configured issuer exactly, and its endpoints must be https (http only where the
  issuer itself is on loopback), so nobody between the two can send the gateway elsewhere.
- The authorization-code flow with PKCE (S256), `state` and `nonce`; the code is exchanged on the back
  channel with the client secret.
- The ID token: its signature against the provider's JWKS, with an asymmetric algorithm the provider lists
  (never `none`, never an HMAC keyed by the client secret), the JWKS fetched again, at most once a minute,
  when a token names a key id it does not hold (a provider rotating its keys); then `iss`, `aud` (and `azp`),
  `exp`, `iat` (not in the future, not older than TOKEN_AGE) and `nonce`, each within `auth.clock_skew`.
  The checks are Authlib's and joserfc's (the JOSE library Authlib itself uses), not our own.
- Groups and email from the ID token, or from the userinfo endpoint where the token lacks them (its `sub` must
  be the token's).
- The device authorization grant, for `llmgw login`: the gateway holds the device code and the client secret,
  and the CLI only a handle.

Every exchange is bounded (EXCHANGE_SECONDS, ANSWER_BYTES), on a connection of its own. Whatever fails is a
`Refused` whose message is the page's sentence; the detail goes to the log.

Imported by the pages (llmgw/web/oidcpages.py). Runs in gateway workers (gevent); one `Provider` per worker
per `[[auth.oidc]]` entry, whose caches are the worker's.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import time
import urllib.parse

from authlib.oidc.core import CodeIDToken
from joserfc import jwt
from joserfc.errors import InvalidKeyIdError, JoseError
from joserfc.jwk import KeySet

from llmgw import filemodes, settings
from llmgw.gateway import upstream
from llmgw.people.identities import MOST_GROUP, MOST_GROUPS, Claims

log = logging.getLogger("llmgw.oidc")

EXCHANGE_SECONDS = 10.0
ANSWER_BYTES = 1 << 20  # a discovery document, a key set or tokens are a few KiB
DISCOVERY_TTL = 3600.0
JWKS_REFRESH_EVERY = 60.0  # an unknown key id fetches the key set again, at most this often
TOKEN_AGE = 600.0  # an ID token just issued by the token endpoint is seconds old; older is a replay
SIGNING_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"


class Refused(Exception):
    """A sign-in that cannot go on; the message is the sentence for the person."""


class NoDeviceFlow(Refused):
    """The provider offers no device authorization: `llmgw login` signs in through the browser instead."""


class Pending(Exception):
    """A device sign-in the person has not finished; `slow_down` when the provider asked for longer waits."""

    def __init__(self, slow_down: bool = False):
        super().__init__("not yet")
        self.slow_down = slow_down


def read_client_secret(path: str) -> str:
    """The client secret in PATH (which the gateway's start refuses when others may read it)."""
    if not path:
        return ""
    filemodes.refuse_loose({path: filemodes.OTHERS})
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as e:
        raise settings.ConfigError(f"cannot read the identity provider's client secret {path}: {e.strerror}") from None


class Provider:
    def __init__(self, entry: dict, clock_skew: float):
        """ENTRY: an `[[auth.oidc]]` entry, as settings.validate_identity_providers fills it in."""
        self.entry = entry
        self.name, self.label = entry["name"], entry["label"]
        self.issuer = entry["issuer"]
        self.skew = clock_skew
        self.secret = read_client_secret(entry["client_secret_file"])
        self._meta: dict | None = None
        self._meta_at = 0.0
        self._keys: KeySet | None = None
        self._keys_at = 0.0
        loopback = urllib.parse.urlsplit(self.issuer).hostname in ("127.0.0.1", "::1", "localhost")
        self._schemes = ("https", "http") if loopback else ("https",)

    # --- what the provider says about itself ---------------------------------------------------------

    def metadata(self) -> dict:
        now = time.monotonic()
        if self._meta is None or now - self._meta_at > DISCOVERY_TTL:
            found = self._json("GET", self.issuer.rstrip("/") + "/.well-known/openid-configuration", "its discovery")
            if found.get("issuer") != self.issuer:
                log.error("identity provider %s: its discovery document names the issuer %r, not %r as configured",
                          self.name, str(found.get("issuer"))[:200], self.issuer)
                raise Refused(f"{self.label} is not set up here as it describes itself; an operator must check its "
                              "issuer (this gateway's log says what it answered).")
            for field in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
                self._endpoint(found, field, required=True)
            self._meta, self._meta_at = found, now
        return self._meta

    def _endpoint(self, meta: dict, field: str, required: bool = False) -> str | None:
        url = meta.get(field)
        if url is None and not required:
            return None
        if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in self._schemes:
            log.error("identity provider %s: %s is %r, not an %s URL", self.name, field, str(url)[:200],
                      " or ".join(self._schemes))
            raise Refused(f"{self.label} describes itself with an address this gateway will not use; an operator "
                          "must check it (this gateway's log says which).")
        return url

    def _key_set(self, refresh: bool = False) -> KeySet:
        now = time.monotonic()
        if self._keys is None or (refresh and now - self._keys_at >= JWKS_REFRESH_EVERY):
            url = self._endpoint(self.metadata(), "jwks_uri", required=True)
            try:
                self._keys = KeySet.import_key_set(self._json("GET", url, "its key set"))
            except (JoseError, ValueError, TypeError, KeyError) as e:
                log.error("identity provider %s: its key set at %s cannot be read: %s", self.name, url, e)
                raise Refused(f"{self.label}'s signing keys cannot be read; an operator must check it.") from None
            self._keys_at = now
        return self._keys

    # --- the browser's sign-in ----------------------------------------------------------------------

    def authorize_url(self, redirect_uri: str, state: str, nonce: str, challenge: str) -> str:
        query = urllib.parse.urlencode({
            "client_id": self.entry["client_id"], "response_type": "code", "scope": " ".join(self.entry["scopes"]),
            "redirect_uri": redirect_uri, "state": state, "nonce": nonce, "code_challenge": challenge,
            "code_challenge_method": "S256"})
        endpoint = self.metadata()["authorization_endpoint"]
        return endpoint + ("&" if "?" in endpoint else "?") + query

    def redeem_code(self, code: str, redirect_uri: str, verifier: str) -> dict:
        """The tokens for CODE."""
        return self._token({"grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
                            "code_verifier": verifier})

    def end_session_url(self, after: str) -> str | None:
        """Where a person signs out of the provider too, coming back to AFTER; None where it has no such page."""
        try:
            endpoint = self._endpoint(self.metadata(), "end_session_endpoint")
        except Refused:
            return None
        if endpoint is None:
            return None
        query = urllib.parse.urlencode({"client_id": self.entry["client_id"], "post_logout_redirect_uri": after})
        return endpoint + ("&" if "?" in endpoint else "?") + query

    # --- `llmgw login`'s device sign-in -------------------------------------------------------------

    def start_device(self) -> dict:
        """The provider's device authorization: device_code, user_code, verification_uri (and its _complete
        form where given), expires_in, interval."""
        url = self._endpoint(self.metadata(), "device_authorization_endpoint")
        if url is None:
            raise NoDeviceFlow(f"{self.label} does not offer sign-in from a device; llmgw login --browser signs in "
                               "through a browser on this computer instead.")
        form = self._client_form({"scope": " ".join(self.entry["scopes"])})
        status, body = self._exchange("POST", url, "its device authorization", form, self._basic(form))
        answer = _json_object(body) or {}
        if status == 400:
            # Listed for the provider, refused to this client (Keycloak lists it realm-wide; providers say so as
            # unauthorized_client or invalid_request): the browser serves as well. A 401 is a wrong secret.
            log.info("identity provider %s: the device grant is refused to client %s: %r %r", self.name,
                     self.entry["client_id"], str(answer.get("error"))[:60],
                     str(answer.get("error_description"))[:200])
            raise NoDeviceFlow(f"{self.label} does not let this gateway sign in from a device; llmgw login signs "
                               "in through a browser on this computer instead.")
        if status != 200:
            log.error("identity provider %s: its device authorization answered %s: %r", self.name, status, body[:300])
            raise Refused(f"{self.label} answered with something unreadable; an operator will find what in this "
                          "gateway's log.")
        if not all(isinstance(answer.get(k), str) for k in ("device_code", "user_code", "verification_uri")):
            log.error("identity provider %s: its device authorization answered without a device code: %s",
                      self.name, str(answer)[:300])
            raise Refused(f"{self.label} answered the device sign-in with something unreadable.")
        return answer

    def poll_device(self, device_code: str) -> dict:
        """The tokens once the person has confirmed; raises Pending until then, Refused when they refused or
        the code expired."""
        return self._token({"grant_type": DEVICE_GRANT, "device_code": device_code})

    # --- the ID token -------------------------------------------------------------------------------

    def claims(self, tokens: dict, nonce: str | None) -> Claims:
        """Who TOKENS (the token endpoint's answer) say signed in, every check made. NONCE: the one the
        browser's sign-in sent (the device grant has none)."""
        id_token = tokens.get("id_token")
        if not isinstance(id_token, str):
            log.warning("identity provider %s: the token endpoint gave no ID token (scopes %s)", self.name,
                        self.entry["scopes"])
            raise Refused(f"{self.label} gave no ID token; an operator must check that the scopes include openid.")
        found = self._verified(id_token, nonce, tokens.get("access_token"))
        email, groups = found.get(self.entry["email_claim"]), found.get(self.entry["groups_claim"])
        verified = found.get("email_verified") is True
        if (email is None or groups is None) and isinstance(tokens.get("access_token"), str):
            more = self._userinfo(tokens["access_token"], found["sub"])
            if email is None:  # the address and whether it is verified come from the same answer
                email, verified = more.get(self.entry["email_claim"]), more.get("email_verified") is True
            groups = groups if groups is not None else more.get(self.entry["groups_claim"])
        if not isinstance(email, str) or not 0 < len(email) <= 320:
            log.warning("identity provider %s: no usable %s claim for %r", self.name, self.entry["email_claim"],
                        found["sub"])
            raise Refused(f"{self.label} did not say your email address ({self.entry['email_claim']}); an operator "
                          "must check which scopes and claims it is asked for.")
        if groups is not None and (not isinstance(groups, list) or len(groups) > MOST_GROUPS
                                   or not all(isinstance(g, str) for g in groups)):
            log.warning("identity provider %s: its %s claim for %r is not a list of names", self.name,
                        self.entry["groups_claim"], found["sub"])
            raise Refused(f"{self.label} said your groups in a form this gateway cannot read; ask an operator.")
        # A name longer than any a map holds is left out rather than cut (cut, it could become one that is mapped).
        verified = verified or self.entry["trust_email"]
        return Claims(self.name, found["sub"], email, verified,
                      None if groups is None else frozenset(g for g in groups if len(g) <= MOST_GROUP))

    def _verified(self, id_token: str, nonce: str | None, access_token) -> dict:
        offered = self.metadata().get("id_token_signing_alg_values_supported") or ["RS256"]
        algorithms = [a for a in offered if a in SIGNING_ALGORITHMS] if isinstance(offered, list) else []
        if not algorithms:  # joserfc would take its defaults, HMAC among them
            log.error("identity provider %s: it signs ID tokens with none of %s (it lists %r)", self.name,
                      ", ".join(SIGNING_ALGORITHMS), str(offered)[:200])
            raise Refused(f"{self.label} signs in a way this gateway does not accept; an operator must check it.")
        try:
            try:
                token = jwt.decode(id_token, self._key_set(), algorithms=algorithms)
            except InvalidKeyIdError:
                token = jwt.decode(id_token, self._key_set(refresh=True), algorithms=algorithms)
            params = {"client_id": self.entry["client_id"]}
            if nonce is not None:
                params["nonce"] = nonce
            if isinstance(access_token, str):
                params["access_token"] = access_token
            checked = CodeIDToken(token.claims, token.header, params=params, options={
                "iss": {"essential": True, "value": self.issuer},
                "aud": {"essential": True, "value": self.entry["client_id"]},
                "sub": {"essential": True}})
            checked.validate(now=int(time.time()), leeway=int(self.skew))
            if nonce is not None and checked.get("nonce") is None:
                raise JoseError("the token carries no nonce")
            if checked["iat"] < time.time() - TOKEN_AGE - self.skew:
                raise JoseError(f"issued at {checked['iat']}, more than {TOKEN_AGE:g} s ago")
        except (JoseError, ValueError, TypeError) as e:
            log.warning("identity provider %s: an ID token was refused: %s: %s", self.name, type(e).__name__, e)
            raise Refused(f"{self.label}'s answer could not be trusted ({_why(e)}), so you are not signed in. Try "
                          "again; if it happens again, an operator will find the reason in this gateway's log.") from None
        claims = dict(checked)
        if not isinstance(claims.get("sub"), str) or not 0 < len(claims["sub"]) <= 255:
            raise Refused(f"{self.label} named you with an identifier this gateway cannot keep.")
        return claims

    def _userinfo(self, access_token: str, subject: str) -> dict:
        url = self._endpoint(self.metadata(), "userinfo_endpoint")
        if url is None:
            return {}
        found = self._json("GET", url, "its userinfo", headers=b"Authorization: Bearer " + access_token.encode()
                           + b"\r\n")
        if found.get("sub") != subject:
            log.warning("identity provider %s: userinfo answered for %r, not %r", self.name,
                        str(found.get("sub"))[:100], subject)
            return {}
        return found

    # --- the exchanges ------------------------------------------------------------------------------

    def _client_form(self, fields: dict) -> dict:
        """FIELDS with the client's credentials where the provider takes them in the form (client_secret_post);
        otherwise `_token` sends them as HTTP Basic."""
        fields = {**fields, "client_id": self.entry["client_id"]}
        methods = (self._meta or {}).get("token_endpoint_auth_methods_supported") or ["client_secret_basic"]
        if self.secret and "client_secret_basic" not in methods and "client_secret_post" in methods:
            fields["client_secret"] = self.secret
        return fields

    def _basic(self, fields: dict) -> bytes:
        if not self.secret or "client_secret" in fields:
            return b""
        quote = lambda v: urllib.parse.quote(v, safe="")  # noqa: E731 (RFC 6749 2.3.1: form-encoded first)
        pair = f"{quote(self.entry['client_id'])}:{quote(self.secret)}".encode()
        return b"Authorization: Basic " + base64.b64encode(pair) + b"\r\n"

    def _token(self, fields: dict) -> dict:
        url = self._endpoint(self.metadata(), "token_endpoint", required=True)
        form = self._client_form(fields)
        status, body = self._exchange("POST", url, "its token endpoint", form, self._basic(form))
        answer = _json_object(body)
        if status == 200 and answer is not None:
            return answer
        error = (answer or {}).get("error")
        if error in ("authorization_pending", "slow_down"):
            raise Pending(slow_down=error == "slow_down")
        text = str((answer or {}).get("error_description") or "")[:200]
        log.warning("identity provider %s: its token endpoint answered %s: %r %r", self.name, status,
                    str(error)[:60], text)
        if error == "access_denied":
            raise Refused(f"The sign-in was declined at {self.label}.")
        if error == "expired_token":
            raise Refused(f"The sign-in code expired before it was confirmed at {self.label}; start again.")
        if error == "invalid_grant":
            raise Refused(f"{self.label} did not accept this sign-in's code (used already, or too old); start again.")
        raise Refused(f"{self.label} refused to finish the sign-in; an operator will find the reason in this "
                      "gateway's log.")

    def _json(self, method: str, url: str, what: str, form: dict | None = None, headers: bytes = b"") -> dict:
        if form is not None:
            headers += self._basic(form)
        status, body = self._exchange(method, url, what, form, headers)
        answer = _json_object(body)
        if status != 200 or answer is None:
            log.error("identity provider %s: %s at %s answered %s: %r", self.name, what, url, status, body[:300])
            raise Refused(f"{self.label} answered with something unreadable; an operator will find what in this "
                          "gateway's log.")
        return answer

    def _exchange(self, method: str, url: str, what: str, form: dict | None, headers: bytes) -> tuple[int, bytes]:
        body = urllib.parse.urlencode(form).encode() if form is not None else b""
        try:
            status, _, answer = upstream.fetch(url, method=method, body=body, seconds=EXCHANGE_SECONDS,
                                               most_bytes=ANSWER_BYTES, headers=b"Accept: application/json\r\n"
                                               + headers, content_type=b"application/x-www-form-urlencoded")
            return status, answer
        except (upstream.UpstreamError, upstream.TooLarge, ssl.SSLError, OSError, ValueError) as e:
            log.error("identity provider %s: %s at %s failed: %s", self.name, what, url, e)
            raise Refused(f"{self.label} cannot be reached from this gateway just now; try again in a minute. "
                          "(An operator will find why in this gateway's log.)") from None


def _json_object(body: bytes) -> dict | None:
    try:
        found = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return found if isinstance(found, dict) else None


def _why(e: Exception) -> str:
    """What was wrong with a refused ID token, in a few words for the page."""
    text = str(e).lower()
    for words, said in (("signature", "its signature is wrong"), ("kid", "it is signed with a key it does not publish"),
                        ("expired", "it has expired"), ("nonce", "it does not belong to this sign-in"),
                        ("aud", "it was issued to another client"), ("iss", "it was issued by someone else"),
                        ("iat", "its time is wrong"), ("issued", "its time is wrong"),
                        ("algorithm", "it is signed in a way this gateway does not accept")):
        if words in text or words in type(e).__name__.lower():
            return said
    return "it is not a valid ID token"
