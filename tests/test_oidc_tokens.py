"""An ID token the gateway cannot trust signs nobody in, with a page that says so and a log line that says why
(issue 31): tampered, issued to another client, expired, without the sign-in's nonce, or signed with a key the
provider does not publish (after the key set is fetched again, as a provider rotating its keys needs).

Each token but the forged one comes from the real provider (npm's oidc-provider); the test stands between
the provider's token endpoint and the gateway, as someone on that path would, and hands the gateway what it
chose."""

from __future__ import annotations

import base64
import json
import logging
import secrets
import time
import types
import urllib.parse

import pytest
import requests
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

from llmgw.web import oidc
from tests.oidcprovider import OidcProvider
from tests.test_oidc_signin import CALLBACK, gateway

ELSEWHERE = "http://127.0.0.1:9/cb"  # a redirect never followed: the test reads the code from it


@pytest.fixture(scope="module")
def provider(tmp_path_factory):
    client = {"client_secret": "a-client-secret", "grant_types": ["authorization_code"], "response_types": ["code"]}
    p = OidcProvider(tmp_path_factory.mktemp("oidc"), {
        "ada": {"email": "ada@example.org", "email_verified": True, "groups": []}},
        [{**client, "client_id": "llmgw", "redirect_uris": [CALLBACK, ELSEWHERE]},
         {**client, "client_id": "other-app", "redirect_uris": [ELSEWHERE]}])
    yield p
    p.stop()


def real_tokens(provider, client_id: str, nonce: str | None) -> dict:
    """Tokens the provider issues to CLIENT_ID for ada, with NONCE (None: the request had none)."""
    found = requests.get(provider.issuer + "/.well-known/openid-configuration", timeout=10).json()
    verifier = secrets.token_urlsafe(48)
    params = {"client_id": client_id, "response_type": "code", "scope": "openid email", "redirect_uri": ELSEWHERE,
              "state": "s", "code_challenge": create_s256_code_challenge(verifier), "code_challenge_method": "S256",
              **({"nonce": nonce} if nonce else {})}
    back = provider.sign_in(found["authorization_endpoint"] + "?" + urllib.parse.urlencode(params), "ada", ELSEWHERE)
    code = urllib.parse.parse_qs(urllib.parse.urlsplit(back).query)["code"][0]
    return requests.post(found["token_endpoint"], auth=(client_id, "a-client-secret"), timeout=10, data={
        "grant_type": "authorization_code", "code": code, "redirect_uri": ELSEWHERE, "code_verifier": verifier}).json()


@pytest.fixture
def signing_in(tmp_path, provider, monkeypatch, caplog):
    """A gateway, and a function that begins a sign-in at it, hands its callback the tokens MAKE(nonce) returns
    in place of the provider's, and gives the page it answered."""
    app, engine = gateway(tmp_path, provider, oidc_approve_domains=["example.org"])
    corp = app.pages.extensions["llmgw"].providers["corp"]
    caplog.set_level(logging.INFO, logger="llmgw.oidc")

    def attempt(make):
        client = app.pages.test_client()
        begun = urllib.parse.parse_qs(urllib.parse.urlsplit(client.get("/login/oidc/corp").headers["Location"]).query)
        tokens = make(begun["nonce"][0])
        monkeypatch.setattr(corp, "redeem_code", lambda code, redirect_uri, verifier: tokens)
        answer = client.get(f"/login/oidc/corp/callback?code=anything&state={begun['state'][0]}")
        answer.signed_in = client.get("/account").status_code == 200
        return answer

    attempt.corp = corp
    return attempt


def refused(answer, words: str) -> None:
    assert answer.status_code == 400 and not answer.signed_in, answer.data
    text = answer.data.decode()
    assert "Not signed in" in text and f"could not be trusted ({words})" in text, text


