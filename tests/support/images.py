"""Images made in the test (PIL), and the data: URLs and request lines that carry them."""

from __future__ import annotations

import base64
import io

from PIL import Image

VLM = "tiny-vlm"  # the name the service tests serve lab/tiny_vision.py's LLaVA under (tests/service/conftest.py)
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


def image_tokens(processor) -> int:
    """Placeholder tokens a vision model's processor expands one image into (a fixed-size encoder)."""
    out = processor(text=processor.image_token, images=[Image.new("RGB", (8, 8))], add_special_tokens=False)
    return len(out["input_ids"][0])


def text_tokens(processor, row: dict) -> int:
    """A chat line's prompt tokens without its images: the chat template over its text parts alone."""
    messages = []
    for message in row["body"]["messages"]:
        content = message["content"]
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        messages.append({"role": message["role"], "content": content})
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
