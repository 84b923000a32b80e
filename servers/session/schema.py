"""The tables, as SQLAlchemy Core. Alembic migrations (in `migrations/`) create and evolve
them; this module is what the store queries against and must match the latest revision."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
)

# SQLite only auto-increments an `INTEGER PRIMARY KEY`; PostgreSQL gets a 64-bit identity.
PK_TYPE = BigInteger().with_variant(Integer(), "sqlite")

metadata = MetaData()

sessions = Table(
    "oma_sessions",
    metadata,
    Column("pk", PK_TYPE, primary_key=True, autoincrement=True),
    Column("id", String(40), nullable=False, unique=True),
    Column("request_id", String(128), nullable=True, unique=True),
    Column("definition_digest", LargeBinary, nullable=False),
    Column("definition", LargeBinary, nullable=False),
    Column("status", SmallInteger, nullable=False),
    Column("stop_reason", SmallInteger, nullable=False, server_default="0"),
    Column("last_seq", BigInteger, nullable=False),
    # Pending-input bookkeeping: a session needs a harness when a user event follows the
    # last idle (or its status says a turn was left running), and no lease is live.
    Column("last_user_seq", BigInteger, nullable=False, server_default="0"),
    Column("last_idle_seq", BigInteger, nullable=False, server_default="0"),
    Column("create_time_us", BigInteger, nullable=False),
    Column("update_time_us", BigInteger, nullable=False),
    Column("lease_holder", String(128), nullable=True),
    Column("fencing_token", BigInteger, nullable=False, server_default="0"),
    Column("lease_expire_us", BigInteger, nullable=True),
)

session_labels = Table(
    "oma_session_labels",
    metadata,
    Column("session_pk", BigInteger, primary_key=True),
    Column("key", String(256), primary_key=True),
    Column("value", String(256), nullable=False),
    Index("ix_oma_session_labels_key_value", "key", "value"),
)

# (session_pk, seq) is the clustered key (SQLite WITHOUT ROWID, PostgreSQL primary key index),
# so a positional slice is one index range scan whatever the size of the log.
events = Table(
    "oma_events",
    metadata,
    Column("session_pk", BigInteger, primary_key=True),
    Column("seq", BigInteger, primary_key=True),
    Column("event_id", String(128), nullable=False),
    Column("type", String(64), nullable=False),
    # The whole `oma.session.v1.Event`, seq and create_time included, serialized.
    Column("body", LargeBinary, nullable=False),
    Index("ux_oma_events_session_event_id", "session_pk", "event_id", unique=True),
    Index("ix_oma_events_session_type_seq", "session_pk", "type", "seq"),
    sqlite_with_rowid=False,
)
