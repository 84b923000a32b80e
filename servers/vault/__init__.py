"""The reference credential vault: encrypted credentials, session tokens, an injecting and
scrubbing HTTP proxy, git clones outside the sandbox, and an audit log.

The domain core (`oma.servers.vault.core.Vault`) knows nothing of gRPC; the servicer in
`oma.servers.vault.service` validates requests, calls the core and maps `VaultError`s to
status codes.
"""
