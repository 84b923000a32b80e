"""The session store: the domain core of the session service (no gRPC here).

Every write is one database transaction, written as a synchronous SQLAlchemy Core function that
`Database.write` runs as a unit. Seqs are allocated under the session row's lock (PostgreSQL
`SELECT ... FOR UPDATE`; SQLite: the one writer thread plus `BEGIN IMMEDIATE` across
processes), and `last_seq` is updated in the same transaction as the
inserted events, so a failed transaction leaves no gap and concurrent writers cannot
interleave. After each commit the store tells its listeners (the hub) what changed; on
PostgreSQL it also sends `NOTIFY` inside the transaction, so other servers sharing the
database hear about the change exactly when it becomes visible.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import and_, or_, select, text, update
from sqlalchemy.engine import Connection, Row
from sqlalchemy.exc import IntegrityError

from oma.servers.session import events as ev
from oma.servers.session.database import Database
from oma.servers.session.errors import (
    InvalidPageToken,
    LeaseHeld,
    LeaseLost,
    MixedBatch,
    NoSessionPending,
    RequestIdReused,
    SequenceMismatch,
    SessionNotFound,
    SessionTerminated,
)
from oma.servers.session.schema import events, session_labels, sessions
from oma.session.v1 import definition_pb2, events_pb2

NOTIFY_CHANNEL = "oma_session"
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def now_us() -> int:
    return time.time_ns() // 1000


def new_session_id() -> str:
    """`ses_` + a ULID (48-bit milliseconds + 80 random bits, Crockford base32): time-ordered."""
    value = ((time.time_ns() // 1_000_000) << 80) | secrets.randbits(80)
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return "ses_" + "".join(reversed(chars))


def format_time_us(us: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(us / 1e6)) + f".{us % 1_000_000:06d}Z"


@dataclass
class SessionState:
    """A session row: what the servicer reports and what decides pending-ness."""

    pk: int
    id: str
    definition: bytes
    status: int
    stop_reason: int
    last_seq: int
    last_user_seq: int
    last_idle_seq: int
    create_time_us: int
    update_time_us: int
    lease_holder: str | None
    fencing_token: int
    lease_expire_us: int | None

    @classmethod
    def from_row(cls, row: Row[Any]) -> SessionState:
        return cls.from_mapping(row._mapping)

    @classmethod
    def from_mapping(cls, m: Any) -> SessionState:
        return cls(
            pk=m["pk"],
            id=m["id"],
            definition=m["definition"] if "definition" in m else b"",
            status=m["status"],
            stop_reason=m["stop_reason"],
            last_seq=m["last_seq"],
            last_user_seq=m["last_user_seq"],
            last_idle_seq=m["last_idle_seq"],
            create_time_us=m["create_time_us"],
            update_time_us=m["update_time_us"],
            lease_holder=m["lease_holder"],
            fencing_token=m["fencing_token"],
            lease_expire_us=m["lease_expire_us"],
        )

    def lease_live(self, at_us: int) -> bool:
        return self.lease_holder is not None and (self.lease_expire_us or 0) > at_us

    def needs_harness(self, at_us: int) -> bool:
        """Not terminated, no live lease, and unprocessed input or an abandoned turn."""
        if self.status == ev.STATUS_TERMINATED or self.lease_live(at_us):
            return False
        return self.last_user_seq > self.last_idle_seq or self.status in (
            ev.STATUS_RUNNING,
            ev.STATUS_RESCHEDULING,
        )


@dataclass
class LeaseGrant:
    session_id: str
    holder_id: str
    fencing_token: int
    expire_us: int


@dataclass
class AppendResult:
    seqs: list[int]
    last_seq: int
    replayed: bool


@dataclass
class Change:
    """What a committed write changed, for the hub: the session row after the write and, for
    an append, the stored events (serialized, seqs `first_seq`, `first_seq + 1`, ...)."""

    session_id: str
    state: SessionState
    first_seq: int = 0
    bodies: list[bytes] = field(default_factory=list)
    notified: bool = False  # PostgreSQL: NOTIFY already sent inside the transaction

    def events(self) -> list[events_pb2.Event]:
        return [events_pb2.Event.FromString(body) for body in self.bodies]


Listener = Callable[[Change], None]
T = TypeVar("T")

_PENDING_CONDITION = and_(
    sessions.c.status != ev.STATUS_TERMINATED,
    or_(
        sessions.c.last_user_seq > sessions.c.last_idle_seq,
        sessions.c.status.in_([ev.STATUS_RUNNING, ev.STATUS_RESCHEDULING]),
    ),
)


def _lease_free(at_us: int) -> Any:
    return or_(sessions.c.lease_holder.is_(None), sessions.c.lease_expire_us <= at_us)


class SessionStore:
    """Sessions, their logs and leases on one database. Async methods; each runs one
    transaction through `Database.write`/`read` and publishes its changes after commit."""

    def __init__(self, db: Database, limits: ev.Limits | None = None) -> None:
        self.db = db
        self.limits = limits or ev.Limits()
        self.origin = secrets.token_hex(6)  # tells this process's NOTIFYs from others'
        self._listeners: list[Listener] = []
        self._pk_cache: dict[str, int] = {}

        # The append hot path runs SQL text built once, through the driver with positional
        # parameters: no per-call statement compilation or per-row parameter processing.
        def marks(n: int, first: int = 1) -> str:
            if db.is_sqlite:
                return ", ".join("?" * n)
            return ", ".join(f"${i}" for i in range(first, first + n))

        self._marks = marks
        self._lock_columns = [c.name for c in sessions.columns if c.name != "definition"]
        columns = ", ".join(self._lock_columns)
        self._lock_sql = f"SELECT {columns} FROM oma_sessions WHERE id = {marks(1)}" + (
            "" if db.is_sqlite else " FOR UPDATE"
        )
        self._known_sql_pg = (
            "SELECT event_id, seq FROM oma_events WHERE session_pk = $1 AND event_id = ANY($2)"
        )
        self._insert_events = (
            f"INSERT INTO oma_events (session_pk, seq, event_id, type, body) VALUES ({marks(5)})"
        )
        names = (
            "last_seq",
            "status",
            "stop_reason",
            "last_user_seq",
            "last_idle_seq",
            "update_time_us",
            "lease_holder",
            "lease_expire_us",
            "pk",
        )
        assignments = ", ".join(
            f"{name} = {marks(1, i)}" for i, name in enumerate(names[:-1], start=1)
        )
        self._after_append_sql = (
            f"UPDATE oma_sessions SET {assignments} WHERE pk = {marks(1, len(names))}"
        )
        if not db.is_sqlite:
            # The NOTIFY rides the UPDATE's round trip (RETURNING runs once, for the one row).
            self._after_append_sql += f" RETURNING pg_notify('{NOTIFY_CHANNEL}', $10)"

    # -- plumbing ---------------------------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def _write(self, fn: Callable[[Connection, list[Change]], T]) -> T:
        """Run `fn` in one write transaction, then tell listeners what it changed. On SQLite
        transactions complete in commit order on one thread and resume here in that order, so
        listeners see changes in commit order; on PostgreSQL NOTIFY rides the transaction."""
        changes: list[Change] = []

        def transaction(conn: Connection) -> T:
            changes.clear()  # a retried transaction starts afresh
            result = fn(conn, changes)
            if not self.db.is_sqlite:
                for change in changes:
                    self._notify(conn, change)
            return result

        result = await self.db.write(transaction)
        self._publish(changes)
        return result

    def _publish(self, changes: list[Change]) -> None:
        for change in changes:
            for listener in self._listeners:
                listener(change)

    def _notify(self, conn: Connection, change: Change) -> None:
        if not change.notified:
            conn.exec_driver_sql(
                "SELECT pg_notify($1, $2)", (NOTIFY_CHANNEL, self._payload(change))
            )

    def _payload(self, change: Change) -> str:
        if change.bodies:
            last = change.first_seq + len(change.bodies) - 1
            payload = f"{self.origin} a {change.session_id} {change.first_seq} {last}"
        else:
            payload = f"{self.origin} l {change.session_id} 0 {change.state.last_seq}"
        return payload

    async def notify_preview(self, preview: Any) -> None:
        """Broadcast a preview to the other servers on PostgreSQL (no-op on SQLite)."""
        if self.db.is_sqlite:
            return
        payload = f"{self.origin} p - 0 0 {base64.b64encode(preview.SerializeToString()).decode()}"

        def send(conn: Connection) -> None:
            conn.execute(text("SELECT pg_notify(:c, :p)"), {"c": NOTIFY_CHANNEL, "p": payload})

        await self.db.write(send)

    def _lock_session(self, conn: Connection, session_id: str) -> SessionState:
        """The session row, locked until commit (PostgreSQL; SQLite holds the write lock)."""
        row = conn.exec_driver_sql(self._lock_sql, (session_id,)).first()
        if row is None:
            raise SessionNotFound(session_id)
        return SessionState.from_row(row)

    # -- sessions -----------------------------------------------------------------------------

    async def create_session(
        self, definition: definition_pb2.SessionDefinition, request_id: str
    ) -> tuple[SessionState, bool]:
        """Create a session (or return the one `request_id` created). Returns (state, created)."""
        blob = definition.SerializeToString(deterministic=True)
        digest = hashlib.sha256(blob).digest()

        def create(conn: Connection, changes: list[Change]) -> tuple[SessionState, bool]:
            if request_id:
                row = conn.execute(
                    select(sessions).where(sessions.c.request_id == request_id)
                ).first()
                if row is not None:
                    state = SessionState.from_row(row)
                    if row._mapping["definition_digest"] != digest:
                        raise RequestIdReused(request_id, state.id)
                    return state, False
            now = now_us()
            session_id = new_session_id()
            pk = conn.execute(
                sessions.insert()
                .values(
                    id=session_id,
                    request_id=request_id or None,
                    definition_digest=digest,
                    definition=blob,
                    status=ev.STATUS_IDLE,
                    stop_reason=0,
                    last_seq=1,
                    last_user_seq=0,
                    last_idle_seq=0,
                    create_time_us=now,
                    update_time_us=now,
                    lease_holder=None,
                    fencing_token=0,
                    lease_expire_us=None,
                )
                .returning(sessions.c.pk)
            ).scalar_one()
            if definition.labels:
                conn.execute(
                    session_labels.insert(),
                    [
                        {"session_pk": pk, "key": k, "value": v}
                        for k, v in definition.labels.items()
                    ],
                )
            first = events_pb2.Event(
                id="session.created",
                seq=1,
                type="session.created",
                session_created=events_pb2.SessionCreated(definition=definition),
            )
            first.create_time.FromMicroseconds(now)
            conn.execute(
                events.insert(),
                [
                    {
                        "session_pk": pk,
                        "seq": 1,
                        "event_id": first.id,
                        "type": first.type,
                        "body": first.SerializeToString(),
                    }
                ],
            )
            state = SessionState(
                pk=pk,
                id=session_id,
                definition=blob,
                status=ev.STATUS_IDLE,
                stop_reason=0,
                last_seq=1,
                last_user_seq=0,
                last_idle_seq=0,
                create_time_us=now,
                update_time_us=now,
                lease_holder=None,
                fencing_token=0,
                lease_expire_us=None,
            )
            changes.append(Change(session_id, state, 1, [first.SerializeToString()]))
            return state, True

        for attempt in range(2):
            try:
                state, created = await self._write(create)
            except IntegrityError:
                # A concurrent create with the same request_id won the race; read its result.
                if attempt or not request_id:
                    raise
                continue
            self._pk_cache[state.id] = state.pk
            return state, created
        raise AssertionError("unreachable")

    async def get_session(self, session_id: str) -> SessionState:
        def get(conn: Connection) -> Row[Any] | None:
            return conn.execute(select(sessions).where(sessions.c.id == session_id)).first()

        row = await self.db.read(get)
        if row is None:
            raise SessionNotFound(session_id)
        return SessionState.from_row(row)

    async def list_sessions(
        self, page_size: int, page_token: str, labels: dict[str, str]
    ) -> tuple[list[SessionState], str]:
        page_size = 50 if page_size <= 0 else min(page_size, 1000)
        fingerprint = _fingerprint("list", sorted(labels.items()))
        after_pk = _decode_token(page_token, fingerprint) if page_token else 0
        query = select(sessions).where(sessions.c.pk > after_pk)
        for key, value in labels.items():
            query = query.where(
                select(session_labels.c.session_pk)
                .where(
                    session_labels.c.session_pk == sessions.c.pk,
                    session_labels.c.key == key,
                    session_labels.c.value == value,
                )
                .exists()
            )
        query = query.order_by(sessions.c.pk).limit(page_size + 1)
        rows = await self.db.read(lambda conn: conn.execute(query).all())
        states = [SessionState.from_row(r) for r in rows[:page_size]]
        token = _encode_token(states[-1].pk, fingerprint) if len(rows) > page_size else ""
        return states, token

    # -- the log ------------------------------------------------------------------------------

    async def append(
        self,
        session_id: str,
        batch: ev.PreparedBatch,
        *,
        expected_last_seq: int | None,
        fencing_token: int,
    ) -> AppendResult:
        """Append a validated batch atomically, in the check order of [SESSION-APPEND-002..008].
        The decision is `_plan_append` (pure); around it, four statements: lock the session
        row, look the ids up, insert the events, update the row."""

        def plan(state: SessionState, known: dict[str, int]) -> _AppendPlan:
            return _plan_append(session_id, state, known, batch, expected_last_seq, fencing_token)

        if self.db.is_sqlite:

            def append(raw: sqlite3.Connection) -> _AppendPlan:
                # Straight on the writer thread's sqlite3 connection (BEGIN IMMEDIATE and
                # COMMIT around it): the writer holds the GIL for as little Python as
                # possible, since the event loop needs it too.
                row = raw.execute(self._lock_sql, (session_id,)).fetchone()
                if row is None:
                    raise SessionNotFound(session_id)
                state = SessionState.from_mapping(dict(zip(self._lock_columns, row, strict=True)))
                sql = (
                    "SELECT event_id, seq FROM oma_events WHERE session_pk = ? AND event_id IN "
                    f"({self._marks(len(batch.ids))})"
                )
                known: dict[str, int] = dict(raw.execute(sql, (state.pk, *batch.ids)).fetchall())
                decided = plan(state, known)
                if decided.change is not None:
                    raw.executemany(self._insert_events, decided.rows)
                    raw.execute(self._after_append_sql, decided.values)
                return decided

            decided = await self.db.write_sqlite(append, self._publish_plan)
            return decided.result

        async with self.db.asyncpg_transaction() as pg:
            row = await pg.fetchrow(self._lock_sql, session_id)
            if row is None:
                raise SessionNotFound(session_id)
            state = SessionState.from_mapping(dict(row.items()))
            known = {r[0]: r[1] for r in await pg.fetch(self._known_sql_pg, state.pk, batch.ids)}
            decided = plan(state, known)
            if decided.change is not None:
                await pg.executemany(self._insert_events, decided.rows)
                # The NOTIFY rides the UPDATE (RETURNING pg_notify), sent at commit.
                await pg.fetch(
                    self._after_append_sql, *decided.values, self._payload(decided.change)
                )
                decided.change.notified = True
        if decided.change is not None:
            self._publish([decided.change])
        return decided.result

    def _publish_plan(self, decided: _AppendPlan) -> None:
        # Runs in commit order (one writer thread, one loop callback per transaction).
        if decided.change is not None:
            self._publish([decided.change])

    def _pk(self, conn: Connection, session_id: str) -> int:
        pk = self._pk_cache.get(session_id)
        if pk is None:
            pk = conn.execute(select(sessions.c.pk).where(sessions.c.id == session_id)).scalar()
            if pk is None:
                raise SessionNotFound(session_id)
            if len(self._pk_cache) > 100_000:
                self._pk_cache.clear()
            self._pk_cache[session_id] = pk
        return pk

    async def read_events(
        self,
        session_id: str,
        *,
        after_seq: int = 0,
        before_seq: int = 0,
        limit: int = 100,
        descending: bool = False,
        types: Sequence[str] = (),
    ) -> list[tuple[int, bytes]]:
        """(seq, serialized Event) with after_seq < seq < before_seq (0: unbounded), in order."""

        def read(conn: Connection) -> list[tuple[int, bytes]]:
            pk = self._pk(conn, session_id)
            query = select(events.c.seq, events.c.body).where(
                events.c.session_pk == pk, events.c.seq > after_seq
            )
            if before_seq > 0:
                query = query.where(events.c.seq < before_seq)
            if types:
                query = query.where(events.c.type.in_(list(types)))
            query = query.order_by(events.c.seq.desc() if descending else events.c.seq)
            return [(r[0], r[1]) for r in conn.execute(query.limit(limit)).all()]

        return await self.db.read(read)

    async def get_events_page(
        self,
        session_id: str,
        *,
        after_seq: int,
        before_seq: int,
        page_size: int,
        descending: bool,
        types: Sequence[str],
        page_token: str,
    ) -> tuple[list[bytes], str]:
        """One page of GetEvents: serialized events and the next page token ("" at the end)."""
        page_size = 100 if page_size <= 0 else min(page_size, 1000)
        fingerprint = _fingerprint(
            "events", session_id, after_seq, before_seq, descending, sorted(set(types))
        )
        if page_token:
            position = _decode_token(page_token, fingerprint)
            if descending:
                before_seq = position
            else:
                after_seq = position
        rows = await self.read_events(
            session_id,
            after_seq=after_seq,
            before_seq=before_seq,
            limit=page_size + 1,
            descending=descending,
            types=types,
        )
        # A page also stops at a byte budget (at least one event), so it always fits in one
        # gRPC message whatever the events' sizes; the token then resumes after it.
        budget = self.limits.max_page_bytes
        count = 0
        used = 0
        for _, body in rows[:page_size]:
            if count and used + len(body) > budget:
                break
            used += len(body)
            count += 1
        more = count < len(rows)
        token = _encode_token(rows[count - 1][0], fingerprint) if more else ""
        return [body for _, body in rows[:count]], token

    # -- leases -------------------------------------------------------------------------------

    async def acquire_lease(self, session_id: str, holder_id: str, ttl_ms: int) -> LeaseGrant:
        def acquire(conn: Connection, changes: list[Change]) -> LeaseGrant:
            state = self._lock_session(conn, session_id)
            if state.status == ev.STATUS_TERMINATED:
                raise SessionTerminated(session_id)
            return _grant(conn, changes, state, holder_id, ttl_ms)

        return await self._write(acquire)

    async def claim_lease(self, holder_id: str, ttl_ms: int) -> LeaseGrant:
        """Lease any one session that needs a harness ([SESSION-LEASE-007]); concurrent claims
        skip each other's rows (`FOR UPDATE SKIP LOCKED`) instead of waiting or colliding."""

        def claim(conn: Connection, changes: list[Change]) -> LeaseGrant:
            query = (
                select(sessions)
                .where(_PENDING_CONDITION, _lease_free(now_us()))
                .order_by(sessions.c.update_time_us)
                .limit(1)
                .with_for_update(skip_locked=True)
            )
            row = conn.execute(query).first()
            if row is None:
                raise NoSessionPending()
            return _grant(conn, changes, SessionState.from_row(row), holder_id, ttl_ms)

        return await self._write(claim)

    async def renew_lease(self, session_id: str, fencing_token: int, ttl_ms: int) -> LeaseGrant:
        def renew(conn: Connection, changes: list[Change]) -> LeaseGrant:
            state = self._lock_session(conn, session_id)
            now = now_us()
            _check_fencing(state, fencing_token, now)
            state.lease_expire_us = now + ttl_ms * 1000
            conn.execute(
                update(sessions)
                .where(sessions.c.pk == state.pk)
                .values(lease_expire_us=state.lease_expire_us)
            )
            changes.append(Change(session_id, state))
            return LeaseGrant(
                session_id, state.lease_holder or "", state.fencing_token, state.lease_expire_us
            )

        return await self._write(renew)

    async def release_lease(self, session_id: str, fencing_token: int) -> None:
        def release(conn: Connection, changes: list[Change]) -> None:
            state = self._lock_session(conn, session_id)
            if state.lease_holder is None or state.fencing_token != fencing_token:
                return  # idempotent ([SESSION-LEASE-005])
            state.lease_holder = None
            state.lease_expire_us = None
            conn.execute(
                update(sessions)
                .where(sessions.c.pk == state.pk)
                .values(lease_holder=None, lease_expire_us=None)
            )
            changes.append(Change(session_id, state))

        await self._write(release)

    async def check_lease(self, session_id: str, fencing_token: int) -> SessionState:
        """The session, if `fencing_token` is its live lease (for previews); else LeaseLost."""
        state = await self.get_session(session_id)
        _check_fencing(state, fencing_token, now_us())
        return state

    # -- pending sessions ---------------------------------------------------------------------

    async def pending_sessions(self, limit: int = 10_000) -> list[tuple[str, int]]:
        """(id, last_seq) of sessions that need a harness now, oldest change first."""
        query = (
            select(sessions.c.id, sessions.c.last_seq)
            .where(_PENDING_CONDITION, _lease_free(now_us()))
            .order_by(sessions.c.update_time_us)
            .limit(limit)
        )
        rows = await self.db.read(lambda conn: conn.execute(query).all())
        return [(r[0], r[1]) for r in rows]

    async def live_leases(self) -> list[tuple[str, int]]:
        """(id, expire time) of sessions whose lease is live and that are not terminated."""
        query = select(sessions.c.id, sessions.c.lease_expire_us).where(
            sessions.c.lease_holder.is_not(None),
            sessions.c.lease_expire_us > now_us(),
            sessions.c.status != ev.STATUS_TERMINATED,
        )
        rows = await self.db.read(lambda conn: conn.execute(query).all())
        return [(r[0], r[1]) for r in rows]


