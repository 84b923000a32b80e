"""The shared server runtime every OMA reference server is built on.

Modules and what each promises:

- `oma.runtime.server`: `start_server([Service, ...], ServerOptions) -> RunningServer` —
  `grpc.aio`, health checking and reflection (no token needed), TLS/mTLS, per-method role
  checks, error mapping, limits, keepalive and graceful shutdown ([COMMON-SHUTDOWN-001]);
  `run_until_signal(running)` (a second signal ends calls at once); `running.set_serving()`;
  `shutting_down()` / `is_shutting_down()` for handlers.
- `oma.runtime.errors`: `OmaError(code, reason, message, metadata)` → status + `ErrorInfo`
  (domain `oma.dev`); `error_info(rpc_error)` decodes it on the client ([COMMON-ERR-001]).
- `oma.runtime.auth`: `TokenTable` (role → bearer token, JSON file, 0600), the rule each
  method declares with `(oma.common.v1.auth)`, and `current_role()` ([COMMON-AUTH-001]).
- `oma.runtime.trace`: W3C trace context; `current()` inside a handler ([COMMON-TRACE-001]).
- `oma.runtime.client`: `connect(address, token=..., tls=ClientTls(...))` → an `OmaChannel`
  (a `grpc.aio.Channel`) that sends the token and passes trace context on.
- `oma.runtime.cli`: the common `oma serve X` flags, `server_options_from_args`, `announce`,
  `serve`.
- `oma.runtime.paths`: `data_dir()` (`$OMA_HOME`, default `~/.oma`), the default token file.

Submodules are imported explicitly (`from oma.runtime.server import start_server`), so that
importing `oma.runtime` stays cheap.
"""
