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
  (bulkgen.batch.image_fetch: size cap, time limit, same-host redirects, public addresses only).
A bad image refuses its line alone (`ImageError`, a LineError naming the part). Decoding runs on a bounded
thread pool (`ImageSettings.image_decode_threads`), with the pixel count checked from the header before any
pixel is decoded, so a worker's image memory is bounded by threads x max pixels plus the decoded images of
the lines it holds.
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
from bulkgen.batch.image_fetch import Network, fetch, host_allowed
from bulkgen.batch.records import FileRepo, RecordNotFound
from bulkgen.batch.schema import quote
from bulkgen.store import NotFound, Store

if TYPE_CHECKING:
    from PIL.Image import Image

    from bulkgen.settings import ImageSettings

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
    """What validation can tell without fetching or decoding: the count, every data: URL whole, that file
    ids and s3:// objects exist and may be read (skipped where `store` is None), and that http(s) hosts
    are allowed."""
    _check_count(refs, policy)
    for ref in refs:
        if ref.kind == "data":
            _probe(_data_bytes(ref, policy), ref, policy)
        elif ref.kind == "http":
            _check_host(ref, policy)
        elif store is not None and ref.kind == "file":
            _file_meta(ref, store, policy)
        elif store is not None:
            _object_size(ref, store, _s3_key(ref, store), policy)


def load_images(
    refs: list[ImageRef], *, store: Store | None, policy: ImageSettings, network: Network | None = None
) -> list[Image]:
    """The request's images, read and decoded (RGB, EXIF orientation applied, a GIF's first frame) on the
    worker's bounded pool, in order; the first bad one (in order) raises its ImageError. Call it off the
    engine thread: it waits on storage and the network. `network`: tests route fetches (image_fetch)."""
    return [image.result() for image in start_loading(refs, store=store, policy=policy, network=network)]


def start_loading(
    refs: list[ImageRef], *, store: Store | None, policy: ImageSettings, network: Network | None = None
) -> list[Future]:
    """load_images without the wait: one future per image, each giving the image or raising its
    ImageError, so a worker starts a whole range's images before it waits on the first."""
    _check_count(refs, policy)
    pool = _pool(policy.image_decode_threads)
    return [pool.submit(_load, ref, store, policy, network) for ref in refs]


def _load(ref: ImageRef, store: Store | None, policy: ImageSettings, network: Network | None) -> Image:
    return decode(_read(ref, store, policy, network), ref, policy)


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
    from PIL import Image, ImageOps

    image = _probe(data, ref, policy)
    try:
        image.seek(0)
        image.load()
        image = ImageOps.exif_transpose(image)
        if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            white.alpha_composite(rgba)
            image = white
        return image.convert("RGB")
    except Exception as exc:  # PIL's decoders raise many types on corrupt data: each is this line's 400
        raise ImageError(ref, f"the image could not be decoded ({type(exc).__name__}: {exc})") from None


def _probe(data: bytes, ref: ImageRef, policy: ImageSettings) -> Image:
    """The image opened from its header only (PIL reads pixels lazily): format and pixel count checked."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
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