def _grant(
    conn: Connection, changes: list[Change], state: SessionState, holder_id: str, ttl_ms: int
) -> LeaseGrant:
    now = now_us()
    if state.lease_live(now):
        if state.lease_holder != holder_id:
            raise LeaseHeld(
                state.id, state.lease_holder or "", format_time_us(state.lease_expire_us or 0)
            )
    else:
        state.fencing_token += 1
        state.lease_holder = holder_id
    state.lease_expire_us = now + ttl_ms * 1000
    conn.execute(
        update(sessions)
        .where(sessions.c.pk == state.pk)
        .values(
            lease_holder=state.lease_holder,
            fencing_token=state.fencing_token,
            lease_expire_us=state.lease_expire_us,
        )
    )
    changes.append(Change(state.id, state))
    return LeaseGrant(state.id, holder_id, state.fencing_token, state.lease_expire_us)


@dataclass
class _AppendPlan:
    result: AppendResult
    change: Change | None = None  # None: nothing to write (a replayed batch)
    rows: list[tuple[int, int, str, str, bytes]] = field(default_factory=list)
    values: tuple[Any, ...] = ()  # parameters of the session row UPDATE


def _plan_append(
    session_id: str,
    state: SessionState,
    known: dict[str, int],
    batch: ev.PreparedBatch,
    expected_last_seq: int | None,
    fencing_token: int,
) -> _AppendPlan:
    """Decide an append from the locked session row and the batch ids already in its log:
    the checks in contract order, then the rows to insert and the row's new values."""
    if known:
        if len(known) == len(batch.ids):
            return _AppendPlan(AppendResult([known[i] for i in batch.ids], state.last_seq, True))
        raise MixedBatch(
            [i for i in batch.ids if i in known], [i for i in batch.ids if i not in known]
        )
    if state.status == ev.STATUS_TERMINATED:
        raise SessionTerminated(session_id)
    if expected_last_seq is not None and expected_last_seq != state.last_seq:
        raise SequenceMismatch(expected_last_seq, state.last_seq)
    now = now_us()
    if batch.needs_lease:
        _check_fencing(state, fencing_token, now)
    first_seq = state.last_seq + 1
    # Each body gets its seq (field 2) and create_time (field 3) appended as wire fields:
    # protobuf parsers take fields in any order, so this is the complete Event.
    stamp = _timestamp_field(now)
    pk = state.pk
    rows = [
        (pk, seq, event_id, event_type, body + b"\x10" + _varint(seq) + stamp)
        for seq, event_id, event_type, body in zip(
            range(first_seq, first_seq + len(batch.ids)),
            batch.ids,
            batch.types,
            batch.bodies,
            strict=True,
        )
    ]
    state.last_seq = first_seq + len(rows) - 1
    state.update_time_us = now
    if batch.last_client_index >= 0:
        state.last_user_seq = first_seq + batch.last_client_index
    if batch.last_status_index >= 0:
        state.status = batch.last_status
        if batch.last_idle_index >= 0:
            state.last_idle_seq = first_seq + batch.last_idle_index
            state.stop_reason = batch.last_stop_reason
        if batch.last_status == ev.STATUS_TERMINATED:
            # A terminated session has no driver; its lease ends with it.
            state.lease_holder = None
            state.lease_expire_us = None
    values = (
        state.last_seq,
        state.status,
        state.stop_reason,
        state.last_user_seq,
        state.last_idle_seq,
        now,
        state.lease_holder,
        state.lease_expire_us,
        state.pk,
    )
    change = Change(session_id, state, first_seq, [row[4] for row in rows])
    result = AppendResult(list(range(first_seq, state.last_seq + 1)), state.last_seq, False)
    return _AppendPlan(result, change, rows, values)


