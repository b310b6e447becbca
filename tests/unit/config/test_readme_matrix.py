"""The architecture x layout table of docs/strategies-and-layouts.md (the README links to it) is the one the test
matrix runs (tests/archs.py renders both)."""
from __future__ import annotations

from tests.archs import ARCHITECTURES, LAYOUTS, REFUSED, REFUSED_WHY, support_table
from tests.conftest import REPO


DOC = REPO / "docs" / "strategies-and-layouts.md"


def test_readme_table_is_the_matrix():
    text = DOC.read_text()
    begin, end = "<!-- architecture matrix: begin -->\n", "\n<!-- architecture matrix: end -->"
    assert begin in text and end in text
    table = text.split(begin, 1)[1].split(end, 1)[0]
    assert table == support_table(), (f"{DOC.relative_to(REPO)}'s architecture table is stale: paste "
                                     f"tests.archs.support_table()")


def test_matrix_definition_is_consistent():
    assert set(REFUSED) == set(REFUSED_WHY)
    assert all(arch in ARCHITECTURES and layout in LAYOUTS for arch, layout in REFUSED)
    assert len(ARCHITECTURES) >= 10
