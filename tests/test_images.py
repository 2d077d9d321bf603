"""Input images as content: an upload is decoded safely and kept as its upright 8-bit RGB
pixels under their hash, so the same picture in any lossless encoding has one name; every bad
upload is refused naming the field (not an image, truncated, too many bytes or pixels, a
decompression bomb, a mode 8-bit RGB cannot hold), and a fuzzed one never raises anything else.
Over the real stack, ``/v1/images`` stores per tenant and reads back from disk what the store
lost."""

from __future__ import annotations

import io
import random
import struct
import zlib
from collections.abc import Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from api.app import create_app
from cachesvc.connect import open_cache
from cachesvc.waiting import wait_until
from config.settings import ApiSettings, Settings
from keys import image_key
from tests import redis_databases
from uploads.images import ImageError, normalise, normalise_mask, pixel_hash

LIMITS = {"max_bytes": 2**20, "max_pixels": 512 * 512}


def picture(width: int = 24, height: int = 16, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


def decode_png(png: bytes) -> Image.Image:
    with Image.open(io.BytesIO(png), formats=["PNG"]) as image:
        return image.convert("RGB")


def pixels_of(data: bytes) -> np.ndarray:
    return np.asarray(decode_png(normalise(data, **LIMITS).png))


def test_one_picture_in_any_lossless_encoding_has_one_hash_and_its_pixels_kept() -> None:
    image = picture()
    forms = [encoded(image, "PNG"), encoded(image, "PNG", compress_level=0),
             encoded(image, "BMP"), encoded(image, "WEBP", lossless=True),
             encoded(image.convert("RGBA"), "PNG"), encoded(image, "TIFF")]
    kept = [normalise(data, **LIMITS) for data in forms]
    assert {k.hash for k in kept} == {pixel_hash(image)}
    assert (kept[0].width, kept[0].height) == (24, 16)
    assert np.array_equal(pixels_of(forms[2]), np.asarray(image))
    # Another picture, or the same one a pixel different, is another image.
    changed = np.asarray(image).copy()
    changed[0, 0, 0] ^= 1
    assert normalise(encoded(Image.fromarray(changed), "PNG"), **LIMITS).hash != kept[0].hash
    assert normalise(encoded(picture(seed=1), "PNG"), **LIMITS).hash != kept[0].hash


def test_exif_orientation_is_applied_and_small_modes_become_rgb() -> None:
    image = picture(6, 4)
    exif = Image.Exif()
    exif[0x0112] = 6  # the camera was turned: show it rotated 90 degrees clockwise
    upright = normalise(encoded(image, "PNG", exif=exif.tobytes()), **LIMITS)
    assert (upright.width, upright.height) == (4, 6)
    assert np.array_equal(np.asarray(decode_png(upright.png)),
                          np.asarray(image.transpose(Image.Transpose.ROTATE_270)))
    palette = image.quantize(colors=8)
    assert np.array_equal(pixels_of(encoded(palette, "PNG")),
                          np.asarray(palette.convert("RGB")))
    cmyk = image.convert("CMYK")
    assert np.array_equal(pixels_of(encoded(cmyk, "TIFF")), np.asarray(cmyk.convert("RGB")))
    grey = image.convert("L")
    assert np.array_equal(pixels_of(encoded(grey, "PNG")), np.asarray(grey.convert("RGB")))


def test_a_mask_is_grey_white_where_it_repaints_by_its_transparency_or_its_light() -> None:
    """OpenAI's reading where the mask has transparency (repaint where fully transparent),
    the diffusers pipelines' where it has none (its grey level); a mask is named apart from
    the same pixels as an image."""
    alpha = np.full((16, 24), 255, dtype=np.uint8)
    alpha[:, :10] = 0
    alpha[0, 12] = 1  # all but transparent: kept
    rgba = np.concatenate([np.asarray(picture()), alpha[..., None]], axis=2)
    transparent = normalise_mask(encoded(Image.fromarray(rgba, "RGBA"), "PNG"), **LIMITS)
    with Image.open(io.BytesIO(transparent.png)) as kept:
        assert kept.mode == "L"
        assert np.array_equal(np.asarray(kept), np.where(alpha == 0, 255, 0))
    opaque = picture(seed=4)
    grey = normalise_mask(encoded(opaque, "PNG"), **LIMITS)
    with Image.open(io.BytesIO(grey.png)) as kept:
        assert np.array_equal(np.asarray(kept), np.asarray(opaque.convert("L")))
    as_image = normalise(encoded(opaque.convert("L"), "PNG"), **LIMITS)
    assert grey.hash != as_image.hash and (grey.width, grey.height) == (24, 16)
    with pytest.raises(ImageError, match="not an image") as refused:
        normalise_mask(b"no mask", **LIMITS)
    assert refused.value.field == "mask"


def with_size(png: bytes, width: int, height: int) -> bytes:
    """A PNG whose header claims another size (its CRC made right), its data unchanged."""
    assert png[12:16] == b"IHDR"
    header = struct.pack(">II", width, height) + png[24:29]
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + header))
    return png[:16] + header + crc + png[33:]


