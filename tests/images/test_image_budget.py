"""The image memory budget's parts: what an image costs, judged from its header before any pixel is decoded;
validation refusing a line whose inline images alone cost more than a worker's budget; and the budget
itself (a line waits for room, tensors give their bytes back when freed). The worker under hostile lines:
tests/runtime/test_worker_image_memory.py."""

from __future__ import annotations

import gc
import threading

import pytest
from PIL import Image

from bulkgen.batch.image_budget import ImageBudget
from bulkgen.batch.images import (
    PROCESSING_BYTES_PER_PIXEL,
    ImageError,
    ImageRef,
    check_images,
    decoded_cost,
    start_reading,
)
from bulkgen.settings import ImageSettings
from tests.support.images import data_url, image_bytes

MIB = 1 << 20
HUGE = image_bytes("PNG", (7000, 7000), (10, 20, 30))  # 159 KB; 196 MB as Pillow holds it


def _ref(k: int, data: bytes = HUGE) -> ImageRef:
    return ImageRef(data_url(data), "auto", f"body.messages[0].content[{k}].image_url")


def test_an_image_is_costed_by_its_pixels_from_its_header_not_by_its_file_size():
    (future,) = start_reading([_ref(0)], store=None, policy=ImageSettings())
    probed = future.result()
    assert probed.image.size == (7000, 7000) and probed.image.mode == "RGB"
    assert probed.cost == len(HUGE) + 7000 * 7000 * (4 + PROCESSING_BYTES_PER_PIXEL)  # 748 MiB, not 159 KB
    assert decoded_cost(100, 100, "L") == 100 * 100 * 16  # processing as RGB dominates a 1-byte mode
    assert decoded_cost(100, 100, "RGBA") == 100 * 100 * 20  # the RGBA copy and white background on top
    assert decoded_cost(100, 100, "P", transparency=True) == 100 * 100 * 16


def test_validation_refuses_a_line_whose_inline_images_alone_exceed_a_workers_budget():
    policy = ImageSettings(image_memory_bytes=1024 * MIB)
    check_images([_ref(0)], store=None, policy=policy)  # one fits
    with pytest.raises(ImageError) as info:
        check_images([_ref(0), _ref(1), _ref(2)], store=None, policy=policy)
    assert (info.value.code, info.value.param) == ("image_too_large", "body.messages[0].content[1].image_url")
    assert (
        "7000x7000 pixels (RGB), 748 MiB once decoded and processed; with the line's images before it, "
        in (info.value.message)
    )
    assert "over a worker's image memory of 1,024 MiB (--image-memory-mb)" in info.value.message


def test_pils_decompression_bomb_guard_follows_the_pixel_limit():
    before = Image.MAX_IMAGE_PIXELS
    try:
        with pytest.raises(ImageError, match="the limit is 1,000 pixels"):
            check_images(
                [_ref(0, image_bytes("PNG", (40, 40)))],
                store=None,
                policy=ImageSettings(max_image_pixels=1000),
            )
        assert Image.MAX_IMAGE_PIXELS == 1000
    finally:
        Image.MAX_IMAGE_PIXELS = before


def test_a_hold_waits_for_room_and_tensors_give_their_bytes_back_when_freed():
    budget = ImageBudget(100)
    first = budget.acquire(60)
    assert budget.try_acquire(60) is None
    got = []
    waiter = threading.Thread(target=lambda: got.append(budget.acquire(60)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and budget.used == 60  # waits: 120 would not fit
    first.release()
    first.release()  # once only
    waiter.join(5)
    assert got and budget.used == 60

    class Tensors:  # stands for a request's ImageInputs
        pass

    tensors = Tensors()
    budget.add(30).until_freed(tensors)  # counted at once, never refused
    assert budget.used == 90 and budget.peak == 90
    del tensors
    gc.collect()
    assert budget.used == 60
    got[0].release()
    assert budget.used == 0 and budget.acquire(40, stop=lambda: True) is not None  # room: no wait, no stop


def test_a_wait_for_room_ends_when_its_batch_stops():
    budget = ImageBudget(100)
    budget.acquire(90)
    stopped = threading.Event()
    threading.Timer(0.3, stopped.set).start()
    assert budget.acquire(20, stop=stopped.is_set) is None
    assert budget.used == 90
