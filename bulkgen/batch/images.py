"""Images in requests: the image parts of a line (chat `image_url`, responses `input_image`), checked at
validation where that is cheap, and read and decoded in the worker, off the engine thread.

A parsed request carries its images as `ImageRef`s (where the bytes are, the `detail` asked for, and the
JSON path of the part, which every error names); its messages hold `{"type": "image"}` placeholders in their
place. Where an image may come from:
- a `data:` URL (PNG, JPEG, WebP or GIF, base64): checked whole at validation (decodes, within the size cap,
  a header PIL reads), without decoding its pixels;
- a `file-…` id the same tenant uploaded with purpose `vision` or `user_data` (its record is checked at
  validation; another tenant's ids are not found in this tenant's folder);
- an `s3://` URL inside the tenant's storage (it must exist at validation);
- an `http(s)` URL on a host the operator allowed (`--image-url-hosts`), fetched by the worker
  (bulkgen.batch.image_fetch: size cap, one deadline, same-origin redirects, public addresses only).
A bad image refuses its line alone (`ImageError`, a LineError naming the part). Reading and decoding run on
a bounded thread pool (`ImageSettings.image_decode_threads`). Every image is opened from its header first
(`Probed`): its pixel count is checked (`--max-image-pixels`, also PIL's own decompression-bomb guard) and
its memory cost computed (`decoded_cost`: what its pixels take while decoded and processed) before any pixel
is decoded, so the worker takes that much of its image memory budget (bulkgen.batch.image_budget,
`--image-memory-mb`) before it decodes a line's images, and refuses a line whose images alone cost more.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bulkgen.batch.bodyfields import LineError
from bulkgen.batch.heap_trim import trim_heap
from bulkgen.batch.image_budget import TRIM_AFTER_BYTES
from bulkgen.batch.image_fetch import Network, fetch, host_allowed
from bulkgen.batch.records import FileRepo, RecordNotFound
from bulkgen.batch.schema import quote
from bulkgen.store import NotFound, Store

if TYPE_CHECKING:
    from PIL.Image import Image

    from bulkgen.settings import ImageSettings

# What one pixel costs in memory while its image is decoded and processed, in bytes. Pillow keeps 1 byte a
# pixel for modes 1, L and P, 2 for I;16 and 4 for the rest (RGB included: 3 bands padded to 4). Decoding
# holds the decoded frame, its upright copy and the RGB result (with transparency: an RGBA copy and a white
# background too); processing holds the RGB image and the processor's arrays of it (a uint8 array, its
# resized copy and float32 rescaled pixels of the resized image, of at most as many pixels): 12 bytes a
# pixel covers transformers' PIL processors (a 7000x7000 RGB PNG peaked at +654 MB, 13.3 bytes a pixel,
# through tiny LLaVA's and Qwen2-VL's processors; this rule charges 16).
PROCESSING_BYTES_PER_PIXEL = 12
_ALPHA_MODES = {"RGBA", "RGBa", "LA", "La", "PA"}
_ORIENTATION = 0x0112  # the EXIF tag
_MIB = 1024 * 1024

DETAILS = ("auto", "low", "high")  # chat's; responses adds "original"
IMAGE_PURPOSES = ("vision", "user_data")  # the Files API purposes an image file may have
FORMATS = {"PNG", "JPEG", "WEBP", "GIF"}
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*);base64,", re.I)
_MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request, in order: where its bytes are, and which part it was."""

    source: str  # a data: URL, a file id (file-…), an s3:// URL or an http(s) URL
    detail: str  # auto, low or high, as the part asked (a processor may use it; never required)
    param: str  # the part's JSON path, e.g. body.messages[0].content[1].image_url: every error names it

    @property
    def kind(self) -> str:
        """data, file, s3 or http: which reader gets the bytes."""
        if self.source.startswith("file-"):
            return "file"
        scheme = self.source.split(":", 1)[0].lower()
        return "http" if scheme in ("http", "https") else scheme


class ImageError(LineError):
    """An image its line cannot use: that line's 400, naming the part; the rest of the batch runs."""

    def __init__(self, ref: ImageRef, why: str, code: str = "invalid_image") -> None:
        super().__init__(code, f"{ref.param}: {why}", ref.param)


