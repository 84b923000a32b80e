"""Persistence of the vault with SQLAlchemy 2 (async): SQLite by default, PostgreSQL too.

Three tables: `vault_credentials` (metadata plus the sealed secret: key id, nonce,
ciphertext — never plaintext), `vault_session_tokens` (SHA-256 of each token, never the
token) and `vault_audit`. Times are stored as integer microseconds since the epoch, which
both engines order and compare the same way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    and_,
    delete,
    event,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from oma.servers.vault.crypto import Sealed
from oma.servers.vault.models import AllowedHost, AuditEntry, CredentialInfo, CredentialKind, Grant

metadata = MetaData()

credentials = Table(
    "vault_credentials",
    metadata,
    Column("credential_id", String(63), primary_key=True),
    Column("kind", Integer, nullable=False),
    Column("description", Text, nullable=False, default=""),
    Column("allowed_hosts", Text, nullable=False),
    Column("version", BigInteger, nullable=False),
    Column("header_name", String(256), nullable=False, default=""),
    Column("username", Text, nullable=False, default=""),
    Column("token_endpoint", Text, nullable=False, default=""),
    Column("client_id", Text, nullable=False, default=""),
    Column("access_token_expires_us", BigInteger, nullable=True),
    Column("created_us", BigInteger, nullable=False),
    Column("updated_us", BigInteger, nullable=False),
    Column("key_id", String(32), nullable=False, index=True),
    Column("nonce", LargeBinary, nullable=False),
    Column("ciphertext", LargeBinary, nullable=False),
    Column("request_id", String(128), nullable=True, unique=True),
    Column("request_hash", String(64), nullable=True),
)

session_tokens = Table(
    "vault_session_tokens",
    metadata,
    Column("token_id", String(32), primary_key=True),
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("session_id", String(256), nullable=False, index=True),
    Column("credential_ids", Text, nullable=False),
    Column("created_us", BigInteger, nullable=False),
    Column("expires_us", BigInteger, nullable=False),
    Column("revoked_us", BigInteger, nullable=True),
)

audit = Table(
    "vault_audit",
    metadata,
    Column(
        "audit_id",
        BigInteger().with_variant(Integer, "sqlite"),
        primary_key=True,
        autoincrement=True,
    ),
    Column("time_us", BigInteger, nullable=False),
    Column("actor", String(128), nullable=False),
    Column("session_id", String(256), nullable=False, default="", index=True),
    Column("credential_id", String(63), nullable=False, default="", index=True),
    Column("action", String(32), nullable=False),
    Column("host", Text, nullable=False, default=""),
    Column("method", String(16), nullable=False, default=""),
    Column("http_status", Integer, nullable=False, default=0),
    Column("outcome", String(64), nullable=False),
)


def now_us() -> int:
    return time.time_ns() // 1000


def _us(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1_000_000)


def _s(micros: int | None) -> float | None:
    return None if micros is None else micros / 1_000_000


def async_url(url: str) -> str:
    """Accept plain `sqlite:///` and `postgresql://` URLs and pick the async driver."""
    if url.startswith("sqlite:///"):
        return "sqlite+aiosqlite:///" + url.removeprefix("sqlite:///")
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url.removeprefix(prefix)
    return url


@dataclass(frozen=True)
class CredentialRecord:
    info: CredentialInfo
    sealed: Sealed
    request_id: str | None
    request_hash: str | None


def _record(row: Row[Any]) -> CredentialRecord:
    m = row._mapping
    hosts = tuple(AllowedHost(h["host"], int(h["port"])) for h in json.loads(m["allowed_hosts"]))
    info = CredentialInfo(
        credential_id=m["credential_id"],
        kind=CredentialKind(m["kind"]),
        description=m["description"],
        allowed_hosts=hosts,
        version=int(m["version"]),
        header_name=m["header_name"],
        username=m["username"],
        token_endpoint=m["token_endpoint"],
        client_id=m["client_id"],
        access_token_expires_at=_s(m["access_token_expires_us"]),
        created_at=m["created_us"] / 1_000_000,
        updated_at=m["updated_us"] / 1_000_000,
    )
    sealed = Sealed(m["key_id"], bytes(m["nonce"]), bytes(m["ciphertext"]))
    return CredentialRecord(info, sealed, m["request_id"], m["request_hash"])


def _info_columns(info: CredentialInfo) -> dict[str, Any]:
    return {
        "kind": int(info.kind),
        "description": info.description,
        "allowed_hosts": json.dumps([{"host": h.host, "port": h.port} for h in info.allowed_hosts]),
        "version": info.version,
        "header_name": info.header_name,
        "username": info.username,
        "token_endpoint": info.token_endpoint,
        "client_id": info.client_id,
        "access_token_expires_us": _us(info.access_token_expires_at),
        "created_us": _us(info.created_at),
        "updated_us": _us(info.updated_at),
    }


def _sealed_columns(sealed: Sealed) -> dict[str, Any]:
    return {"key_id": sealed.key_id, "nonce": sealed.nonce, "ciphertext": sealed.ciphertext}


class DuplicateCredential(Exception):
    """The credential id (or request id) is taken."""


class VaultStore:
    """All database access of the vault."""

    def __init__(self, url: str) -> None:
        self.url = async_url(url)
        self.engine: AsyncEngine = create_async_engine(self.url)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)

    async def initialize(self) -> None:
        async with self.engine.begin() as conn:
            await conn.run_sync(metadata.create_all)

    async def close(self) -> None:
        await self.engine.dispose()

    # Credentials ------------------------------------------------------------------------

    async def insert_credential(
        self, info: CredentialInfo, sealed: Sealed, request_id: str | None, request_hash: str | None
    ) -> None:
        from sqlalchemy.exc import IntegrityError

        values = {
            "credential_id": info.credential_id,
            **_info_columns(info),
            **_sealed_columns(sealed),
            "request_id": request_id,
            "request_hash": request_hash,
        }
        try:
            async with self.engine.begin() as conn:
                await conn.execute(insert(credentials).values(**values))
        except IntegrityError:
            raise DuplicateCredential(info.credential_id) from None

    async def get_credential(self, credential_id: str) -> CredentialRecord | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(credentials).where(credentials.c.credential_id == credential_id)
                )
            ).first()
        return None if row is None else _record(row)

    async def find_by_request_id(self, request_id: str) -> CredentialRecord | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(credentials).where(credentials.c.request_id == request_id)
                )
            ).first()
        return None if row is None else _record(row)

    async def replace_secret(
        self,
        info: CredentialInfo,
        sealed: Sealed,
        expected: Sealed | None = None,
        expected_version: int | None = None,
    ) -> bool:
        """Write new metadata and sealed secret; with `expected`/`expected_version`, only if
        the row still holds exactly that ciphertext / version (compare-and-set)."""
        condition = credentials.c.credential_id == info.credential_id
        if expected is not None:
            condition = and_(condition, credentials.c.nonce == expected.nonce)
        if expected_version is not None:
            condition = and_(condition, credentials.c.version == expected_version)
        async with self.engine.begin() as conn:
            result = await conn.execute(
                update(credentials)
                .where(condition)
                .values(**_info_columns(info), **_sealed_columns(sealed))
            )
        return bool(result.rowcount)

    async def delete_credential(self, credential_id: str) -> bool:
        async with self.engine.begin() as conn:
            result = await conn.execute(
                delete(credentials).where(credentials.c.credential_id == credential_id)
            )
        return bool(result.rowcount)

    async def list_credentials(self, after: str, limit: int) -> list[CredentialRecord]:
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(credentials)
                    .where(credentials.c.credential_id > after)
                    .order_by(credentials.c.credential_id)
                    .limit(limit)
                )
            ).all()
        return [_record(r) for r in rows]

    async def credentials_not_under(self, key_id: str) -> list[CredentialRecord]:
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(select(credentials).where(credentials.c.key_id != key_id))
            ).all()
        return [_record(r) for r in rows]

    async def existing_ids(self, ids: Sequence[str]) -> set[str]:
        async with self.engine.connect() as conn:
            rows = (
                await conn.execute(
                    select(credentials.c.credential_id).where(
                        credentials.c.credential_id.in_(list(ids))
                    )
                )
            ).all()
        return {r[0] for r in rows}

    # Session tokens ---------------------------------------------------------------------

    async def insert_token(
        self,
        token_id: str,
        token_hash: str,
        session_id: str,
        credential_ids: Sequence[str],
        expires_at: float,
    ) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(session_tokens).values(
                    token_id=token_id,
                    token_hash=token_hash,
                    session_id=session_id,
                    credential_ids=json.dumps(sorted(set(credential_ids))),
                    created_us=now_us(),
                    expires_us=_us(expires_at),
                    revoked_us=None,
                )
            )

    async def live_grant(self, token_hash: str) -> Grant | None:
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(session_tokens).where(
                        session_tokens.c.token_hash == token_hash,
                        session_tokens.c.revoked_us.is_(None),
                        session_tokens.c.expires_us > now_us(),
                    )
                )
            ).first()
        if row is None:
            return None
        m = row._mapping
        return Grant(
            token_id=m["token_id"],
            session_id=m["session_id"],
            credential_ids=frozenset(json.loads(m["credential_ids"])),
            expires_at=m["expires_us"] / 1_000_000,
        )

    async def revoke_session(self, session_id: str) -> int:
        async with self.engine.begin() as conn:
            result = await conn.execute(
                update(session_tokens)
                .where(
                    session_tokens.c.session_id == session_id,
                    session_tokens.c.revoked_us.is_(None),
                    session_tokens.c.expires_us > now_us(),
                )
                .values(revoked_us=now_us())
            )
        return int(result.rowcount or 0)

    # Audit ------------------------------------------------------------------------------

    async def add_audit(
        self,
        *,
        actor: str,
        action: str,
        outcome: str,
        session_id: str = "",
        credential_id: str = "",
        host: str = "",
        method: str = "",
        http_status: int = 0,
    ) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(audit).values(
                    time_us=now_us(),
                    actor=actor,
                    session_id=session_id,
                    credential_id=credential_id,
                    action=action,
                    host=host,
                    method=method,
                    http_status=http_status,
                    outcome=outcome,
                )
            )

    async def list_audit(
        self, before_id: int | None, limit: int, session_id: str = "", credential_id: str = ""
    ) -> list[AuditEntry]:
        query = select(audit).order_by(audit.c.audit_id.desc()).limit(limit)
        if before_id is not None:
            query = query.where(audit.c.audit_id < before_id)
        if session_id:
            query = query.where(audit.c.session_id == session_id)
        if credential_id:
            query = query.where(audit.c.credential_id == credential_id)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [
            AuditEntry(
                audit_id=int(m["audit_id"]),
                time=m["time_us"] / 1_000_000,
                actor=m["actor"],
                session_id=m["session_id"],
                credential_id=m["credential_id"],
                action=m["action"],
                host=m["host"],
                method=m["method"],
                http_status=int(m["http_status"]),
                outcome=m["outcome"],
            )
            for m in (r._mapping for r in rows)
        ]

    async def count_credentials(self) -> int:
        async with self.engine.connect() as conn:
            return int(
                (await conn.execute(select(func.count()).select_from(credentials))).scalar_one()
            )


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets proxy reads run while audit rows are written; the busy timeout makes
    # concurrent writers wait instead of failing with "database is locked".
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()
