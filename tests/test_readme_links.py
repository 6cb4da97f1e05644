"""The README is the landing page: every relative link in it reaches a file of the repository (the docs
pages link among themselves under `mkdocs build --strict`, which CI runs)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_readme_relative_links_reach_files():
    links = relative_links((ROOT / "README.md").read_text())
    assert any(link.startswith("docs/") for link in links), "the README links to no docs page"
    missing = [link for link in links if not (ROOT / link.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
