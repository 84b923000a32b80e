"""Opening the database: engines, durability settings, migrations, and how work runs on them.

The store writes its transactions as plain synchronous SQLAlchemy Core functions
(`fn(connection) -> result`) and hands them to `Database.write` / `Database.read`, which run
each one as a single unit:

- SQLite: a synchronous pysqlite engine, driven from the event loop through threads. All
  writes run on one dedicated writer thread whose transactions start with `BEGIN IMMEDIATE`
  (so writers in other processes queue on SQLite's lock instead of failing at commit); reads
  run on a small pool of reader threads, concurrently with the writer (WAL). One thread hop per
  transaction: an async driver would hop threads for every cursor call (about 20 per append).
  The append hot path (`write_sqlite`) runs on the writer thread's own pooled sqlite3
  connection with the same pragmas, issuing BEGIN IMMEDIATE / COMMIT itself.
- PostgreSQL: the async asyncpg engine; the function runs through `AsyncConnection.run_sync`.

Both refuse to start unless acknowledged commits are durable: SQLite WAL with
`synchronous=FULL`, PostgreSQL `synchronous_commit=on` (set on every connection, so a database
default of `off` cannot weaken it) with `fsync=on`.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

T = TypeVar("T")

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
# Any constant: serializes concurrent start-ups migrating one PostgreSQL database.
_MIGRATION_LOCK_KEY = 0x0A5E5510
_READER_THREADS = 4
_APPEND_CONNECTIONS = 10  # PostgreSQL: appends in flight at once (each holds a connection)


class DurabilityError(RuntimeError):
    """The database would acknowledge commits that a crash could lose; refuse to start."""


class DatabaseInUse(RuntimeError):
    """Another session server already serves this SQLite file."""


def normalize_url(url: str) -> URL:
    """Accept `sqlite:///path`, `sqlite+aiosqlite:///path`, `postgresql://...`,
    `postgresql+asyncpg://...` or a bare file path (a SQLite file)."""
    if "://" not in url:
        return URL.create("sqlite", database=str(Path(url).expanduser().resolve()))
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:") or database.startswith("file::memory:"):
            raise DurabilityError(
                "an in-memory SQLite database cannot be durable; give a file path, e.g. "
                "sqlite:///var/lib/oma/sessions.db"
            )
        return parsed.set(drivername="sqlite")
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+asyncpg")
    raise ValueError(f"unsupported database URL {url!r}: use a sqlite:/// or postgresql:// URL")


def sqlite_engine(url: URL, *, immediate: bool, pool_size: int) -> Engine:
    """A pysqlite engine with the session log's pragmas on every connection."""
    engine = create_engine(
        url,
        pool_size=pool_size,
        max_overflow=0,
        connect_args={"timeout": 30, "check_same_thread": False},
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # The driver's implicit deferred BEGIN would let two writers both read the last seq
        # and then collide at commit; we issue BEGIN ourselves (see _on_begin).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


class Database:
    """One session database: where transactions run and what kind it is."""

    def __init__(self, url: URL) -> None:
        self.url = url
        self.dialect = url.get_backend_name()
        self._sqlite_writer: Engine | None = None
        self._raw_writer: Any = None  # the writer thread's own pooled DBAPI connection
        self._sqlite_reader: Engine | None = None
        self._async_engine: AsyncEngine | None = None
        self._write_thread: ThreadPoolExecutor | None = None
        self._read_threads: ThreadPoolExecutor | None = None
        self._lock_file: Any = None
        # PostgreSQL append connections: plain asyncpg, kept open between appends.
        self._pg_free: list[Any] = []
        self._pg_slots = asyncio.Semaphore(_APPEND_CONNECTIONS)
        self._closed = False
        if self.is_sqlite:
            if url.database:
                Path(url.database).parent.mkdir(parents=True, exist_ok=True)
                self._lock_file = _lock_single_server(Path(url.database))
            # Two: one for `write`, one held by the writer thread for `write_sqlite`.
            self._sqlite_writer = sqlite_engine(url, immediate=True, pool_size=2)
            self._sqlite_reader = sqlite_engine(url, immediate=False, pool_size=_READER_THREADS)
            self._write_thread = ThreadPoolExecutor(1, thread_name_prefix="oma-session-write")
            self._read_threads = ThreadPoolExecutor(
                _READER_THREADS, thread_name_prefix="oma-session-read"
            )
        else:
            self._async_engine = create_async_engine(
                url,
                pool_size=10,
                max_overflow=20,
                connect_args={"server_settings": {"synchronous_commit": "on"}},
            )

    @property
    def is_sqlite(self) -> bool:
        return self.dialect == "sqlite"

    def asyncpg_dsn(self) -> str:
        """Plain libpq DSN for a raw asyncpg connection (LISTEN needs its own connection)."""
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)

    async def write(self, fn: Callable[[Connection], T]) -> T:
        """Run `fn` in one write transaction; committed when it returns, rolled back if it raises."""
        if self._sqlite_writer is not None:
            engine = self._sqlite_writer
            return await asyncio.get_running_loop().run_in_executor(
                self._write_thread, _in_transaction, engine, fn
            )
        assert self._async_engine is not None
        async with self._async_engine.begin() as conn:
            return await conn.run_sync(fn)

    async def write_sqlite(
        self,
        fn: Callable[[sqlite3.Connection], T],
        after_commit: Callable[[T], None] | None = None,
    ) -> T:
        """SQLite only: run `fn` on the writer thread's sqlite3 connection inside
        `BEGIN IMMEDIATE` ... `COMMIT` (rolled back if it raises). Same thread, pragmas and
        durability as `write`, without SQLAlchemy's per-transaction machinery: the append hot
        path, where the writer thread should hold the GIL for as little Python as possible.

        `after_commit(result)` runs on the event loop once the transaction has committed, in
        commit order, even if the awaiting task was cancelled meanwhile (a committed change is
        always announced)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        assert self._write_thread is not None
        # One callback into the loop per transaction (no chained concurrent future).
        self._write_thread.submit(self._raw_job, loop, future, fn, after_commit)
        return await future

    def _raw_job(
        self,
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[T],
        fn: Callable[[sqlite3.Connection], T],
        after_commit: Callable[[T], None] | None,
    ) -> None:
        try:
            result = self._raw_transaction(fn)
        except BaseException as exc:
            loop.call_soon_threadsafe(_fail, future, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, after_commit)

    def _raw_transaction(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn = self._raw_writer_connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = fn(conn)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return result

    def _raw_writer_connection(self) -> sqlite3.Connection:
        """Runs on the writer thread. Checked out of the writer engine's pool, so its connect
        hook set WAL and synchronous=FULL; checked again here before its first use."""
        if self._raw_writer is None:
            assert self._sqlite_writer is not None
            fairy = self._sqlite_writer.raw_connection()
            conn = fairy.driver_connection
            assert conn is not None
            journal = conn.execute("PRAGMA journal_mode").fetchone()[0]
            sync = conn.execute("PRAGMA synchronous").fetchone()[0]
            try:
                check_settings(
                    "sqlite",
                    {"journal_mode": str(journal).lower(), "synchronous": str(sync)},
                    str(self.url.database),
                )
            except DurabilityError:
                fairy.close()
                raise
            self._raw_writer = fairy
        conn = self._raw_writer.driver_connection
        assert isinstance(conn, sqlite3.Connection)
        return conn

    @contextlib.asynccontextmanager
    async def asyncpg_transaction(self) -> AsyncIterator[Any]:
        """PostgreSQL only: an asyncpg connection inside a transaction, for the append hot path
        (native prepared statements and pipelined executemany, no per-statement greenlet hop,
        no SQLAlchemy pool checkout). Commits when the block ends, rolls back if it raises.
        The connections are this database's own (at most `_APPEND_CONNECTIONS`), opened with
        `synchronous_commit=on` and checked before first use."""
        conn = await self._pg_acquire()
        reusable = False
        try:
            async with conn.transaction():
                yield conn
            reusable = True
        except Exception:
            reusable = True  # rolled back by the block; closed if that failed (checked below)
            raise
        finally:
            self._pg_release(conn, reusable)

    async def _pg_acquire(self) -> Any:
        await self._pg_slots.acquire()
        try:
            while self._pg_free:
                conn = self._pg_free.pop()
                if not conn.is_closed():
                    return conn
            import asyncpg

            conn = await asyncpg.connect(
                self.asyncpg_dsn(), server_settings={"synchronous_commit": "on"}
            )
            try:
                commit = await conn.fetchval("SHOW synchronous_commit")
                fsync = await conn.fetchval("SHOW fsync")
                check_settings("postgresql", {"synchronous_commit": commit, "fsync": fsync})
            except BaseException:
                conn.terminate()
                raise
            return conn
        except BaseException:
            self._pg_slots.release()
            raise

    def _pg_release(self, conn: Any, reusable: bool) -> None:
        """Keep a connection that is idle and healthy; drop one a cancellation may have cut
        mid-protocol."""
        self._pg_slots.release()
        if reusable and not self._closed and not conn.is_closed() and not conn.is_in_transaction():
            self._pg_free.append(conn)
        else:
            conn.terminate()

    async def read(self, fn: Callable[[Connection], T]) -> T:
        """Run `fn` in one read transaction (a consistent snapshot)."""
        if self._sqlite_reader is not None:
            engine = self._sqlite_reader
            return await asyncio.get_running_loop().run_in_executor(
                self._read_threads, _in_transaction, engine, fn
            )
        assert self._async_engine is not None
        async with self._async_engine.connect() as conn:
            return await conn.run_sync(fn)

    async def durability_settings(self) -> dict[str, str]:
        """The settings in force on a writing connection, read back from the database."""
        return await self.write(_settings)

    async def close(self) -> None:
        self._closed = True
        while self._pg_free:
            conn = self._pg_free.pop()
            try:
                await conn.close(timeout=5)
            except Exception:
                conn.terminate()
        if self._async_engine is not None:
            await self._async_engine.dispose()
        for pool in (self._write_thread, self._read_threads):
            if pool is not None:
                pool.shutdown(wait=True)
        if self._raw_writer is not None:
            self._raw_writer.close()  # back to its pool, closed below with the rest
            self._raw_writer = None
        for engine in (self._sqlite_writer, self._sqlite_reader):
            if engine is not None:
                engine.dispose()
        if self._lock_file is not None:
            self._lock_file.close()  # releases the flock
            self._lock_file = None


def _settle(future: asyncio.Future[T], result: T, after_commit: Callable[[T], None] | None) -> None:
    try:
        if after_commit is not None:
            after_commit(result)
    finally:
        # Committed: the writer learns so even if announcing it failed (the loop logs that).
        if not future.cancelled():
            future.set_result(result)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.cancelled():
        future.set_exception(exc)


def _lock_single_server(database: Path) -> Any:
    """Hold an exclusive lock beside the SQLite file for the server's lifetime. Live streams
    are fed in-process on SQLite, so a second server on the same file would never tell the
    first one's watchers about its appends: refuse it instead (the lock dies with the process,
    SIGKILL included)."""
    import fcntl

    handle = open(database.with_name(database.name + ".server-lock"), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise DatabaseInUse(
            f"another session server is serving {database}; an embedded SQLite log has one "
            "server (use PostgreSQL to run several)"
        ) from None
    return handle


def _in_transaction(engine: Engine, fn: Callable[[Connection], T]) -> T:
    with engine.begin() as conn:
        return fn(conn)


def _settings(conn: Connection) -> dict[str, str]:
    if conn.dialect.name == "sqlite":
        journal = conn.exec_driver_sql("PRAGMA journal_mode").scalar_one()
        sync = conn.exec_driver_sql("PRAGMA synchronous").scalar_one()
        return {"journal_mode": str(journal).lower(), "synchronous": str(sync)}
    commit = conn.exec_driver_sql("SHOW synchronous_commit").scalar_one()
    fsync = conn.exec_driver_sql("SHOW fsync").scalar_one()
    return {"synchronous_commit": str(commit), "fsync": str(fsync)}


def check_settings(dialect: str, settings: dict[str, str], where: str = "") -> None:
    """Raise DurabilityError unless `settings` make every acknowledged commit durable."""
    if dialect == "sqlite":
        if settings["journal_mode"] != "wal" or settings["synchronous"] != "2":
            raise DurabilityError(
                f"SQLite {where} runs with journal_mode={settings['journal_mode']} "
                f"synchronous={settings['synchronous']}; the session log needs WAL and "
                "synchronous=FULL (2) (is the file on a filesystem without shared memory?)"
            )
    elif settings["synchronous_commit"] != "on" or settings["fsync"] != "on":
        raise DurabilityError(
            f"PostgreSQL runs with synchronous_commit={settings['synchronous_commit']} "
            f"fsync={settings['fsync']}; the session log needs both 'on' (set fsync=on in "
            "postgresql.conf)"
        )


async def open_database(url: str, *, migrate: bool = True) -> Database:
    """Open (and by default migrate) the database at `url`; raises DurabilityError when its
    settings would make acknowledged writes losable."""
    db = Database(normalize_url(url))
    try:
        check_settings(db.dialect, await db.durability_settings(), str(db.url.database))
        if migrate:
            await db.write(_upgrade)
    except BaseException:
        await db.close()
        raise
    return db


def _upgrade(connection: Connection) -> None:
    """Bring the schema to the latest Alembic revision (idempotent; safe for concurrent
    start-ups: PostgreSQL takes an advisory lock, SQLite's BEGIN IMMEDIATE serializes)."""
    from alembic import command
    from alembic.config import Config

    if connection.dialect.name != "sqlite":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK_KEY})
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")