def _check_fencing(state: SessionState, token: int, at_us: int) -> None:
    if token <= 0:
        raise LeaseLost(state.id, "no fencing token was given for harness events")
    if token != state.fencing_token:
        raise LeaseLost(state.id, f"fencing token {token} was superseded by {state.fencing_token}")
    if state.lease_holder is None:
        raise LeaseLost(state.id, f"the lease with fencing token {token} was released")
    if (state.lease_expire_us or 0) <= at_us:
        raise LeaseLost(
            state.id,
            f"the lease with fencing token {token} expired at "
            f"{format_time_us(state.lease_expire_us or 0)}",
        )


def _varint(value: int) -> bytes:
    # Seqs below 2**21 (three bytes) are the common case on the append path.
    if value < 0x80:
        return bytes((value,))
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    if value < 0x200000:
        return bytes((value & 0x7F | 0x80, (value >> 7) & 0x7F | 0x80, value >> 14))
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _timestamp_field(at_us: int) -> bytes:
    """`create_time` (field 3 of Event) as wire bytes: a google.protobuf.Timestamp."""
    seconds, micros = divmod(at_us, 1_000_000)
    stamp = b"\x08" + _varint(seconds)
    if micros:
        stamp += b"\x10" + _varint(micros * 1000)
    return b"\x1a" + _varint(len(stamp)) + stamp


def _fingerprint(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()[:8]


def _encode_token(position: int, fingerprint: bytes) -> str:
    raw = position.to_bytes(8, "big") + fingerprint
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_token(token: str, fingerprint: bytes) -> int:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (ValueError, TypeError):
        raise InvalidPageToken() from None
    if len(raw) != 16 or raw[8:] != fingerprint:
        raise InvalidPageToken()
    return int.from_bytes(raw[:8], "big")
