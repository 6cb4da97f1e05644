"""`bulkgen plan`'s scan of image lines: a vision model's processor counts each image's placeholder tokens
exactly, the prefix cache shares an image's blocks only with the same image, and a text model counts image
lines as refused (its workers answer them with a 400)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoProcessor, AutoTokenizer

from bulkgen.plan.filework import ImageReader, file_work
from tests.support.images import image_tokens, text_tokens

SAMPLE = Path(__file__).resolve().parents[2] / "samples" / "vision.jsonl"
ROWS = [json.loads(line) for line in SAMPLE.read_text().splitlines()]


@pytest.fixture(scope="module")
def vlm(vlm_path):
    path = vlm_path
    return AutoTokenizer.from_pretrained(path), AutoProcessor.from_pretrained(path, local_files_only=True)


def _scan(tokenizer, images: ImageReader | None, block_size: int = 16):
    return file_work(
        SAMPLE, "/v1/chat/completions", "tiny-vlm", tokenizer, 2048, 100, block_size, images=images
    )


def test_image_tokens_are_counted_by_the_processor(vlm):
    tokenizer, processor = vlm
    work = _scan(tokenizer, ImageReader(processor))
    per_image = image_tokens(processor)
    expected = [
        text_tokens(processor, row)
        + per_image
        * sum(
            part.get("type") == "image_url"
            for m in row["body"]["messages"]
            for part in m["content"]
            if isinstance(m["content"], list)
        )
        for row in ROWS
    ]
    assert (work.refused, work.images, list(work.prompt_tokens)) == (0, 8, expected)
    assert expected[5] == text_tokens(processor, ROWS[5]) + 2 * per_image  # compare-two: two images


def test_the_prefix_cache_shares_an_image_only_with_the_same_image(vlm):
    tokenizer, processor = vlm
    work = _scan(tokenizer, ImageReader(processor), block_size=2)
    first, same, other = (work.prompt_tokens[i] - work.uncached_tokens[i] for i in (0, 1, 2))
    # lines 0 and 1 open with the same red square, line 2 with a blue circle: the same tokens before the
    # question (role header and placeholders), a cache hit only for the same pixels
    assert first == 0 and same >= image_tokens(processor) and other < same


def test_a_text_model_counts_image_lines_as_refused(vlm):
    tokenizer, _ = vlm
    work = _scan(tokenizer, None)
    assert work.refused == 7 and len(work.prompt_tokens) == 1  # only the text-only line runs
