"""The design the code cites is in the repository: every `docs/architecture.md §N` in the package and the tests
names a section that exists, and nothing cites a design file outside the repository (`DESIGN.md`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
CITATION = re.compile(r"docs/architecture\.md §(\d+)")


def _sources() -> list[Path]:
    return sorted([*ROOT.joinpath("speculators").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py")])


def _sections() -> set[int]:
    return {int(m) for m in re.findall(r"^## (\d+)\. ", ARCHITECTURE.read_text(), flags=re.M)}


def test_every_citation_names_a_section() -> None:
    sections = _sections()
    assert sections, f"{ARCHITECTURE} has no numbered sections"
    broken = [f"{p.relative_to(ROOT)}: §{n}" for p in _sources() for n in CITATION.findall(p.read_text())
              if int(n) not in sections]
    assert not broken, "citations of missing sections:\n" + "\n".join(broken)


def test_nothing_cites_a_design_outside_the_repository() -> None:
    me = Path(__file__).resolve()
    outside = [str(p.relative_to(ROOT)) for p in _sources() if p.resolve() != me and "DESIGN" in p.read_text()]
    assert not outside, f"cite docs/architecture.md instead of DESIGN: {outside}"
