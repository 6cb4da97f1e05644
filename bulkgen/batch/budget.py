"""A request's size without the model's tokenizer: what the driver, the line index and the admission
estimate count before any worker has tokenized it (`bulkgen plan` counts exactly, with the tokenizer)."""

from __future__ import annotations

from bulkgen.batch.messages import content_text

IMAGE_TOKENS_GUESS = 576  # an image's prompt tokens without its processor (LLaVA's 24x24 patches)
UNKNOWN_MAX_TOKENS = 512  # a request without max_tokens runs to the context end: guess it is long
MAX_WORK_TOKENS = 1 << 24  # more than any context: a longer max_tokens is refused by its worker anyway


def prompt_estimate(request) -> int:
    """Prompt tokens without the tokenizer (the driver has none): about 4 characters a token, and
    IMAGE_TOKENS_GUESS per image."""
    if request.messages is not None:
        text = sum(len(content_text(m["content"])) for m in request.messages) // 4
        return text + IMAGE_TOKENS_GUESS * len(request.images)
    if isinstance(request.prompt, list):
        return len(request.prompt)
    return len(request.prompt or "") // 4


def output_budget(request) -> tuple[int, int]:
    """(max_tokens, sequences): max_tokens clipped to MAX_WORK_TOKENS, UNKNOWN_MAX_TOKENS when not given."""
    max_tokens = request.sampling.get("max_tokens")
    max_tokens = UNKNOWN_MAX_TOKENS if max_tokens is None else min(max_tokens, MAX_WORK_TOKENS)
    return max_tokens, max(request.sampling.get("n") or 1, request.sampling.get("best_of") or 1)
