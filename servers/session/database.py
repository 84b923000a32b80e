"""Opening the database: engines, durability settings, migrations.

SQLite gets two engines on one file: a writer whose transactions start with `BEGIN IMMEDIATE`
(so concurrent writers, even in other processes, queue on SQLite's write lock instead of
failing at commit) and a reader for concurrent snapshot reads in WAL mode. PostgreSQL gets
one pooled asyncpg engine. Both refuse to start unless acknowledged commits are durable
(SQLite WAL + `synchronous=FULL`; PostgreSQL `synchronous_commit=on` and `fsync=on`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
# Any constant: serializes concurrent start-ups migrating one PostgreSQL database.
_MIGRATION_LOCK_KEY = 0x0A5E5510


class DurabilityError(RuntimeError):
    """The database would acknowledge commits that a crash could lose; the server refuses to start."""


@dataclass
class Database:
    """The engines of one session database and what kind it is."""

    dialect: str  # "sqlite" or "postgresql"
    url: URL
    write_engine: AsyncEngine
    read_engine: AsyncEngine

    @property
    def is_sqlite(self) -> bool:
        return self.dialect == "sqlite"

    def asyncpg_dsn(self) -> str:
        """Plain libpq DSN for a raw asyncpg connection (LISTEN needs its own connection)."""
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)

    async def durability_settings(self) -> dict[str, str]:
        """The settings in force on a writing connection, read back from the database."""
        async with self.write_engine.connect() as conn:
            if self.is_sqlite:
                journal = (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar_one()
                sync = (await conn.exec_driver_sql("PRAGMA synchronous")).scalar_one()
                return {"journal_mode": str(journal).lower(), "synchronous": str(sync)}
            commit = (await conn.exec_driver_sql("SHOW synchronous_commit")).scalar_one()
            fsync = (await conn.exec_driver_sql("SHOW fsync")).scalar_one()
            return {"synchronous_commit": str(commit), "fsync": str(fsync)}

    async def close(self) -> None:
        await self.write_engine.dispose()
        if self.read_engine is not self.write_engine:
            await self.read_engine.dispose()


def normalize_url(url: str) -> URL:
    """Accept `sqlite:///path`, `sqlite+aiosqlite:///path`, `postgresql://...`,
    `postgresql+asyncpg://...` or a bare file path (a SQLite file)."""
    if "://" not in url:
        return URL.create("sqlite+aiosqlite", database=str(Path(url).expanduser().resolve()))
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:") or database.startswith("file::memory:"):
            raise DurabilityError(
                "an in-memory SQLite database cannot be durable; give a file path, e.g. "
                "sqlite:///var/lib/oma/sessions.db"
            )
        return parsed.set(drivername="sqlite+aiosqlite")
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+asyncpg")
    raise ValueError(f"unsupported database URL {url!r}: use a sqlite:/// or postgresql:// URL")


def _sqlite_engine(url: URL, *, immediate: bool, pool_size: int) -> AsyncEngine:
    engine = create_async_engine(
        url, pool_size=pool_size, max_overflow=0, connect_args={"timeout": 30}
    )

    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # The driver's implicit deferred BEGIN would let two writers both read the last seq
        # and then collide at commit; we issue BEGIN ourselves (see _on_begin).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


async def open_database(url: str, *, migrate: bool = True) -> Database:
    """Open (and by default migrate) the database at `url`; raises DurabilityError when its
    settings would make acknowledged writes losable."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database:
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        db = Database(
            "sqlite",
            parsed,
            _sqlite_engine(parsed, immediate=True, pool_size=1),
            _sqlite_engine(parsed, immediate=False, pool_size=8),
        )
    else:
        engine = create_async_engine(
            parsed,
            pool_size=10,
            max_overflow=20,
            pool_pre_ping=False,
            # Set per connection so a database or role default of `off` cannot weaken it.
            connect_args={"server_settings": {"synchronous_commit": "on"}},
        )
        db = Database("postgresql", parsed, engine, engine)
    try:
        await check_durability(db)
        if migrate:
            await run_migrations(db)
    except BaseException:
        await db.close()
        raise
    return db


async def check_durability(db: Database) -> None:
    settings = await db.durability_settings()
    if db.is_sqlite:
        if settings["journal_mode"] != "wal" or settings["synchronous"] != "2":
            raise DurabilityError(
                f"SQLite at {db.url.database} runs with journal_mode={settings['journal_mode']} "
                f"synchronous={settings['synchronous']}; the session log needs WAL and "
                "synchronous=FULL (2) (is the file on a filesystem without shared memory?)"
            )
    elif settings["synchronous_commit"] != "on" or settings["fsync"] != "on":
        raise DurabilityError(
            f"PostgreSQL runs with synchronous_commit={settings['synchronous_commit']} "
            f"fsync={settings['fsync']}; the session log needs both 'on' (set fsync=on in "
            "postgresql.conf)"
        )


def _upgrade(connection: Connection) -> None:
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


async def run_migrations(db: Database) -> None:
    """Bring the schema to the latest Alembic revision (idempotent; safe for concurrent
    start-ups: PostgreSQL takes an advisory lock, SQLite's BEGIN IMMEDIATE serializes)."""
    async with db.write_engine.begin() as conn:
        if not db.is_sqlite:
            await conn.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY}
            )
        await conn.run_sync(_upgrade)
