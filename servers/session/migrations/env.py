"""Alembic environment: migrations always run on a connection the server hands over
(`config.attributes["connection"]`), inside the server's own transaction."""

from __future__ import annotations

from alembic import context

from oma.servers.session.schema import metadata

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    version_table="oma_session_alembic_version",
)
with context.begin_transaction():
    context.run_migrations()
