"""A batch file as work: validated as a batch is, tokenized as its workers tokenize it, in one streamed pass.

Every line goes through the batch validator (bulkgen.batch.validate: the same errors, with their lines)
and, for each request it accepts, through the worker's own preparation (bulkgen.batch.prepare: the
model's chat template and tokenizer, `fit_context` resolving max_tokens as the runtime does; a vision
model's images read and expanded into their placeholder tokens by its processor). What a
worker would refuse (a prompt longer than the context, say) is counted as refused here too.

Memory: a read buffer, the validator's custom_id digests, six 32-bit ints per sequence (the simulator needs
every request's lengths and the images its encoder runs), and the hashes of prompt blocks seen (for the prefix-cache share; at most
MAX_BLOCK_HASHES, after which new blocks are assumed uncached).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bulkgen.batch.images import check_images, check_model_takes_images, load_images
from bulkgen.batch.prepare import fit_context, split_prompts, tokenize, tokenize_with_images
from bulkgen.batch.requests import LineError, ParsedRequest
from bulkgen.batch.validate import ValidationResult, Validator, validate_stream
from bulkgen.settings import ImageSettings
from bulkgen.store import Store

MAX_BLOCK_HASHES = 4_000_000


def _ints() -> array:
    return array("i")


@dataclass
class FileWork:
    """What a file asks of the engine, one entry per sequence the engine will run."""

    validation: ValidationResult
    # 32-bit arrays, 4 bytes a value (a list of ints takes ~40, a tuple ~60): `bulkgen plan` holds a whole
    # file's; a prompt or max_tokens is at most the model's context
    prompt_tokens: array = field(default_factory=_ints)  # the whole prompt (usage.input_tokens)
    uncached_tokens: array = field(default_factory=_ints)  # prefill's (prefix-cache hits removed)
    max_tokens: array = field(default_factory=_ints)  # as fit_context resolves it (0: embeddings)
    # what prefill computes without a prefix cache (hybrid models): every sequence its whole prompt
    sequence_prompts: array = field(default_factory=_ints)
    refused: int = 0  # lines their worker would answer with a 400
    images: int = 0  # images of the lines that run (their tokens are in prompt_tokens, from the processor)
    # per sequence, what the vision encoder runs: images and their placeholder tokens, 0 where a request
    # has none or the prefix cache holds them all (the engine then never reaches them)
    encoded_images: array = field(default_factory=_ints)
    encoded_tokens: array = field(default_factory=_ints)

    def arrays(self, prefix_caching: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(prompt tokens, tokens prefill computes, max tokens) per sequence; `prefix_caching` off: the
        engine shares no prompt block, between requests or between the `n` sequences of one."""
        return (
            np.array(self.prompt_tokens, np.int64),
            np.array(self.uncached_tokens if prefix_caching else self.sequence_prompts, np.int64),
            np.array(self.max_tokens, np.int64),
        )

    def encoded(self) -> tuple[np.ndarray, np.ndarray]:
        """(images, their placeholder tokens) the vision encoder runs, per sequence."""
        return np.array(self.encoded_images, np.int64), np.array(self.encoded_tokens, np.int64)


@dataclass(frozen=True)
class ImageReader:
    """How the plan reads a file's images, as a worker would: the model's processor (None: a text model),
    the storage that file ids and s3:// URLs name, and the image policy (hosts, limits)."""

    processor: Any = None
    store: Store | None = None
    policy: ImageSettings = field(default_factory=ImageSettings)


@dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    keyed: list[int]  # the ids its prefix-cache blocks are keyed by (image tokens by their image's content)
    image_tokens: int = 0  # placeholder tokens of its images
    last_image_row: int = -1  # where its last placeholder token is; the encoder runs unless cached past it


