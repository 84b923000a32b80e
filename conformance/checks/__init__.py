"""Importing this package registers every conformance check."""

from oma.conformance.checks import common, harness, sandbox, session, vault  # noqa: F401
