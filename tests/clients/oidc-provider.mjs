// A real OpenID provider for the sign-in tests: npm's oidc-provider (OpenID-certified), on a loopback port.
//
//   node oidc-provider.mjs SETUP.json
//
// SETUP.json: {"clients": [oidc-provider client metadata], "accounts": "ACCOUNTS.json"}. ACCOUNTS.json maps a
// login name to its claims ({"email", "email_verified", "name", "groups"}); it is read again at each sign-in,
// so a test changes a person's groups between two sign-ins by writing the file. The provider listens on a
// free port, then prints its issuer URL as the first line for the test to read.
//
// As a provider is usually set up: PKCE required (S256), the code flow, the device flow for `llmgw login`,
// RP-initiated logout, and groups in the ID token. Its own login form (devInteractions) takes any password;
// a consent screen is skipped (every client here is first-party).

import { generateKeyPairSync } from "node:crypto";
import { readFileSync } from "node:fs";
import http from "node:http";

import Provider from "oidc-provider";

const setup = JSON.parse(readFileSync(process.argv[2], "utf8"));
const readAccounts = () => JSON.parse(readFileSync(setup.accounts, "utf8"));

const { privateKey } = generateKeyPairSync("rsa", { modulusLength: 2048 });
const jwk = { ...privateKey.export({ format: "jwk" }), kid: "test-key-1", use: "sig", alg: "RS256" };

let handler = (req, res) => { res.statusCode = 503; res.end(); };
const server = http.createServer((req, res) => handler(req, res));
server.listen(0, "127.0.0.1", () => {
  const issuer = `http://127.0.0.1:${server.address().port}`;
  const provider = new Provider(issuer, {
    clients: setup.clients,
    jwks: { keys: [jwk] },
    pkce: { required: () => true },
    claims: { openid: ["sub"], email: ["email", "email_verified"], profile: ["name"], groups: ["groups"] },
    conformIdTokenClaims: false,
    features: {
      devInteractions: { enabled: true },
      deviceFlow: { enabled: true },
      rpInitiatedLogout: { enabled: true },
      claimsParameter: { enabled: true },
    },
    async findAccount(ctx, id) {
      const account = readAccounts()[id];
      if (!account) return undefined;
      return { accountId: id, async claims() { return { sub: id, ...account }; } };
    },
    async loadExistingGrant(ctx) {
      const grantId = ctx.oidc.result?.consent?.grantId || ctx.oidc.session.grantIdFor(ctx.oidc.client.clientId);
      if (grantId) return ctx.oidc.provider.Grant.find(grantId);
      const grant = new ctx.oidc.provider.Grant({ clientId: ctx.oidc.client.clientId,
                                                  accountId: ctx.oidc.session.accountId });
      grant.addOIDCScope("openid email profile groups");
      grant.addOIDCClaims(["email", "email_verified", "name", "groups"]);
      await grant.save();
      return grant;
    },
  });
  handler = provider.callback();
  process.stdout.write(issuer + "\n");
});
