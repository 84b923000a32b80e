"""The reference harness ("brain"): a stateless loop that drives sessions with a model.

Layout: `events` (the harness's view of log events), `conversation` (log → Messages request,
turn state, budgets), `tools` (which tools run where), `model` (the `anthropic` SDK call),
`mcp_client` (MCP tools over streamable HTTP, through any POST transport), `loop` (one
turn, written against the `ports` protocols), `driver` (wakes → at most one turn
per session, lease renewal), `grpc_ports` (the ports over the OMA services), `service` (the
`HarnessService` servicer), `app` (assembling a server), `faults` (named crash points for
tests), `worker` / `worker_grpc` (worker mode) and `cli` (`oma serve harness`).

What survives a crash is only the session log: every step derives its event ids from what is
already in the log, so a step repeated by a successor harness writes nothing twice, and a tool
call is re-executed with the same execution id, which the sandbox runs at most once. MCP
has no execution id: an MCP call cut by a crash is sent again only when its server declares
the tool read-only or idempotent (HARNESS-MCP-002).
"""
