"""The OpenID provider the sign-in tests use (tests/oidcprovider.py) does what a real one does: discovery, its own
login form, the code flow with PKCE required, an ID token signed with a key of its JWKS carrying the person's
email and groups, and groups read again at the next sign-in. Authlib and joserfc (its JOSE library), what the
gateway signs in with, check the token."""

from __future__ import annotations

import secrets
import urllib.parse

import pytest
import requests
from authlib.common.security import generate_token
from authlib.oauth2.rfc7636 import create_s256_code_challenge
from joserfc import jwt
from joserfc.jwk import KeySet

from tests.oidcprovider import OidcProvider

REDIRECT = "http://127.0.0.1:9/callback"  # never reached: the test reads the code from the redirect itself


@pytest.fixture
def provider(tmp_path):
    p = OidcProvider(tmp_path, {"ada": {"email": "ada@example.org", "email_verified": True, "name": "Ada",
                                        "groups": ["ml-team"]}},
                     [{"client_id": "llmgw", "client_secret": "a-client-secret", "redirect_uris": [REDIRECT],
                       "grant_types": ["authorization_code"], "response_types": ["code"]}])
    yield p
    p.stop()


def sign_in(provider, login: str, challenge: str | None) -> tuple[str, str]:
    """Go through the provider's own login form as LOGIN; where it sends the browser back to, and the state."""
    found = requests.get(provider.issuer + "/.well-known/openid-configuration", timeout=10).json()
    state, nonce = generate_token(20), generate_token(20)
    params = {"client_id": "llmgw", "response_type": "code", "scope": "openid email profile groups",
              "redirect_uri": REDIRECT, "state": state, "nonce": nonce}
    if challenge:
        params.update(code_challenge=challenge, code_challenge_method="S256")
    return provider.sign_in(found["authorization_endpoint"] + "?" + urllib.parse.urlencode(params), login,
                            REDIRECT), state


def test_the_provider_signs_a_person_in_with_pkce_and_says_their_groups_in_a_signed_id_token(provider):
    found = requests.get(provider.issuer + "/.well-known/openid-configuration", timeout=10).json()
    assert found["issuer"] == provider.issuer and found["code_challenge_methods_supported"] == ["S256"]
    assert "device_authorization_endpoint" in found and "end_session_endpoint" in found

    # Without PKCE it refuses, as the providers organisations run can be set to.
    refused, _ = sign_in(provider, "ada", None)
    assert "PKCE" in urllib.parse.unquote(refused)

    verifier = secrets.token_urlsafe(48)
    done, state = sign_in(provider, "ada", create_s256_code_challenge(verifier))
    back = urllib.parse.parse_qs(urllib.parse.urlsplit(done).query)
    assert back["state"] == [state] and back["code"]
    tokens = requests.post(found["token_endpoint"], auth=("llmgw", "a-client-secret"), timeout=10, data={
        "grant_type": "authorization_code", "code": back["code"][0], "redirect_uri": REDIRECT,
        "code_verifier": verifier}).json()
    keys = KeySet.import_key_set(requests.get(found["jwks_uri"], timeout=10).json())
    claims = jwt.decode(tokens["id_token"], keys).claims
    jwt.JWTClaimsRegistry(iss={"essential": True, "value": provider.issuer},
                          aud={"essential": True, "value": "llmgw"}).validate(claims)
    assert claims["email"] == "ada@example.org" and claims["email_verified"] is True
    assert claims["groups"] == ["ml-team"]

    # Groups are read again at the next sign-in.
    provider.set_account("ada", groups=["ml-team", "llmgw-admins"])
    verifier = secrets.token_urlsafe(48)
    done, _ = sign_in(provider, "ada", create_s256_code_challenge(verifier))
    code = urllib.parse.parse_qs(urllib.parse.urlsplit(done).query)["code"][0]
    tokens = requests.post(found["token_endpoint"], auth=("llmgw", "a-client-secret"), timeout=10, data={
        "grant_type": "authorization_code", "code": code, "redirect_uri": REDIRECT, "code_verifier": verifier}).json()
    assert jwt.decode(tokens["id_token"], keys).claims["groups"] == ["ml-team", "llmgw-admins"]