def test_a_genuine_token_signs_in(signing_in, provider):
    answer = signing_in(lambda nonce: real_tokens(provider, "llmgw", nonce))
    assert answer.status_code == 302 and answer.signed_in


def test_a_tampered_token_is_refused(signing_in, provider, caplog):
    def tampered(nonce):
        tokens = real_tokens(provider, "llmgw", nonce)
        head, body, signature = tokens["id_token"].split(".")
        claims = _b64d(body)
        claims["email"] = "root@example.org"
        tokens["id_token"] = ".".join((head, _b64e(json.dumps(claims).encode()), signature))
        return tokens

    refused(signing_in(tampered), "its signature is wrong")
    assert "an ID token was refused: BadSignatureError" in caplog.text


def test_a_token_issued_to_another_client_is_refused(signing_in, provider, caplog):
    refused(signing_in(lambda nonce: real_tokens(provider, "other-app", nonce)), "it was issued to another client")
    assert "an ID token was refused: InvalidClaimError" in caplog.text and "aud" in caplog.text


def test_an_expired_token_is_refused(signing_in, provider, monkeypatch, caplog):
    tokens = real_tokens(provider, "llmgw", None)
    lifetime = jwt.decode(tokens["id_token"], _keys(provider)).claims
    later = lifetime["exp"] + 300 - time.time()  # past exp and the two minutes' skew allowed

    def expired(nonce):
        made = real_tokens(provider, "llmgw", nonce)
        # The ID token's checks, alone, see a clock past its expiry.
        monkeypatch.setattr(oidc, "time", types.SimpleNamespace(time=lambda: time.time() + later,
                                                                monotonic=time.monotonic))
        return made

    refused(signing_in(expired), "it has expired")
    assert "ExpiredTokenError" in caplog.text


def test_a_token_without_the_sign_ins_nonce_is_refused(signing_in, provider, caplog):
    refused(signing_in(lambda nonce: real_tokens(provider, "llmgw", None)), "it does not belong to this sign-in")
    refused(signing_in(lambda nonce: real_tokens(provider, "llmgw", "another-nonce")),
            "it does not belong to this sign-in")
    assert "nonce" in caplog.text


def test_a_key_the_provider_does_not_publish_is_refused_after_the_key_set_is_read_again(signing_in, provider,
                                                                                        caplog):
    forger = RSAKey.generate_key(2048, {"kid": "not-published", "alg": "RS256"})
    fetched = []
    real = signing_in.corp._key_set
    signing_in.corp._key_set = lambda refresh=False: fetched.append(refresh) or real(refresh)

    def forged(nonce):
        now = int(time.time())
        claims = {"iss": provider.issuer, "aud": "llmgw", "sub": "ada", "email": "root@example.org",
                  "email_verified": True, "iat": now, "exp": now + 600, "nonce": nonce}
        return {"id_token": jwt.encode({"alg": "RS256", "kid": "not-published"}, claims, forger)}

    refused(signing_in(forged), "it is signed with a key it does not publish")
    assert fetched == [False, True]
    assert "InvalidKeyIdError" in caplog.text


def _keys(provider):
    found = requests.get(provider.issuer + "/.well-known/openid-configuration", timeout=10).json()
    return KeySet.import_key_set(requests.get(found["jwks_uri"], timeout=10).json())


def _b64d(text: str) -> dict:
    return json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))


def _b64e(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def test_a_provider_that_lists_only_hmac_is_refused_before_any_token_is_read(signing_in, provider, caplog):
    signing_in.corp.metadata()["id_token_signing_alg_values_supported"] = ["HS256"]
    try:
        answer = signing_in(lambda nonce: real_tokens(provider, "llmgw", nonce))
    finally:
        signing_in.corp.metadata()["id_token_signing_alg_values_supported"] = ["RS256"]
    assert answer.status_code == 400 and not answer.signed_in
    assert b"signs in a way this gateway does not accept" in answer.data
    assert "it signs ID tokens with none of" in caplog.text