def image_ref(
    source: Any, detail: Any, param: str, detail_param: str, details: tuple[str, ...] = DETAILS
) -> ImageRef:
    """A part's image reference, its shape checked (`param`: the field holding the source, which errors
    name); what needs storage or the policy is checked later (check_images, load_images)."""
    if detail is None:
        detail = "auto"
    if detail not in details:
        raise LineError(
            "invalid_image_url",
            f"{detail_param} must be one of {list(details)}; got {quote(detail)}",
            detail_param,
        )
    if not isinstance(source, str) or not source:
        raise LineError(
            "invalid_image_url", f"{param} must be a non-empty string; got {quote(source)}", param
        )
    ref = ImageRef(source, detail, param)
    if ref.kind not in ("data", "file", "s3", "http"):
        raise LineError(
            "invalid_image_url",
            f"{param} must be a data: URL, a file id, an s3:// URL or an http(s) URL; got {quote(source, 60)}",
            param,
        )
    return ref


def check_model_takes_images(refs: list[ImageRef], accepts_images: bool, model: str) -> None:
    """A model without a vision encoder refuses a request with images: its 400 names the first image part
    (the worker asks its engine, `accepts_images`)."""
    if refs and not accepts_images:
        raise LineError(
            "unsupported_parameter",
            f"{refs[0].param} is an image; model {quote(model, 60)} takes text only (serve a vision-language "
            "model for image parts)",
            refs[0].param,
        )


def check_images(refs: list[ImageRef], *, store: Store | None, policy: ImageSettings) -> None:
    """What validation can tell without fetching or decoding: the count, every data: URL whole (its images'
    cost within a worker's image memory too), that file ids and s3:// objects exist and may be read (skipped
    where `store` is None), and that http(s) hosts are allowed."""
    _check_count(refs, policy)
    inline = []
    for ref in refs:
        if ref.kind == "data":
            data = _data_bytes(ref, policy)
            inline.append(Probed(ref, _probe(data, ref, policy), len(data)))
        elif ref.kind == "http":
            _check_host(ref, policy)
        elif store is not None and ref.kind == "file":
            _file_meta(ref, store, policy)
        elif store is not None:
            _object_size(ref, store, _s3_key(ref, store), policy)
    # a worker's image memory must hold the inline images at least (what the others cost it finds out)
    check_line_cost(inline, policy.image_memory_bytes)


def load_images(
    refs: list[ImageRef], *, store: Store | None, policy: ImageSettings, network: Network | None = None
) -> list[Image]:
    """The request's images, read and decoded (RGB, EXIF orientation applied, a GIF's first frame) on the
    worker's bounded pool, in order; the first bad one (in order) raises its ImageError. Call it off the
    engine thread: it waits on storage and the network. `network`: tests route fetches (image_fetch)."""
    probed = [p.result() for p in start_reading(refs, store=store, policy=policy, network=network)]
    return [image.result() for image in start_decoding(probed, policy)]


@dataclass
class Probed:
    """An image read and opened from its header, not yet decoded: its size, mode and what decoding and
    processing it will cost (`cost`, bytes)."""

    ref: ImageRef
    image: Image | None  # PIL's lazily opened image (the header read, not the pixels); None once decoded
    encoded: int  # bytes of the file

    cost: int = 0  # its bytes held until it is decoded, plus what decoding and processing take (decoded_cost)

    def __post_init__(self) -> None:
        transparency = "transparency" in self.image.info
        self.cost = self.encoded + decoded_cost(*self.image.size, self.image.mode, transparency)


def decoded_cost(width: int, height: int, mode: str, transparency: bool = False) -> int:
    """Bytes an image of this size and mode takes at most while decoded, made RGB and processed (see
    PROCESSING_BYTES_PER_PIXEL): what the worker's image memory budget charges for it."""
    if mode in ("1", "L", "P"):
        stored = 1
    elif mode.startswith("I;16"):
        stored = 2
    else:
        stored = 4
    decoding = 2 * stored + 4 + (8 if mode in _ALPHA_MODES or transparency else 0)
    processing = 4 + PROCESSING_BYTES_PER_PIXEL
    return width * height * max(decoding, processing)