def _prompt(request: ParsedRequest, tokenizer, images: ImageReader) -> _Prompt:
    """A request's prompt as the engine takes it: image placeholder tokens counted as the processor expands
    them and keyed by their image's content, as the engine keys them."""
    if not request.images:
        ids = tokenize(request, tokenizer)
        return _Prompt(ids, ids)
    from bulkgen.engine.features.multimodal import RequestImages  # torch: only a vision model's plan needs it

    processor = images.processor
    check_model_takes_images(request.images, processor is not None, request.model)
    decoded = load_images(request.images, store=images.store, policy=images.policy)
    ids, inputs = tokenize_with_images(request, processor, decoded)
    kept = RequestImages(inputs, ids, processor.image_token_id)
    return _Prompt(ids, kept.hash_prompt, len(kept.rows), kept.last_row)


class _PrefixCache:
    """The engine's prefix cache in miniature: full blocks keyed by their chained hash (block_manager)."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self.seen = block_size, set()

    def cached(self, ids: list[int], lora: str | None = None) -> int:
        """Leading tokens of `ids` an earlier prompt already computed (never the last token: it must run);
        one LoRA adapter's KV is never another's, so the chain starts from the adapter."""
        bs, parent, hits = self.block_size, hash(lora) if lora else 0, 0
        for start in range(0, (len(ids) - 1) // bs * bs, bs):
            parent = hash((parent, tuple(ids[start : start + bs])))
            if parent in self.seen:
                hits += bs
                continue
            if len(self.seen) < MAX_BLOCK_HASHES:
                self.seen.add(parent)
        return hits


def file_work(
    path: Path,
    endpoint: str,
    served_model: str,
    tokenizer,
    max_model_len: int,
    max_requests: int,
    block_size: int = 16,
    adapters: Iterable[str] = (),
    images: ImageReader | None = None,
) -> FileWork:
    """Validate and tokenize `path`; the validation result says whether a batch of it would be accepted.
    `adapters`: the names of the served model's LoRA adapters, which its lines may name. `images`: how to
    read its images (None: a text model, whose workers refuse image lines)."""
    images = images or ImageReader()
    check = partial(check_images, store=images.store, policy=images.policy)
    validator = Validator(
        endpoint, [served_model], max_requests, dict.fromkeys(adapters, served_model), check
    )
    cache = _PrefixCache(block_size)
    work = FileWork(validator.result)
    refused_before = [0]

    def on_request(line: int, offset: int, raw: bytes, request: ParsedRequest) -> None:
        if validator.result.refused_count != refused_before[0]:  # a body error: its worker answers 400
            refused_before[0] = validator.result.refused_count
            work.refused += 1
            return
        try:
            for sub in split_prompts(request):
                _add(work, cache, sub, tokenizer, max_model_len, images)
        except LineError:
            work.refused += 1

    with path.open("rb") as reader:
        validate_stream(reader, validator, on_request)
    return work


def _add(
    work: FileWork,
    cache: _PrefixCache,
    request: ParsedRequest,
    tokenizer,
    max_model_len: int,
    images: ImageReader,
) -> None:
    prompt = _prompt(request, tokenizer, images)
    params = fit_context(request, len(prompt.ids), max_model_len)
    max_tokens = int(params.get("max_tokens") or 0)
    sequences = max(params.get("n") or 1, params.get("best_of") or 1)
    cached = cache.cached(prompt.keyed, request.lora)
    work.images += len(request.images)
    encoded = cached <= prompt.last_image_row
    for k in range(sequences):  # the engine runs each completion as a sequence; they share the prompt
        work.prompt_tokens.append(len(prompt.ids) if k == 0 else 0)
        work.uncached_tokens.append(len(prompt.ids) - cached if k == 0 else 0)
        work.sequence_prompts.append(len(prompt.ids))
        work.max_tokens.append(max_tokens)
        work.encoded_images.append(len(request.images) if encoded and k == 0 else 0)
        work.encoded_tokens.append(prompt.image_tokens if encoded and k == 0 else 0)
