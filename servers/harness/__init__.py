"""The reference harness ("brain"): a stateless loop that drives sessions with a model.

Layout: `events` (the harness's view of log events), `conversation` (log → Messages request),
`tools` (which tools run where), `model` (the `anthropic` SDK call), `loop` (one turn, written
against the `ports` protocols), `grpc_ports` (those ports over the OMA services), `service`
(the `HarnessService` servicer) and `cli` (`oma serve harness`).
"""
