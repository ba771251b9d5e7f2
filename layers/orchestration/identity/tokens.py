"""Bearer tokens: `cpn_<lookup>_<secret>`, shown once, stored as an argon2id hash.

The lookup part finds the row without scanning; the secret is verified against the hash. Verified
tokens are cached in memory for a short while (keyed by a SHA-256 of the token, never the token)
so a busy client does not pay the KDF on every request.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from datetime import UTC, datetime

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from cpn.core import errors
from cpn.core.principal import Principal, Role
from layers.orchestration.identity.models import Account, Token

_HASHER = PasswordHasher(time_cost=2, memory_cost=19456, parallelism=1)
_CACHE_SECONDS = 30.0
_cache: dict[str, tuple[float, Principal]] = {}


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
                      expires_at: datetime | None = None) -> str:
    """Create a token for an account and return it in clear — the only time it is visible."""
    lookup, secret, token = _mint()
    session.add(Token(account_id=account.id, name=name, lookup=lookup, secret_hash=_HASHER.hash(secret),
                      job=job, expires_at=expires_at))
    await session.flush()
    return token


async def create_token(session: AsyncSession, name: str, role: Role) -> str:
    account = await ensure_account(session, name, role)
    return await issue_token(session, account, name)


async def authenticate(session: AsyncSession, header: str | None) -> Principal:
    """Resolve an `Authorization: Bearer …` header to a principal or raise Unauthenticated."""
    if not header or not header.startswith("Bearer "):
        raise errors.Unauthenticated("missing bearer token: send 'Authorization: Bearer <token>'")
    token = header[7:].strip()
    key = hashlib.sha256(token.encode()).hexdigest()
    hit = _cache.get(key)
    if hit and hit[0] > time.monotonic():
        return hit[1]
    principal = await _verify(session, token)
    _cache[key] = (time.monotonic() + _CACHE_SECONDS, principal)
    return principal


async def _verify(session: AsyncSession, token: str) -> Principal:
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != "cpn":
        raise errors.Unauthenticated("malformed token")
    row = (await session.execute(
        select(Token, Account).join(Account, Account.id == Token.account_id).where(Token.lookup == parts[1])
    )).first()
    if row is None:
        raise errors.Unauthenticated("unknown token")
    tok, account = row
    try:
        _HASHER.verify(tok.secret_hash, parts[2])
    except (VerificationError, InvalidHashError) as exc:
        raise errors.Unauthenticated("invalid token") from exc
    if tok.revoked or account.disabled:
        raise errors.Unauthenticated("token revoked")
    if tok.expires_at is not None and _aware(tok.expires_at) < datetime.now(UTC):
        raise errors.Unauthenticated("token expired")
    role = Role.WORKER if tok.job else Role(account.role)
    return Principal(account_id=account.id, name=account.name, role=role, token_id=tok.id, job=tok.job)


async def revoke_job_tokens(session: AsyncSession, job: str) -> None:
    for tok in (await session.execute(select(Token).where(Token.job == job))).scalars():
        tok.revoked = True
    _cache.clear()


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)
