"""OAuth 2.0 refresh-token grant (RFC 6749 section 6), run by the vault itself."""

from __future__ import annotations

import dataclasses
import time

import httpx

from oma.servers.vault.errors import VaultError
from oma.servers.vault.models import Secret

# Refresh a little before the recorded expiry so a token never expires in flight.
EXPIRY_SKEW_SECONDS = 30.0


def needs_refresh(secret: Secret, now: float | None = None) -> bool:
    if not secret.access_token:
        return True
    if secret.access_token_expires_at is None:
        return False
    return (now or time.time()) >= secret.access_token_expires_at - EXPIRY_SKEW_SECONDS


async def refresh(
    client: httpx.AsyncClient, secret: Secret, credential_id: str, time_limit: float
) -> Secret:
    """A copy of `secret` with a fresh access token (and refresh token, if rotated)."""
    if not secret.refresh_token or not secret.token_endpoint:
        raise VaultError(
            "REFRESH_FAILED",
            f"OAuth credential {credential_id!r} has no usable access token and no refresh "
            "token or token endpoint to get one; rotate it with a new access or refresh token",
        )
    form = {"grant_type": "refresh_token", "refresh_token": secret.refresh_token}
    if secret.client_id:
        form["client_id"] = secret.client_id
    if secret.scopes:
        form["scope"] = " ".join(secret.scopes)
    # Client authentication with HTTP basic when there is a client secret (RFC 6749 2.3.1).
    auth = httpx.BasicAuth(secret.client_id, secret.client_secret) if secret.client_secret else None
    try:
        response = await client.post(
            secret.token_endpoint,
            data=form,
            auth=auth if auth is not None else httpx.USE_CLIENT_DEFAULT,
            timeout=time_limit,
            headers={"Accept": "application/json"},
        )
    except httpx.HTTPError as exc:
        raise VaultError(
            "REFRESH_FAILED",
            f"refreshing OAuth credential {credential_id!r}: token endpoint unreachable "
            f"({type(exc).__name__})",
        ) from None
    # The body of a failed refresh may echo the refresh token or client secret: only the
    # status and the standard `error` code are reported.
    try:
        payload = response.json()
    except ValueError:
        payload = {}
    if (
        response.status_code != 200
        or not isinstance(payload, dict)
        or not payload.get("access_token")
    ):
        code = payload.get("error") if isinstance(payload, dict) else None
        code_text = f", error {code!r}" if isinstance(code, str) and code.isidentifier() else ""
        raise VaultError(
            "REFRESH_FAILED",
            f"refreshing OAuth credential {credential_id!r}: token endpoint answered HTTP "
            f"{response.status_code}{code_text}; rotate the credential with a new refresh token",
            {"http_status": str(response.status_code)},
        )
    expires_in = payload.get("expires_in")
    expires_at = time.time() + float(expires_in) if isinstance(expires_in, int | float) else None
    return dataclasses.replace(
        secret,
        access_token=str(payload["access_token"]),
        access_token_expires_at=expires_at,
        refresh_token=str(payload.get("refresh_token") or secret.refresh_token),
    )
