"""Images made in the test (PIL), and the data: URLs and request lines that carry them."""

from __future__ import annotations

import base64
import io

from PIL import Image

MEDIA = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


def image_bytes(
    fmt: str = "PNG", size: tuple[int, int] = (8, 6), color=(255, 0, 0), mode: str = "RGB", **save
) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, color).save(out, fmt, **save)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def png_url(size: tuple[int, int] = (8, 6), color=(255, 0, 0)) -> str:
    return data_url(image_bytes("PNG", size, color))
