"""A tokenizer's special tokens, and decoding that keeps the markers an output is read by.

Decoding an answer skips special tokens (end-of-turn, role headers). Some families write the markers bulkgen
reads an answer by as special tokens too: Kimi K2's tool-call section, some tokenizers' `<think>`. Skipped,
the call or the reasoning can no longer be found (vLLM turns `skip_special_tokens` off for such requests).
`keep_markers` decodes such an answer again with those markers kept and every other special token dropped.
"""

from __future__ import annotations

from functools import lru_cache


def special_tokens(tokenizer) -> set[str]:
    """Every token text the tokenizer has as special (its named ones and added tokens marked special)."""
    found = set(getattr(tokenizer, "all_special_tokens", ()))
    return found | {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}


def keep_markers(
    completions: list[dict], token_ids: list[list[int]], markers: tuple[str, ...], tokenizer
) -> None:
    """Decode again, in place, each completion whose tokens hold one of `markers` as a special token, with
    those kept (other special tokens still dropped). Nothing changes where the markers are plain text."""
    try:
        special, keep = _marker_ids(tokenizer, markers)
    except TypeError:  # a tokenizer class that cannot be hashed: worked out each time
        special, keep = _marker_ids.__wrapped__(tokenizer, markers)
    if not keep:
        return
    for completion, ids in zip(completions, token_ids, strict=True):
        if keep.isdisjoint(ids):
            continue
        kept = [t for t in ids if t in keep or t not in special]
        completion["text"] = tokenizer.decode(kept, skip_special_tokens=False)


@lru_cache(maxsize=16)
def _marker_ids(tokenizer, markers: tuple[str, ...]) -> tuple[frozenset[int], frozenset[int]]:
    """(every special token id, the ids of `markers` among them), once per tokenizer and marker set: the
    worker reads each finished request with them, on its step loop."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    special = {i for i, token in decoder.items() if token.special} | set(
        getattr(tokenizer, "all_special_ids", ())
    )
    keep = {i for i, token in decoder.items() if token.special and token.content in markers}
    return frozenset(special), frozenset(keep)
