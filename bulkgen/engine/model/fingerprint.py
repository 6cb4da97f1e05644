"""system_fingerprint: one stable hash of what decides an engine's tokens, the same on every worker of a batch.

It covers the checkpoint (its small files' bytes: config, generation_config, tokenizer and chat template; its
weight files' names and sizes, not their bytes, which would mean reading gigabytes at every load), the
tokenizer's class, size and chat template as loaded, the engine's dtype and quantization, bulkgen's version,
and the settings that change tokens (KV-cache dtype, tensor parallelism, context length, the
generation_config defaults applied; a batch adds its model's default chat-template options). Nothing of the machine (paths, times, devices) enters it, so workers
that load the same checkpoint with the same settings answer the same fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
MAX_HASHED_BYTES = 64 << 20  # a larger non-weight file counts by name and size, as the weights do


def checkpoint_files(path: str | None) -> list[tuple[str, int, str]]:
    """(name, size, sha256 of the bytes or "" for a weight file) of each file of the checkpoint folder."""
    if not path or not Path(path).is_dir():
        return []
    out = []
    for item in sorted(Path(path).rglob("*")):
        if not item.is_file() or any(part.startswith(".") for part in item.relative_to(path).parts):
            continue
        size = item.stat().st_size
        weight = item.name.endswith(WEIGHT_SUFFIXES) or size > MAX_HASHED_BYTES
        digest = "" if weight else hashlib.sha256(item.read_bytes()).hexdigest()
        out.append((item.relative_to(path).as_posix(), size, digest))
    return out


def system_fingerprint(path: str | None, tokenizer, settings: dict) -> str:
    """ "fp_" and 12 hex digits of the hash of the checkpoint at `path`, the tokenizer and `settings`."""
    from bulkgen import __version__

    template = getattr(tokenizer, "chat_template", None)
    record = {
        "bulkgen": __version__,
        "checkpoint": checkpoint_files(path),
        "tokenizer": [type(tokenizer).__name__, len(tokenizer) if tokenizer is not None else 0, template],
        "settings": settings,
    }
    blob = json.dumps(record, sort_keys=True, default=str).encode()
    return "fp_" + hashlib.sha256(blob).hexdigest()[:12]


def with_template_options(fingerprint: str, options: dict) -> str:
    """The fingerprint of a batch whose model has default chat-template options (--chat-template-kwargs): they
    change its prompts, so its tokens; the engine's own fingerprint where there are none."""
    if not options:
        return fingerprint
    blob = json.dumps([fingerprint, options], sort_keys=True, default=str).encode()
    return "fp_" + hashlib.sha256(blob).hexdigest()[:12]
