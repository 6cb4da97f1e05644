"""A rough test of "reads as English": mostly letters, digits and punctuation, and common English words.

The old random model's output ('\x12\ufffd5~rp5~rp') fails both; ordinary English prose passes."""

from __future__ import annotations

import re

COMMON = {
    "the",
    "a",
    "an",
    "is",
    "are",
    "of",
    "to",
    "and",
    "in",
    "that",
    "it",
    "be",
    "for",
    "as",
    "with",
    "or",
    "this",
    "by",
    "on",
    "can",
    "not",
    "if",
    "you",
    "from",
    "which",
    "when",
}


def english_score(text: str) -> float:
    """Share of words that are common English function words (about 0.3-0.5 for English prose)."""
    words = re.findall(r"[A-Za-z']+", text.lower())
    return sum(w in COMMON for w in words) / max(1, len(words))


def looks_like_english(text: str) -> bool:
    readable = sum(c.isalnum() or c.isspace() or c in ".,;:!?'\"()-" for c in text)  # not byte soup
    return len(text.strip()) > 0 and readable / len(text) >= 0.85 and english_score(text) >= 0.15
