"""Bearer tokens: `cpn_<lookup>_<secret>`, shown once, stored as an argon2id hash.

The lookup part finds the row without scanning; the secret is verified against the hash. Verified
tokens are cached in memory for a short while (keyed by a SHA-256 of the token, never the token)
so a busy client does not pay the KDF on every request, and concurrent first requests with one
token share one verification. The cache skips the KDF, never the database: every request still
reads its token's row (revoked, expiry, account disabled), so a revocation written by any replica
holds at every replica sharing the database from the next request on.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.db import Database
from cpn.core.principal import Principal, Role
from layers.orchestration.identity.models import Account, Token

_HASHER = PasswordHasher(time_cost=2, memory_cost=19456, parallelism=1)
_CACHE_SECONDS = 30.0
_cache: dict[str, tuple[float, Principal]] = {}
_verifying: dict[str, asyncio.Future[Principal]] = {}  # token digest → its verification in flight


def _mint() -> tuple[str, str, str]:
    lookup = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    return lookup, secret, f"cpn_{lookup}_{secret}"


async def ensure_account(session: AsyncSession, name: str, role: Role) -> Account:
    account = (await session.execute(select(Account).where(Account.name == name))).scalar_one_or_none()
    if account is None:
        account = Account(name=name, role=role.value)
        session.add(account)
        await session.flush()
    elif account.role != role.value:
        raise errors.Conflict(f"account {name!r} exists with role {account.role!r}", field="role")
    return account


async def issue_token(session: AsyncSession, account: Account, name: str, *, job: str | None = None,
                      subtask: str | None = None, expires_at: datetime | None = None) -> str:
    """Create a token for an account and return it in clear — the only time it is visible."""
    lookup, secret, token = _mint()
    session.add(Token(account_id=account.id, name=name, lookup=lookup, secret_hash=_HASHER.hash(secret),
                      job=job, subtask=subtask, expires_at=expires_at))
    await session.flush()
    return token


async def create_token(session: AsyncSession, name: str, role: Role, *, expires_at: datetime | None = None) -> str:
    account = await ensure_account(session, name, role)
    return await issue_token(session, account, name, expires_at=expires_at)


@dataclass(frozen=True)
class TokenInfo:
    """What may be shown about a token: never the secret nor its hash. `id` is the lookup part, the
    `cpn_<id>_…` prefix of the token, so its owner can tell which one it is."""

    id: str
    account: str
    role: str
    job: str | None
    created_at: datetime
    expires_at: datetime | None
    state: str  # active | revoked | expired


def _state(tok: Token, account: Account, now: datetime) -> str:
    if tok.revoked or account.disabled:
        return "revoked"
    if tok.expires_at is not None and _aware(tok.expires_at) <= now:
        return "expired"
    return "active"


async def list_tokens(session: AsyncSession, account: str | None = None, *, include_workers: bool = False
                      ) -> list[TokenInfo]:
    """Tokens, oldest first, optionally of one account; worker tokens (one per running job) only on request."""
    stmt = select(Token, Account).join(Account, Account.id == Token.account_id).order_by(Token.created_at, Token.id)
    if account is not None:
        stmt = stmt.where(Account.name == account)
    if not include_workers:
        stmt = stmt.where(Token.job.is_(None))
    now = datetime.now(UTC)
    return [TokenInfo(id=tok.lookup, account=acc.name, role="worker" if tok.job else acc.role, job=tok.job,
                      created_at=_aware(tok.created_at), expires_at=_aware(tok.expires_at) if tok.expires_at else None,
                      state=_state(tok, acc, now))
            for tok, acc in (await session.execute(stmt)).all()]


def token_id(ref: str) -> str:
    """The lookup id from `ID` or a `cpn_ID` / `cpn_ID_` prefix (never the whole token: secrets stay off
    command lines)."""
    ref = ref.strip()
    if ref.startswith("cpn_"):
        lookup, _, secret = ref.removeprefix("cpn_").partition("_")
        if secret:  # whatever follows cpn_<id>_ is the secret, even when it starts with "_" (base64url)
            raise errors.InvalidInput("give the token's id (the cpn_<id> prefix), not the whole token: "
                                      "a secret on a command line lands in shell history", field="id")
        return lookup
    return ref.split("_")[0]


async def revoke(session: AsyncSession, ref: str | None = None, *, account: str | None = None) -> list[str]:
    """Revoke one token (by id) or every token of an account; returns the ids revoked. Takes effect on
    the next request at every server sharing the database (see `authenticate`)."""
    stmt = select(Token).join(Account, Account.id == Token.account_id).where(Token.revoked.is_(False))
    if ref is not None:
        lookup = token_id(ref)
        found = (await session.execute(select(Token).where(Token.lookup == lookup))).scalar_one_or_none()
        if found is None:
            raise errors.NotFound(f"no token with id {lookup!r} (see `cpn token list`)", field="id")
        stmt = stmt.where(Token.lookup == lookup)
    if account is not None:
        if (await session.execute(select(Account.id).where(Account.name == account))).first() is None:
            raise errors.NotFound(f"no account {account!r}", field="account")
        stmt = stmt.where(Account.name == account)
    rows = list((await session.execute(stmt)).scalars())
    for tok in rows:
        tok.revoked = True
    await session.flush()
    _cache.clear()
    return [t.lookup for t in rows]


async def authenticate(session: AsyncSession, header: str | None) -> Principal:
    """Resolve an `Authorization: Bearer …` header to a principal or raise Unauthenticated."""
    if not header or not header.startswith("Bearer "):
        raise errors.Unauthenticated("missing bearer token: send 'Authorization: Bearer <token>' (cpnctl and cpn agent: "
                                     "CPN_TOKEN, or cpnctl config set-context NAME --server URL --token TOKEN; "
                                     "a token comes from cpn token create NAME --role ROLE)")
    key = _digest(header)
    hit = _cache.get(key)
    if hit and hit[0] > time.monotonic():
        await _still_valid(session, hit[1])
        return hit[1]
    pending = _verifying.get(key)
    if pending is None:
        return await _verify_once(session, key, header[7:].strip())
    try:  # a burst on one token pays for one KDF: the others wait for its outcome
        principal = await asyncio.shield(pending)
    except asyncio.CancelledError:
        if not pending.cancelled():
            raise  # this request was cancelled, not the verification it waited for
        return await authenticate(session, header)
    await _still_valid(session, principal)
    return principal


async def _verify_once(session: AsyncSession, key: str, token: str) -> Principal:
    """Verify the token, letting concurrent requests with the same token wait for this outcome."""
    future: asyncio.Future[Principal] = asyncio.get_running_loop().create_future()
    _verifying[key] = future
    try:
        principal = await _verify(session, token)
    except asyncio.CancelledError:
        future.cancel()
        raise
    except BaseException as exc:
        future.set_exception(exc)
        future.exception()  # retrieved: no "never retrieved" warning when nobody else waited
        raise
    else:
        future.set_result(principal)
        _cache[key] = (time.monotonic() + _CACHE_SECONDS, principal)
        return principal
    finally:
        del _verifying[key]


@functools.cache
def _stand_in() -> str:
    """A hash no token verifies against (its secret is thrown away), made once."""
    return _HASHER.hash(secrets.token_urlsafe(32))


async def _verify(session: AsyncSession, token: str) -> Principal:
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != "cpn":
        raise errors.Unauthenticated(UNUSABLE)
    row = (await session.execute(
        select(Token, Account).join(Account, Account.id == Token.account_id).where(Token.lookup == parts[1])
    )).first()
    # an unknown id pays the same KDF against a stand-in hash: refused at once, its timing told whether a token
    # id exists (issue 35); the stand-in never verifies
    secret_hash = _stand_in() if row is None else row[0].secret_hash
    try:  # the KDF (~20 ms of CPU) runs beside the event loop: argon2 releases the GIL
        await asyncio.to_thread(_HASHER.verify, secret_hash, parts[2])
    except (VerificationError, InvalidHashError) as exc:
        raise errors.Unauthenticated(UNUSABLE) from exc
    if row is None:
        raise errors.Unauthenticated(UNUSABLE)
    tok, account = row
    if tok.revoked or account.disabled:
        raise errors.Unauthenticated(UNUSABLE)
    if tok.expires_at is not None and _aware(tok.expires_at) < datetime.now(UTC):
        raise errors.Unauthenticated(UNUSABLE)
    role = Role.WORKER if tok.job else Role(account.role)
    return Principal(account_id=account.id, name=account.name, role=role, token_id=tok.id, job=tok.job,
                     subtask=tok.subtask)


async def _still_valid(session: AsyncSession, principal: Principal) -> None:
    """A cached verification skips the KDF, not the database: revocation, expiry and a disabled account
    take effect on the next request, at every replica sharing the database (one primary-key read)."""
    _check_still_valid((await session.execute(_validity(), {"token_id": principal.token_id})).first())


@functools.cache  # built once, run with each token's id
def _validity() -> Any:
    return (select(Token.revoked, Token.expires_at, Account.disabled).join(Account, Account.id == Token.account_id)
            .where(Token.id == bindparam("token_id")))


def _check_still_valid(row: Any) -> None:
    if row is None or row.revoked or row.disabled:
        _cache.clear()
        raise errors.Unauthenticated(UNUSABLE)
    if row.expires_at is not None and _aware(row.expires_at) < datetime.now(UTC):
        raise errors.Unauthenticated(UNUSABLE)


async def authenticate_charged(db: Database, header: str | None, limiter: Any) -> tuple[Principal, bool | None]:
    """`authenticate_request` and, for a token verified before under a shared rate
    limiter, its rate limit in the same statement: (principal, whether within the limit); None when
    the limit was not checked (the caller asks the limiter)."""
    charging = getattr(limiter, "charging", None)
    hit = _cache.get(_digest(header)) if header and header.startswith("Bearer ") else None
    if charging is None or not hit or hit[0] <= time.monotonic():
        return await authenticate_request(db, header), None
    principal = hit[1]
    row = await db.write_returning(charging(_validity()), {"token_id": principal.token_id,
                                                           "bucket_key": (principal.token_id or principal.account_id)[:64]})
    _check_still_valid(row)
    return principal, bool(row.allowed)


async def authenticate_request(db: Database, header: str | None) -> Principal:
    """`authenticate` for the API's every request: a token verified in the last `_CACHE_SECONDS` costs
    one read of its row outside any transaction (one round trip, not BEGIN + SELECT + COMMIT); the
    row is still read every time, so revocation holds across replicas from the next request on."""
    hit = _cache.get(_digest(header)) if header and header.startswith("Bearer ") else None
    if hit and hit[0] > time.monotonic():
        _check_still_valid(await db.read_row(_validity(), {"token_id": hit[1].token_id}))
        return hit[1]
    async with db.session() as session:
        return await authenticate(session, header)


def _digest(header: str) -> str:
    return hashlib.sha256(header[7:].strip().encode()).hexdigest()


async def revoke_job_tokens(session: AsyncSession, job: str) -> None:
    for tok in (await session.execute(select(Token).where(Token.job == job))).scalars():
        tok.revoked = True
    _cache.clear()


async def revoke_subtask_tokens(session: AsyncSession, subtask: str) -> None:
    """A sub-task ended (or was lost): its workers' token stops working at every replica."""
    for tok in (await session.execute(select(Token).where(Token.subtask == subtask,
                                                          Token.revoked.is_(False)))).scalars():
        tok.revoked = True
    _cache.clear()


async def subtask_has_token(session: AsyncSession, subtask: str) -> bool:
    return (await session.execute(select(Token.id).where(Token.subtask == subtask).limit(1))).first() is not None


# One message for any token the server will not take (unknown, wrong secret, revoked, expired, its account
# disabled): telling them apart tells a guesser which tokens exist (issue 35, L5)
UNUSABLE = ("token not accepted (unknown, revoked or expired): ask an admin for a new one "
            "(cpn token create NAME --role ROLE)")


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)
