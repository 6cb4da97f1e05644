"""Reading and decoding images in the worker (load_images) and checking them at validation (check_images):
data: URLs, file ids by tenant, the limits, and the decoding rules (RGB, EXIF orientation, GIF first frame)."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from bulkgen.batch.images import ImageError, ImageRef, check_images, load_images
from bulkgen.batch.records import FileRepo
from bulkgen.settings import ImageSettings
from bulkgen.store.local import LocalStore
from bulkgen.tenants import tenant_prefix
from tests.support.images import data_url, image_bytes, png_url

POLICY = ImageSettings()
P = "body.messages[0].content[1].image_url"


def _ref(source: str, param: str = P) -> ImageRef:
    return ImageRef(source, "auto", param)


def _error(refs, store=None, policy=POLICY, check=False) -> ImageError:
    with pytest.raises(ImageError) as info:
        if check:
            check_images(refs, store=store, policy=policy)
        else:
            load_images(refs, store=store, policy=policy)
    return info.value


@pytest.fixture
def root(tmp_path):
    store = LocalStore(tmp_path / "storage", fsync=False)
    store.create()
    return store


def test_data_urls_decode_to_rgb_in_order():
    sources = [
        png_url((8, 6), (255, 0, 0)),
        data_url(image_bytes("JPEG", (10, 4), (0, 0, 255)), "image/jpeg"),
        data_url(image_bytes("WEBP", (5, 5), (0, 255, 0)), "image/webp"),
    ]
    refs = [_ref(s) for s in sources]
    check_images(refs, store=None, policy=POLICY)
    images = load_images(refs, store=None, policy=POLICY)
    assert [(im.mode, im.size) for im in images] == [("RGB", (8, 6)), ("RGB", (10, 4)), ("RGB", (5, 5))]
    assert images[0].getpixel((0, 0)) == (255, 0, 0)


def test_gif_first_frame_transparency_over_white_and_exif_orientation():
    frames = [Image.new("P", (4, 4), i) for i in (1, 2)]
    for frame in frames:
        frame.putpalette([0, 0, 0, 200, 10, 10, 10, 200, 10] + [0] * 759)
    gif = io.BytesIO()
    frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:])
    clear = image_bytes("PNG", (3, 3), (0, 0, 0, 0), mode="RGBA")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    rotated = image_bytes("JPEG", (10, 4), (9, 9, 9), exif=exif.tobytes())
    refs = [
        _ref(data_url(gif.getvalue(), "image/gif")),
        _ref(data_url(clear)),
        _ref(data_url(rotated, "image/jpeg")),
    ]
    first, white, upright = load_images(refs, store=None, policy=POLICY)
    assert first.getpixel((0, 0)) == (200, 10, 10)
    assert white.getpixel((1, 1)) == (255, 255, 255)
    assert upright.size == (4, 10)


@pytest.mark.parametrize(
    "source, code, words",
    [
        ("data:image/png;base64,not base64!", "invalid_image", "base64 does not decode"),
        (data_url(b"just some text, not an image"), "invalid_image", "is not an image"),
        ("data:text/plain;base64,aGk=", "invalid_image", "text/plain"),
        ("data:image/png,raw", "invalid_image_url", "data:image/<type>;base64"),
        (data_url(image_bytes("BMP"), "image/png"), "invalid_image", "BMP image"),
        (data_url(image_bytes("PNG", (300, 200))), "invalid_image", "300x200 pixels"),
        (data_url(b"\0" * 3000), "image_too_large", "the limit is 2,048"),
    ],
)
def test_bad_data_urls_are_refused_at_validation_naming_the_part(source, code, words):
    policy = ImageSettings(max_image_pixels=50_000, max_image_bytes=2048)
    error = _error(
        [_ref(png_url()), _ref(source, "body.messages[0].content[3].image_url")], policy=policy, check=True
    )
    assert (error.code, error.param) == (code, "body.messages[0].content[3].image_url")
    assert words in error.message


def test_a_truncated_image_passes_its_header_check_and_fails_its_decode():
    png = image_bytes("PNG", (64, 64), (10, 20, 30))
    truncated = _ref(data_url(png[: len(png) // 2]))
    check_images([truncated], store=None, policy=POLICY)  # the header reads: validation cannot tell
    error = _error([truncated])
    assert (error.code, error.param) == ("invalid_image", P)
    assert "could not be decoded" in error.message


def test_too_many_images_names_the_first_one_over():
    refs = [_ref(png_url(), f"body.messages[0].content[{i}].image_url") for i in range(4)]
    error = _error(refs, policy=ImageSettings(max_images_per_line=3), check=True)
    assert error.param == "body.messages[0].content[3].image_url"
    assert "at most 3" in error.message


def test_file_ids_are_the_tenants_own_with_an_image_purpose(root):
    mine, theirs = root.sub(tenant_prefix("acme")), root.sub(tenant_prefix("other"))
    png = image_bytes("PNG", (7, 7), (0, 128, 0))
    image_file = FileRepo(mine).create(io.BytesIO(png), "leaf.png", "vision")["id"]
    batch_file = FileRepo(mine).create(io.BytesIO(png), "leaf.png", "batch")["id"]
    ref = _ref(image_file)
    check_images([ref], store=mine, policy=POLICY)
    (image,) = load_images([ref], store=mine, policy=POLICY)
    assert (image.size, image.getpixel((3, 3))) == ((7, 7), (0, 128, 0))
    for check in (True, False):  # another tenant's id is not found in its folder: validation and worker agree
        error = _error([ref], store=theirs, check=check)
        assert (error.code, error.param, f"no file {image_file!r}" in error.message) == (
            "invalid_image_url",
            P,
            True,
        )
    error = _error([_ref(batch_file)], store=mine, check=True)
    assert "purpose 'batch'" in error.message


def test_s3_urls_must_be_inside_the_tenants_storage(root):
    error = _error([_ref("s3://bucket/elsewhere/cat.png")], store=root, check=True)
    assert (error.code, error.param) == ("invalid_image_url", P)
    assert "not inside this service's storage" in error.message
    tenant = root.sub("tenants/acme")  # a tenant's store: neither its folder nor the root is the client's
    error = _error([_ref("s3://bucket/elsewhere/cat.png")], store=tenant, check=True)
    assert "s3://bucket/elsewhere/cat.png" in error.message
    for server_path in (root.url, tenant.url, "tenants/acme"):
        assert server_path.removeprefix("file://") not in error.message


def test_s3_urls_inside_the_storage_load_and_other_tenants_folders_do_not(s3_bucket_url):
    from bulkgen.store import open_store

    store = open_store(s3_bucket_url)
    store.write_bytes("images/cat.png", image_bytes("PNG", (5, 3), (1, 2, 3)))
    store.write_bytes("tenants/other/files/data/x", image_bytes())
    ref = _ref(f"{s3_bucket_url}/images/cat.png")
    check_images([ref], store=store, policy=POLICY)
    (image,) = load_images([ref], store=store, policy=POLICY)
    assert (image.size, image.getpixel((0, 0))) == ((5, 3), (1, 2, 3))
    for source in (
        f"{s3_bucket_url}/tenants/other/files/data/x",
        f"{s3_bucket_url}/images/../tenants/other/x",
    ):
        assert "not inside this service's storage" in _error([_ref(source)], store=store, check=True).message
    missing = _error([_ref(f"{s3_bucket_url}/images/dog.png")], store=store, check=True)
    assert "does not exist" in missing.message
