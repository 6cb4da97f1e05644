"""A rough, honest test of "reads as English": mostly letters, and common English words among them."""

from __future__ import annotations

import re

COMMON = {"the", "a", "an", "is", "are", "of", "to", "and", "in", "that", "it", "be", "for", "as", "with", "or",
          "this", "by", "on", "can", "not", "if", "you", "from", "which", "when"}


def english_score(text: str) -> float:
    """Share of words that are common English function words (about 0.3-0.5 for English prose)."""
    words = re.findall(r"[A-Za-z']+", text.lower())
    return sum(w in COMMON for w in words) / max(1, len(words))


def looks_like_english(text: str) -> bool:
    letters = sum(c.isalpha() or c.isspace() or c in ".,;:'\"()-" for c in text)
    return len(text.strip()) > 0 and letters / len(text) >= 0.85 and english_score(text) >= 0.15
