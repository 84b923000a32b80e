"""OMA — Open Managed Agents: gRPC contracts, reference servers and a conformance suite.

Installed layout (one package, one namespace):

- ``oma.common.v1``, ``oma.session.v1``, ``oma.sandbox.v1``, ``oma.vault.v1``,
  ``oma.harness.v1``: generated stubs (from ``gen/``).
- ``oma.runtime``: the server runtime every reference server is built on.
- ``oma.servers.<service>``: the reference servers (from ``servers/``).
- ``oma.conformance``, ``oma.bench``: the conformance suite and benchmarks.
- ``oma.cli``: the ``oma`` command.
"""

__version__ = "0.1.0"
