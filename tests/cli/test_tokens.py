"""Tokens from the server side (`cpn token create/list/revoke`, expiry) and `cpnctl auth whoami`,
against a real `cpn serve` sharing the database."""

from __future__ import annotations

import json
import time

import httpx

from layers.orchestration.identity.tokens import UNUSABLE


def _whoami(server, token: str):  # type: ignore[no-untyped-def]
    return server.cpnctl("--server", server.url, "--token", token, "auth", "whoami", "-o", "json")


def test_whoami_list_never_shows_secret_and_revoke_takes_effect_at_once(live_server) -> None:
    alice = live_server.token("alice", "user")
    second = live_server.token("alice", "user")
    admin = live_server.token("root", "admin")
    me = _whoami(live_server, alice)
    assert me.returncode == 0, me.stderr
    body = json.loads(me.stdout)
    assert {k: body[k] for k in ("name", "role", "server")} == {"name": "alice", "role": "user",
                                                                "server": live_server.url}
    text = live_server.cpnctl("--server", live_server.url, "--token", admin, "auth", "whoami")
    assert text.returncode == 0 and "Name:     root" in text.stdout and "Role:     admin" in text.stdout

    table = live_server.cpn("token", "list").stdout
    assert table.splitlines()[0].split() == ["ID", "ACCOUNT", "ROLE", "STATE", "CREATED", "EXPIRES", "JOB"]
    listed = json.loads(live_server.cpn("token", "list", "--account", "alice", "-o", "json").stdout)
    ids = [t["id"] for t in listed]
    assert ids == [alice.split("_")[1], second.split("_")[1]]
    assert all(t["state"] == "active" and t["expires"] is None for t in listed)
    for secret in (alice, second, admin):  # neither the token nor its secret part is ever printed
        assert secret not in table and secret.split("_", 2)[2] not in table
        assert secret.split("_", 2)[2] not in json.dumps(listed)

    # the server has verified (and cached) alice's token; revoking it in the database ends it at once
    assert httpx.get(f"{live_server.url}/api/v1/whoami", headers={"Authorization": f"Bearer {alice}"}).status_code == 200
    out = live_server.cpn("token", "revoke", f"cpn_{ids[0]}")
    assert out.stdout.strip() == f"token {ids[0]} revoked"
    gone = httpx.get(f"{live_server.url}/api/v1/whoami", headers={"Authorization": f"Bearer {alice}"})
    assert gone.status_code == 401 and gone.json()["error"]["message"] == UNUSABLE  # one message
    assert _whoami(live_server, second).returncode == 0  # the other token of the account still works
    states = {t["id"]: t["state"] for t in json.loads(live_server.cpn("token", "list", "-o", "json").stdout)}
    assert states[ids[0]] == "revoked" and states[ids[1]] == "active"

    # a whole token on the command line is refused (it would land in shell history); unknown ids named
    whole = live_server.cpn("token", "revoke", second, check=False)
    assert whole.returncode == 1 and "not the whole token" in whole.stderr and second not in whole.stderr
    unknown = live_server.cpn("token", "revoke", "0123456789abcdef", check=False)
    assert unknown.returncode == 1 and "no token with id '0123456789abcdef'" in unknown.stderr
    both = live_server.cpn("token", "revoke", "--account", "alice")
    assert both.stdout.strip() == f"token {ids[1]} revoked"
    denied = _whoami(live_server, second)
    assert denied.returncode == 1 and "token not accepted" in denied.stderr and "Traceback" not in denied.stderr


def test_expiring_token(live_server) -> None:
    created = time.monotonic()  # long enough for two CLI starts on a loaded machine (each can take seconds)
    token = live_server.cpn("token", "create", "bob", "--role", "user", "--expires-in", "20s")
    assert "expires 20" in token.stderr
    bob = token.stdout.strip()
    assert _whoami(live_server, bob).returncode == 0  # valid now (and cached by the server)
    [row] = json.loads(live_server.cpn("token", "list", "--account", "bob", "-o", "json").stdout)
    assert row["state"] == "active" and row["expires"] is not None
    time.sleep(max(0.0, 20.5 - (time.monotonic() - created)))
    late = _whoami(live_server, bob)
    assert late.returncode == 1 and "token not accepted" in late.stderr
    [row] = json.loads(live_server.cpn("token", "list", "--account", "bob", "-o", "json").stdout)
    assert row["state"] == "expired"
    for bad in ("30", "0d", "5y", "99999w"):
        out = live_server.cpn("token", "create", "bob", "--role", "user", "--expires-in", bad, check=False)
        assert out.returncode != 0 and "--expires-in" in out.stderr and "cpn_" not in out.stdout
