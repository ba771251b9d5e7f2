"""A burst of first requests with one token pays for one argon2 verification, and a wrong token in
the same burst is refused for each request."""

from __future__ import annotations

import asyncio

from layers.orchestration.identity import tokens


class CountingHasher:
    def __init__(self) -> None:
        self.calls = 0

    def verify(self, hashed: str, secret: str) -> bool:
        self.calls += 1
        return REAL.verify(hashed, secret)


REAL = tokens._HASHER


async def test_a_burst_on_one_token_verifies_it_once(api, monkeypatch) -> None:
    token = api.tokens["alice"]
    hasher = CountingHasher()
    monkeypatch.setattr(tokens, "_HASHER", hasher)
    tokens._cache.clear()
    good = {"Authorization": f"Bearer {token}"}
    bad = {"Authorization": f"Bearer {token[:-2]}xx"}
    got = await asyncio.gather(*[api.client.get("/api/v1/sites", headers=good) for _ in range(12)])
    assert [r.status for r in got] == [200] * 12 and hasher.calls == 1
    wrong = await asyncio.gather(*[api.client.get("/api/v1/sites", headers=bad) for _ in range(4)])
    assert [r.status for r in wrong] == [401] * 4 and hasher.calls == 2
    assert not tokens._verifying  # nothing left in flight
