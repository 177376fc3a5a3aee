"""Every relative link in README.md and docs/*.md points at a file of the repository (paths moved with the
``ddtree_serve`` namespace once; a stale link is caught here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    broken = [m for m in LINK.findall(doc.read_text()) if "://" not in m and not (doc.parent / m).exists()]
    assert not broken, f"{doc.name}: broken links {broken}"
