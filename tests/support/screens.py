"""Dashboard screenshots: saved under test-artifacts/dashboard/ (gitignored) once the page shows no leaked
JavaScript value."""

from __future__ import annotations

from pathlib import Path

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"


def shot(page, name: str) -> Path:
    """Save a screenshot, once the page shows no leaked JavaScript value."""
    text = page.locator("main").inner_text()
    for word in ("null", "undefined", "NaN", "[object"):
        assert word not in text, f"{name}: the page shows {word!r}:\n{text}"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
