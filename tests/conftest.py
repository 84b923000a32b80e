"""Fixtures shared by every test area.

Engines the tests need (PostgreSQL, Docker, bubblewrap) are real. `.ci/run` installs and
starts them; on a developer machine without one, the tests that need it are skipped — but
under CI (`CI=true`) a missing engine is a failure, never a silent skip.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

# Admin DSN of the local PostgreSQL that .ci/run starts (role `oma`, password `oma`).
PG_ADMIN_DSN = os.environ.get("OMA_TEST_PG_DSN", "postgresql://oma:oma@127.0.0.1:5432/postgres")
SANDBOX_IMAGE = os.environ.get("OMA_SANDBOX_IMAGE", "oma-sandbox:latest")


def require(condition: bool, what: str) -> None:
    """Skip locally when an engine is missing; fail under CI, where .ci/run provides it."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{what} is required in CI but is not available", pytrace=False)
    pytest.skip(f"{what} is not available on this machine")


def _pg_reachable() -> bool:
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN_DSN, connect_timeout=3):
            return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def pg_available() -> bool:
    return _pg_reachable()


@pytest.fixture
def pg_database(pg_available: bool) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test; yields its plain libpq URL
    (`postgresql://user:pw@host:port/db`). Callers pick their driver prefix, e.g.
    `url.replace("postgresql://", "postgresql+asyncpg://", 1)`."""
    require(pg_available, "PostgreSQL")
    import psycopg

    name = f"oma_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base, _, _ = PG_ADMIN_DSN.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def docker_client():  # type: ignore[no-untyped-def]
    """A Docker SDK client for the local engine, with the sandbox image present."""
    try:
        import docker

        client = docker.from_env(timeout=30)
        client.ping()
    except Exception:
        client = None
    require(client is not None, "a Docker engine")
    assert client is not None
    try:
        client.images.get(SANDBOX_IMAGE)
        has_image = True
    except Exception:
        has_image = False
    require(has_image, f"the sandbox image {SANDBOX_IMAGE} (build it: oma sandbox build-image)")
    yield client
    client.close()


@pytest.fixture(scope="session")
def bwrap_path() -> str:
    path = shutil.which("bwrap")
    require(path is not None, "bubblewrap (bwrap)")
    assert path is not None
    return path