def start_reading(
    refs: list[ImageRef], *, store: Store | None, policy: ImageSettings, network: Network | None = None
) -> list[Future]:
    """Each image read (storage, a fetch) and opened from its header on the worker's pool: one future per
    image, giving its `Probed` or raising its ImageError. No pixel is decoded."""
    _check_count(refs, policy)
    pool = _pool(policy.image_decode_threads)
    return [pool.submit(_read_probed, ref, store, policy, network) for ref in refs]


def start_decoding(probed: list[Probed], policy: ImageSettings) -> list[Future]:
    """Each probed image decoded on the pool (`decode_probed`): one future per image, giving the RGB image
    or raising its ImageError. Take the images' `cost` from the budget first."""
    pool = _pool(policy.image_decode_threads)
    return [pool.submit(decode_probed, p) for p in probed]


def check_line_cost(probed: list[Probed], budget_bytes: int) -> int:
    """The bytes a line's images cost together; ImageError (image_too_large) naming the image with which they
    pass `budget_bytes` (the worker's whole image memory, `--image-memory-mb`), whatever else is held."""
    total = 0
    for p in probed:
        total += p.cost
        if total > budget_bytes:
            width, height = p.image.size
            others = f"; with the line's images before it, {_mb(total)}" if total > p.cost else ""
            raise ImageError(
                p.ref,
                f"is {width}x{height} pixels ({p.image.mode}), {_mb(p.cost)} once decoded and processed{others}: "
                f"over a worker's image memory of {_mb(budget_bytes)} (--image-memory-mb)",
                "image_too_large",
            )
    return total


def _mb(size: int) -> str:
    return f"{size / _MIB:,.0f} MiB" if size >= _MIB else f"{size:,} bytes"


def _read_probed(
    ref: ImageRef, store: Store | None, policy: ImageSettings, network: Network | None
) -> Probed:
    data = _read(ref, store, policy, network)
    return Probed(ref, _probe(data, ref, policy), len(data))


def _read(ref: ImageRef, store: Store | None, policy: ImageSettings, network: Network | None) -> bytes:
    if ref.kind == "data":
        return _data_bytes(ref, policy)
    if ref.kind == "http":
        _check_host(ref, policy)
        return fetch(ref.source, policy, lambda why: ImageError(ref, why, "invalid_image_url"), network)
    key = (
        FileRepo.data_key(_file_meta(ref, store, policy)["id"]) if ref.kind == "file" else _s3_key(ref, store)
    )
    _object_size(ref, store, key, policy)
    try:
        return store.read_bytes(key)
    except NotFound:
        raise ImageError(ref, f"{quote(ref.source, 60)} was deleted", "invalid_image_url") from None


def decode(data: bytes, ref: ImageRef, policy: ImageSettings) -> Image:
    """The image as a model's processor takes it: RGB (transparency over white, as transformers' own
    convert_to_rgb does), upright by its EXIF orientation, a GIF's or WebP animation's first frame."""
    return decode_probed(Probed(ref, _probe(data, ref, policy), len(data)))


def decode_probed(probed: Probed) -> Image:
    """decode, of an image already opened from its header."""
    from PIL import Image, ImageOps

    image, ref = probed.image, probed.ref
    large = image.width * image.height * 4 >= TRIM_AFTER_BYTES
    probed.image = None  # the decoded frame is this call's alone: it goes as soon as its RGB copy is made
    try:
        image.seek(0)
        image.load()
        if image.getexif().get(_ORIENTATION, 1) != 1:  # a copy only for an image that needs turning
            image = ImageOps.exif_transpose(image)
        if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            white.alpha_composite(rgba)
            image = white
        image = image.convert("RGB")
    except Exception as exc:  # PIL's decoders raise many types on corrupt data: each is this line's 400
        raise ImageError(ref, f"the image could not be decoded ({type(exc).__name__}: {exc})") from None
    if large:
        trim_heap()  # what decoding freed, back to the system before the processor allocates (heap_trim.py)
    return image


