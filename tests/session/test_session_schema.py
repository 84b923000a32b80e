"""The Alembic migrations build exactly the schema the store queries (no drift), on both
backends, and running them again is a no-op."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.engine import Connection

from oma.servers.session.database import open_database
from oma.servers.session.schema import metadata


def _diff(conn: Connection) -> list:
    context = MigrationContext.configure(
        conn, opts={"version_table": "oma_session_alembic_version"}
    )
    return list(compare_metadata(context, metadata))


async def test_migrations_match_schema(db_url: str) -> None:
    db = await open_database(db_url)
    try:
        assert await db.read(_diff) == []
    finally:
        await db.close()
    again = await open_database(db_url)  # a restart migrates nothing and still matches
    try:
        assert await again.read(_diff) == []
    finally:
        await again.close()
