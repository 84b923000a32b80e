"""Importing this package registers every conformance check."""

from oma.conformance.checks import common, session  # noqa: F401
