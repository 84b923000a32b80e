"""The reference session service: a durable, append-only event log per session.

`store.SessionStore` is the domain core (SQLAlchemy, SQLite or PostgreSQL; no gRPC);
`hub.Hub` fans new events, previews and pending sessions out to live watchers;
`servicer.SessionServicer` maps the gRPC contract `oma.session.v1.SessionService` onto both.
"""
