"""The OMA conformance suite: checks any server against the contract's requirements.

Requirements are data (`requirements.json`, derived from the proto comments by
`scripts/gen_protos.py`); each check cites the requirement ids it enforces and inherits their
level. MUST failures fail the run, SHOULD failures are reported, and checks that need an
optional feature run only when the target's `GetCapabilities` advertises it.

    oma conformance --session ADDR [--sandbox ADDR] [--vault ADDR] [--harness ADDR] \
        --tokens tokens.json [--junit report.xml] [--json report.json]
"""
