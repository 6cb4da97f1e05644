"""Images' section of the tensor-parallel step plan (step_features.PlanSection): what a follower, which has no
encoder, needs to splice the image rows rank 0 broadcasts (multimodal.splice), place M-RoPE positions and
plan image blocks (image_blocks.step_blocks) for each sequence of a step. A VisionTower registers it with its
rank group; a step without images sends nothing.
"""

from __future__ import annotations

import torch

from bulkgen.engine.step_features import PlanSection


class ImagesSection(PlanSection):
    name = "images"

    def encode(self, batch: list) -> list[int]:
        fields = [_images_fields(seq, n) for seq, n in batch]
        if all(len(f) == 1 for f in fields):  # text-only steps send nothing
            return []
        return [x for f in fields for x in f]

    def decode(self, ints: list[int], batch: list) -> None:
        at = 0
        for stand_in, n in batch:
            stand_in.request.seqs = ()  # splice's check that every sequence is past its images: vacuous here
            stand_in.request.images, at = _read_images(ints, at, n) if ints else (None, at)


def _images_fields(seq, n: int) -> list[int]:
    """What a follower needs of a sequence's images for a step computing `n` tokens (multimodal.splice,
    mrope_positions, image_blocks.step_blocks): [0] without images; else 1, its first and last image
    positions, the image positions inside this chunk, the image blocks it reaches, and its M-RoPE
    positions [3, n] where the model has them. The image rows themselves follow by broadcast."""
    images = getattr(seq.request, "images", None)
    if images is None:
        return [0]
    start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
    rows = [r for r in images.rows if start <= r < end]
    blocks = [x for lo, hi in images.blocks if lo < end and hi > start for x in (lo, hi)]
    fields = [1, images.first_row, images.last_row, len(rows), *rows, len(blocks) // 2, *blocks]
    if images.mrope is None:
        return [*fields, 0]
    return [*fields, 1, *images.mrope_rows(start, n).reshape(-1).tolist()]


def _read_images(flat: list[int], at: int, n: int) -> tuple[ImagesStandIn | None, int]:
    """One sequence's `_images_fields` from `at` (`n`: its tokens this step): its stand-in and the end."""
    if not flat[at]:
        return None, at + 1
    first, last, k = flat[at + 1 : at + 4]
    rows, at = flat[at + 4 : at + 4 + k], at + 4 + k
    b = flat[at]
    bounds, at = flat[at + 1 : at + 1 + 2 * b], at + 1 + 2 * b
    mrope = None
    if flat[at]:
        mrope = torch.tensor(flat[at + 1 : at + 1 + 3 * n], dtype=torch.int64).reshape(3, n)
        at += 3 * n
    blocks = list(zip(bounds[::2], bounds[1::2], strict=True))
    return ImagesStandIn(first, last, rows, blocks, mrope), at + 1


class ImagesStandIn:
    """A follower's view of a sequence's images for one step: where its image tokens are (within this
    chunk), the image blocks the chunk reaches and its M-RoPE positions; never its embeddings, which rank
    0 sends (multimodal._image_rows)."""

    def __init__(self, first: int, last: int, rows: list[int], blocks: list, mrope) -> None:
        self.first_row, self.last_row, self.rows, self.blocks = first, last, rows, blocks
        self.mrope, self.embeds = mrope, None

    def mrope_rows(self, start: int, n: int) -> torch.Tensor:
        return self.mrope