def _probe(data: bytes, ref: ImageRef, policy: ImageSettings) -> Image:
    """The image opened from its header only (PIL reads pixels lazily): format and pixel count checked. PIL's
    own decompression-bomb guard is set from --max-image-pixels too (it refuses twice that at open)."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = policy.max_image_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the check below refuses it
            image = Image.open(io.BytesIO(data))
    except Exception:  # UnidentifiedImageError, a decompression bomb, or a header PIL chokes on
        raise ImageError(ref, "is not an image (PNG, JPEG, WebP or GIF) that can be read") from None
    if image.format not in FORMATS:
        raise ImageError(ref, f"is a {image.format} image; send PNG, JPEG, WebP or GIF")
    width, height = image.size
    if width * height > policy.max_image_pixels:
        raise ImageError(
            ref,
            f"is {width}x{height} pixels; the limit is {policy.max_image_pixels:,} pixels (--max-image-pixels)",
        )
    return image


def _data_bytes(ref: ImageRef, policy: ImageSettings) -> bytes:
    match = _DATA_URL.match(ref.source)
    if match is None:
        raise ImageError(ref, "a data: URL must read data:image/<type>;base64,<data>", "invalid_image_url")
    media_type = (match.group("type") or "").lower()
    if media_type not in _MEDIA_TYPES:
        raise ImageError(ref, f"a data: URL of type {quote(media_type)}; send image/png, jpeg, webp or gif")
    encoded = ref.source[match.end() :]
    if len(encoded) * 3 // 4 > policy.max_image_bytes:  # before decoding: no allocation for what is refused
        raise _too_big(ref, len(encoded) * 3 // 4, policy)
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(ref, "the data: URL's base64 does not decode") from None


def _check_count(refs: list[ImageRef], policy: ImageSettings) -> None:
    if len(refs) > policy.max_images_per_line:
        raise ImageError(
            refs[policy.max_images_per_line],
            f"the request has {len(refs)} images; at most {policy.max_images_per_line} are allowed "
            "(--max-images-per-line)",
        )


def _check_host(ref: ImageRef, policy: ImageSettings) -> None:
    if not host_allowed(ref.source, policy.image_url_hosts):
        allowed = ", ".join(policy.image_url_hosts) or "none (the default)"
        raise ImageError(
            ref,
            f"{quote(ref.source, 60)} is not on a host this service fetches images from ({allowed}); "
            "send the image as a data: URL or a file id, or ask the operator to allow the host "
            "(--image-url-hosts)",
            "invalid_image_url",
        )


def _file_meta(ref: ImageRef, store: Store, policy: ImageSettings) -> dict:
    try:
        meta = FileRepo(store).get(ref.source)
    except RecordNotFound:
        raise ImageError(
            ref, f"no file {quote(ref.source, 60)} (files are the uploader's own)", "invalid_image_url"
        ) from None
    if meta["purpose"] not in IMAGE_PURPOSES:
        raise ImageError(
            ref,
            f"file {ref.source} has purpose {meta['purpose']!r}; upload images with purpose 'vision' or 'user_data'",
            "invalid_image_url",
        )
    if meta["bytes"] > policy.max_image_bytes:
        raise _too_big(ref, meta["bytes"], policy)
    return meta


def _s3_key(ref: ImageRef, store: Store) -> str:
    """The key of an s3:// URL inside the tenant's storage; never another tenant's folder."""
    from bulkgen.store import layout
    from bulkgen.store.base import check_key

    root = store.url.rstrip("/") + "/"
    key = ref.source[len(root) :] if ref.source.startswith(root) else None
    try:
        if key is None or key.startswith(layout.TENANTS):
            raise ValueError
        return check_key(key)
    except ValueError:
        raise ImageError(
            ref,
            # never the storage's root or a tenant folder: those are the server's, not the client's
            f"{quote(ref.source, 60)} is not inside this service's storage; s3:// images must be there",
            "invalid_image_url",
        ) from None


def _object_size(ref: ImageRef, store: Store, key: str, policy: ImageSettings) -> None:
    try:
        size = store.stat(key).size
    except NotFound:
        raise ImageError(ref, f"{quote(ref.source, 60)} does not exist", "invalid_image_url") from None
    if size > policy.max_image_bytes:
        raise _too_big(ref, size, policy)


def _too_big(ref: ImageRef, size: int, policy: ImageSettings) -> ImageError:
    limit = policy.max_image_bytes
    return ImageError(
        ref, f"the image is {size:,} bytes; the limit is {limit:,} (--max-image-mb)", "image_too_large"
    )


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """One decoding pool per process and size: every range a worker prepares shares its threads."""
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="bulkgen-images")
        return _pools[threads]
