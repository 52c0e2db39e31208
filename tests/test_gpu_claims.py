"""Claims no stronger than the data (issue 37): every paragraph of the README and the docs that
speaks of the H100 cites a row of a committed JSON (a link whose text is the row's id and whose
target is the file under bench/results/), or says plainly that its raw outputs were not kept, or
is marked as no measurement at all (an example that names the card); and every citation names a
row its file has. The H100 table of docs/measurements.md is the stored measurement's."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.docs_text import ROOT, section

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A link to one of the committed files of GPU data, whose text is a row's id.
CITATION = re.compile(r"\[(?P<id>[^\]]+)\]\((?P<target>[^)\s]*bench/results/(?P<file>\w*h100\w*\.json))\)")
NOT_KEPT = "raw outputs not kept"
NO_MEASUREMENT = "<!-- not a GPU measurement"


def _paragraphs(path: Path) -> list[str]:
    """The page's paragraphs of prose: no code blocks, headings or tables."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    found = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if not line.lstrip().startswith(("#", "|"))]
        if lines:
            found.append("\n".join(lines))
    return found


@functools.cache
def _rows(file: str) -> set[str]:
    document: dict[str, Any] = json.loads((ROOT / "bench" / "results" / file).read_text())
    if "rows" in document:
        return {row["id"] for row in document["rows"]}
    return {case["case"] for case in document["cases"]}


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_paragraph_about_the_h100_cites_a_committed_row(page: Path) -> None:
    uncited = [
        p[:160]
        for p in _paragraphs(page)
        if "H100" in p and NO_MEASUREMENT not in p and NOT_KEPT not in p and not CITATION.search(p)
    ]
    assert not uncited, f"{page.name}: paragraphs about the H100 with no row cited:\n" + "\n---\n".join(uncited)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_citation_names_a_row_of_its_file(page: Path) -> None:
    for found in CITATION.finditer(page.read_text(encoding="utf-8")):
        assert (page.parent / found["target"]).resolve() == ROOT / "bench" / "results" / found["file"], found[0]
        assert found["id"] in _rows(found["file"]), f"{page.name}: {found['file']} has no row {found['id']!r}"


def test_the_h100_table_is_the_stored_measurement() -> None:
    """docs/measurements.md's table of this version on the H100, row by row against its JSON."""
    text = section("docs/measurements.md", "On a real GPU: this version on an H100")
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    cases = json.loads((ROOT / "bench" / "results" / "cuda_truth_h100.json").read_text())["cases"]
    assert len(rows) == len(cases)
    for row, case in zip(rows, cases, strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        if case["case"].startswith("gpt"):
            assert cells[1] == f"{case['max_micro_batch']} / {case['max_micro_batch_without_accumulation']}", row
        else:
            assert cells[1].startswith(f"{case['max_micro_batch']} in its loops"), row
        assert cells[2] == str(case["trials"]), row
        assert cells[4] == ("yes" if case["holds"] else "no"), row
        assert cells[5].startswith("yes" if case["exact"] else "no"), row
        steps = {r["steps"] for r in case["runs"] if r.get("steps")}
        assert f"({steps.pop()})" in cells[0] and not steps, row