@pytest.mark.parametrize(("data", "status", "says"), [
    (b"", 422, "not an image"),
    (b"GIF89a but not really", 422, "not an image"),
    (b"\x80\x04\x95pickle", 422, "not an image"),
    (encoded(picture(), "PNG")[:300], 422, "truncated"),
    (b"\x00" * (2**20 + 1), 413, "api.max_image_bytes"),
    (encoded(Image.new("RGB", (600, 600)), "PNG"), 413, "api.max_image_pixels"),
    # A few hundred bytes claiming ten billion pixels: refused from the header, undecoded.
    (with_size(encoded(picture(), "PNG"), 100_000, 100_000), 413, "api.max_image_pixels"),
    (with_size(encoded(picture(), "PNG"), 20_000, 20_000), 413, "api.max_image_pixels"),
    (encoded(Image.fromarray(np.full((8, 8), 40_000, dtype=np.uint16)), "PNG"), 422,
     "16-bit"),
])
def test_a_bad_upload_is_refused_naming_the_field(data: bytes, status: int, says: str) -> None:
    with pytest.raises(ImageError, match=says) as refused:
        normalise(data, **LIMITS)
    assert refused.value.field == "image" and refused.value.status == status


def test_a_fuzzed_upload_is_kept_or_refused_never_anything_else() -> None:
    rng = random.Random(7)
    seeds = [encoded(picture(), fmt) for fmt in ("PNG", "JPEG", "BMP", "GIF", "WEBP")]
    kept = refused = 0
    for _ in range(300):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(data))
            data[at] = rng.randrange(256)
        if rng.random() < 0.3:
            del data[rng.randrange(len(data)):]
        try:
            normalise(bytes(data), **LIMITS)
            kept += 1
        except ImageError:
            refused += 1
    assert kept and refused  # both outcomes were met, and nothing else was raised


@pytest.fixture(scope="module")
def http(workerless_stack: Settings) -> Iterator[TestClient]:
    settings = redis_databases.on_database(workerless_stack, redis_databases.IMAGES)
    redis_databases.emptied(settings)
    api = ApiSettings(api_keys={"key-a": "images-a", "key-b": "images-b"},
                      max_image_bytes=2**20)
    with TestClient(create_app(settings.model_copy(update={"api": api}))) as client:
        yield client


A, B = {"X-API-Key": "key-a"}, {"X-API-Key": "key-b"}


def test_an_upload_is_kept_per_tenant_and_read_back_after_the_store_lost_it(
        http: TestClient, workerless_stack: Settings) -> None:
    image = picture(32, 32, seed=3)
    # The API connects to the store in the background: 503 until it has.
    answer = wait_until(lambda: (r := http.post("/v1/images", content=encoded(image, "PNG"),
                                                headers=A)).status_code != 503 and r,
                        timeout_s=60, what="the API's store connected")
    assert answer.status_code == 201, answer.text
    info = answer.json()
    assert info == {"hash": pixel_hash(image), "width": 32, "height": 32}
    again = http.post("/v1/images", content=encoded(image, "BMP"), headers=A).json()
    assert again["hash"] == info["hash"]
    png = http.get(f"/v1/images/{info['hash']}", headers=A)
    assert png.headers["content-type"] == "image/png"
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(png.content))), np.asarray(image))
    assert http.get(f"/v1/images/{info['hash']}", headers=B).status_code == 404
    # Only a content hash names an image: anything else is refused naming the parameter.
    odd = http.get("/v1/images/:", headers=A)
    assert odd.status_code == 422 and odd.json()["error"]["param"] == "content_hash", odd.text
    # The store is a cache of the file: an evicted image comes back from disk.
    cache = open_cache(workerless_stack)
    try:
        assert cache.store.remove(str(image_key("images-a", info["hash"])))
        assert http.get(f"/v1/images/{info['hash']}", headers=A).content == png.content
        assert cache.store.exists(str(image_key("images-a", info["hash"])))
    finally:
        cache.close()
    # Under /v1/images errors take OpenAI's shape, as its SDK reads them.
    bad = http.post("/v1/images", content=b"not an image", headers=A)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "image", bad.text
    big = http.post("/v1/images", content=b"\x00" * (2**20 + 1), headers=A)
    assert big.status_code == 413 and "api.max_image_bytes" in big.text
