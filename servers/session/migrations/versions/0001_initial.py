"""Initial schema: sessions, their labels, and events.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "oma_sessions",
        sa.Column("pk", _PK, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(40), nullable=False, unique=True),
        sa.Column("request_id", sa.String(128), nullable=True, unique=True),
        sa.Column("definition_digest", sa.LargeBinary, nullable=False),
        sa.Column("definition", sa.LargeBinary, nullable=False),
        sa.Column("status", sa.SmallInteger, nullable=False),
        sa.Column("stop_reason", sa.SmallInteger, nullable=False, server_default="0"),
        sa.Column("last_seq", sa.BigInteger, nullable=False),
        sa.Column("last_user_seq", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("last_idle_seq", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("create_time_us", sa.BigInteger, nullable=False),
        sa.Column("update_time_us", sa.BigInteger, nullable=False),
        sa.Column("lease_holder", sa.String(128), nullable=True),
        sa.Column("fencing_token", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("lease_expire_us", sa.BigInteger, nullable=True),
    )
    op.create_table(
        "oma_session_labels",
        sa.Column("session_pk", sa.BigInteger, primary_key=True),
        sa.Column("key", sa.String(256), primary_key=True),
        sa.Column("value", sa.String(256), nullable=False),
    )
    op.create_index("ix_oma_session_labels_key_value", "oma_session_labels", ["key", "value"])
    op.create_table(
        "oma_events",
        sa.Column("session_pk", sa.BigInteger, primary_key=True),
        sa.Column("seq", sa.BigInteger, primary_key=True),
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("body", sa.LargeBinary, nullable=False),
        sqlite_with_rowid=False,
    )
    op.create_index(
        "ux_oma_events_session_event_id", "oma_events", ["session_pk", "event_id"], unique=True
    )
    op.create_index("ix_oma_events_session_type_seq", "oma_events", ["session_pk", "type", "seq"])


def downgrade() -> None:
    op.drop_table("oma_events")
    op.drop_table("oma_session_labels")
    op.drop_table("oma_sessions")
