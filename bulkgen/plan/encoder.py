"""A vision-language model's encoder in the throughput profile: what its images cost beyond the prompt.

The grid of bulkgen.plan.profile times steps over token prompts, so it never runs the vision encoder. In
the engine the encoder runs inside the step whose prefill reaches a request's images, one call for all of
that step's new images (bulkgen.engine.features.multimodal.VisionTower.encode). `measure_encoder` times that same
call on the engine thread, over seeded noise images of SIZES in groups of COUNTS, and fits

    encoder call seconds = encoder_call_s + per_image_s × images + per_image_token_s × image tokens

where an image's tokens are its placeholder tokens as the model's processor expands it (what drives the
encoder: its patches, merged or not). A processor that resizes every image to one size (LLaVA's) gives
every image the same tokens: per_image_token_s is then 0 and per_image_s carries it all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from bulkgen.plan.fit import nonnegative_lstsq

SIZES = ((224, 224), (448, 336))  # two sizes: a dynamic-resolution processor (Qwen-VL) gives two token counts
COUNTS = (1, 2, 4)  # images per encoder call
REPEATS = 3
PROMPT = "Describe this image."


@dataclass(frozen=True)
class EncoderCost:
    """Fitted seconds of one encoder call: fixed, per image, per image token (Profile's fields of the same
    names)."""

    encoder_call_s: float
    per_image_s: float
    per_image_token_s: float


def measure_encoder(engine) -> EncoderCost | None:
    """The encoder's cost on `engine`'s device (None for a text model): torch work, so on the thread that
    runs the engine's steps (profile.measure_here)."""
    tower = engine.vision
    if tower is None:
        return None
    rng = np.random.default_rng(0)
    samples = [(width, height, _admit(tower, rng, width, height)) for width, height in SIZES]
    _timed(engine, tower, [samples[0][2]])  # warm-up: the first call is slower than the rest
    rows = []
    for _ in range(REPEATS):
        for width, height, _ in samples:
            for count in COUNTS:
                group = [_admit(tower, rng, width, height) for _ in range(count)]
                rows.append((count, sum(len(r.rows) for r in group), _timed(engine, tower, group)))
    return fit_encoder(rows)


def fit_encoder(rows: list[tuple[int, int, float]]) -> EncoderCost:
    """(images, image tokens, seconds) of each timed call -> EncoderCost, each cost kept >= 0; the token
    term only where image token counts differ (otherwise it cannot be told from the per-image one)."""
    images, tokens, seconds = (np.array(c, float) for c in zip(*rows, strict=True))
    varies = len({t / i for i, t, _ in rows}) > 1
    columns = [np.ones_like(images), images, *([tokens] if varies else [])]
    coef = nonnegative_lstsq(np.stack(columns, 1), seconds)
    return EncoderCost(coef[0], coef[1], coef[2] if varies else 0.0)


def _admit(tower, rng: np.random.Generator, width: int, height: int):
    """One request of a chat prompt with one noise image, as the engine keeps it (its pixels processed)."""
    from PIL import Image

    from bulkgen.engine.features.multimodal import process

    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    content = [{"type": "image"}, {"type": "text", "text": PROMPT}]
    text = tower.processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    ids, inputs = process(tower.processor, text, [image])
    return tower.admit(ids, inputs)


def _timed(engine, tower, group: list) -> float:
    import torch

    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)

    sync()
    started = time.perf_counter()
    tower.encode(group)
    sync()
    return time.perf_counter() - started
