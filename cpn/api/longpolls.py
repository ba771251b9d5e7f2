"""Long polls held per token and target (issue 35, M3): a `watch=true` list (target: its cluster) and a
`logs?follow=1` (target: its job) hold a request open; one token may hold at most MAX_PER_TOKEN of them
on one target at once in this server process, the next gets a 429 naming the limit. Forty follows on a
Quoted job used to cost 9 s of server CPU every 20 s. Per target, so that a provider whose agents serve
many clusters with one token is never refused."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from cpn.core import errors
from cpn.core.principal import Principal

MAX_PER_TOKEN = 8  # per target: an agent holds one watch on its cluster; a person a few `logs -f` of a job


class LongPolls:
    def __init__(self, limit: int = MAX_PER_TOKEN):
        self.limit, self.held = limit, Counter[str]()

    @contextmanager
    def hold(self, principal: Principal, target: str) -> Iterator[None]:
        key = f"{principal.token_id or principal.account_id} {target}"
        if self.held[key] >= self.limit:
            raise errors.RateLimited(f"this token already holds {self.limit} open watches or log follows of "
                                     f"{target}; close one (or poll without watch/follow) and try again")
        self.held[key] += 1
        try:
            yield
        finally:
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key]


LONG_POLLS = web.AppKey("long_polls", LongPolls)
