"""Reports: a console summary, JSON rolled up per requirement, and JUnit XML for CI."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from oma.conformance.runner import Outcome, Result


def console(results: list[Result]) -> str:
    lines = []
    for r in results:
        mark = {"pass": "PASS", "fail": "FAIL", "error": "ERR ", "skip": "SKIP"}[r.outcome.value]
        ids = ",".join(r.check.requirement_ids)
        line = f"{mark} {r.check.level.value:<6} {r.check.name}  [{ids}]"
        if r.detail:
            line += f"\n       {r.detail.splitlines()[0] if r.detail else ''}"
        lines.append(line)
    counts = Counter(r.outcome.value for r in results)
    must_failures = sum(r.blocks_run for r in results)
    lines.append(f"{counts['pass']} passed, {counts['fail'] + counts['error']} failed, "
                 f"{counts['skip']} skipped ({must_failures} MUST failures)")
    return "\n".join(lines)


def by_requirement(results: list[Result]) -> dict[str, dict[str, object]]:
    """Each requirement's verdict: failed if any check citing it failed."""
    rollup: dict[str, dict[str, object]] = {}
    for r in results:
        for req in r.check.requirements:
            entry = rollup.setdefault(req.id, {"level": req.level.value, "source": req.source,
                                               "checks": [], "outcome": "pass"})
            entry["checks"].append({"name": r.check.name, "outcome": r.outcome.value,  # type: ignore[attr-defined]
                                    "detail": r.detail})
            if r.outcome in (Outcome.FAIL, Outcome.ERROR):
                entry["outcome"] = "fail"
            elif r.outcome == Outcome.SKIP and entry["outcome"] == "pass":
                entry["outcome"] = "skip"
    return rollup


def write_json(results: list[Result], path: Path) -> None:
    path.write_text(json.dumps({"requirements": by_requirement(results)}, indent=2))


def write_junit(results: list[Result], path: Path) -> None:
    suites = ET.Element("testsuites", name="oma-conformance")
    for service in sorted({r.check.service for r in results}):
        mine = [r for r in results if r.check.service == service]
        suite = ET.SubElement(suites, "testsuite", name=f"oma.{service}", tests=str(len(mine)),
                              failures=str(sum(r.outcome == Outcome.FAIL for r in mine)),
                              errors=str(sum(r.outcome == Outcome.ERROR for r in mine)),
                              skipped=str(sum(r.outcome == Outcome.SKIP for r in mine)))
        for r in mine:
            case = ET.SubElement(suite, "testcase", classname=f"oma.{service}",
                                 name=r.check.name, time=f"{r.seconds:.3f}")
            props = ET.SubElement(case, "properties")
            for req in r.check.requirements:
                ET.SubElement(props, "property", name="requirement",
                              value=f"{req.id} {req.level.value} {req.source}")
            if r.outcome == Outcome.SKIP:
                ET.SubElement(case, "skipped", message=r.detail)
            elif r.outcome in (Outcome.FAIL, Outcome.ERROR):
                tag = "failure" if r.outcome == Outcome.FAIL else "error"
                element = ET.SubElement(case, tag, message=r.detail.splitlines()[0] if r.detail else tag)
                element.text = r.detail
    ET.ElementTree(suites).write(path, encoding="unicode", xml_declaration=True)
