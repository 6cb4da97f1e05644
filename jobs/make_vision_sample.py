"""Write samples/vision.jsonl: a small captioning and classification batch whose images ride inline as data:
URLs (PNG, JPEG, WebP and GIF, drawn here, a few hundred bytes each), so it runs anywhere with no image host.

    python jobs/make_vision_sample.py            # rewrites samples/vision.jsonl (deterministic)

The lines are chat lines for a model served as `tiny-vlm` (docs/vision.md builds one): one image and a
question, two images in one message, the same image twice with different questions (a prefix-cache hit),
a `detail: low` part and a text-only line beside them.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parents[1] / "samples" / "vision.jsonl"
MODEL = "tiny-vlm"
MEDIA = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


def shape(kind: str, color: str, fmt: str = "PNG", size: int = 32) -> str:
    """A `color` `kind` (square, circle, triangle) on white, as a data: URL of `fmt`."""
    image = Image.new("RGB", (size, size), "white")
    draw, box = ImageDraw.Draw(image), (6, 6, size - 6, size - 6)
    if kind == "circle":
        draw.ellipse(box, fill=color)
    elif kind == "triangle":
        draw.polygon([(size // 2, 4), (size - 4, size - 4), (4, size - 4)], fill=color)
    else:
        draw.rectangle(box, fill=color)
    out = io.BytesIO()
    image.save(out, fmt, **({"quality": 80} if fmt == "JPEG" else {}))
    return f"data:{MEDIA[fmt]};base64,{base64.b64encode(out.getvalue()).decode()}"


def line(custom_id: str, *content, max_tokens: int = 24, system: str | None = None) -> dict:
    parts = [
        {"type": "text", "text": c} if isinstance(c, str) else {"type": "image_url", "image_url": c}
        for c in content
    ]
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": parts if len(parts) > 1 else content[0]})
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def rows() -> list[dict]:
    red_square = {"url": shape("square", "red")}
    return [
        line("caption-red-square", red_square, "Describe this picture in one sentence."),
        line("colour-red-square", red_square, "What colour is the shape?", max_tokens=8),
        line("caption-blue-circle", {"url": shape("circle", "blue", "JPEG")}, "Describe this picture."),
        line("caption-green-triangle", {"url": shape("triangle", "green", "WEBP")}, "What shape is this?"),
        line(
            "caption-gif", {"url": shape("circle", "orange", "GIF"), "detail": "low"}, "Describe it briefly."
        ),
        line(
            "compare-two",
            "Which of these two shapes is larger?",
            {"url": shape("square", "purple", size=24)},
            {"url": shape("circle", "purple", size=40)},
        ),
        line(
            "classify",
            {"url": shape("triangle", "black")},
            "Label the image as one of: square, circle, triangle. Answer with the label.",
            system="You label images of shapes.",
            max_tokens=4,
        ),
        line("text-only", "Name three shapes.", max_tokens=16),
    ]


if __name__ == "__main__":
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")
