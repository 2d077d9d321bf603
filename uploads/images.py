"""Input images as content: an upload decoded safely (its pixel count checked before any pixel
is decoded), turned upright by its EXIF orientation and into 8-bit RGB (a mask: 8-bit grey),
named by the hash of those pixels, and stored per tenant in the store and on disk beside it,
as adapters are."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash
from PIL import Image, ImageOps, UnidentifiedImageError

from cachesvc.errors import UploadError
from cachesvc.output_files import OutputFiles
from keys import StoreKey, image_key

if TYPE_CHECKING:
    from cachesvc.byte_entries import ByteEntries

# Modes of 8 bits or fewer a channel, which ``convert("RGB")`` (as the diffusers pipelines'
# image processors call it) maps without losing precision; alpha is dropped, as it does.
_CONVERTIBLE = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr",
                          "La", "RGBa"})


class ImageError(UploadError):
    """An image upload the service refuses."""


@dataclass(frozen=True, slots=True)
class InputImage:
    """An upload as it is kept: its normalised pixels as PNG, named by their hash."""

    hash: str
    width: int
    height: int
    png: bytes


def pixel_hash(image: Image.Image) -> str:
    """xxh3-128 of an RGB image's size and pixels (or of a mask's, under another name): one
    name for the same picture however it was encoded."""
    kind = "mask8" if image.mode == "L" else "rgb8"
    header = f"{kind}:{image.width}x{image.height}:".encode()
    return xxhash.xxh3_128_hexdigest(header + image.tobytes())


def normalise(data: bytes, max_bytes: int, max_pixels: int, field: str = "image"
              ) -> InputImage:
    """The upload ``data`` as an InputImage; ImageError naming ``field`` for anything that is
    not a whole image of at most ``max_bytes`` and ``max_pixels`` in a mode kept exactly."""
    return _kept(_upright(data, max_bytes, max_pixels, field).convert("RGB"))


def normalise_mask(data: bytes, max_bytes: int, max_pixels: int, field: str = "mask"
                   ) -> InputImage:
    """An inpainting mask as 8-bit grey, white where the prompt repaints: an image with
    transparency marks those places by its fully transparent pixels, as OpenAI's
    ``images.edit`` reads a mask; an opaque one is read as the diffusers pipelines read it
    (its grey level, binarised at half by the pipeline after its resize)."""
    upright = _upright(data, max_bytes, max_pixels, field)
    if "A" in upright.mode or "a" in upright.mode or "transparency" in upright.info:
        alpha = upright.convert("RGBA").getchannel("A")
        return _kept(alpha.point(lambda a: 255 if a == 0 else 0))
    return _kept(upright.convert("L"))


def _upright(data: bytes, max_bytes: int, max_pixels: int, field: str) -> Image.Image:
    """``data`` decoded within the limits (its pixel count checked before any pixel is) and
    turned upright by its EXIF orientation."""
    if len(data) > max_bytes:
        raise ImageError(field, f"{len(data)} bytes; at most {max_bytes} (api.max_image_bytes)",
                         413)
    try:
        with warnings.catch_warnings():
            # PIL warns of a large image and raises past twice its own bound; ours is checked
            # below, from the header, before any pixel is decoded.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            opened = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise ImageError(field, f"more than {max_pixels} pixels (api.max_image_pixels)",
                         413) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise ImageError(field, "not an image PIL can read (PNG, JPEG, WebP, ...)") from None
    with opened:
        width, height = opened.size
        if width * height > max_pixels:
            raise ImageError(field, f"{width}x{height} is more than {max_pixels} pixels "
                             "(api.max_image_pixels)", 413)
        if opened.mode not in _CONVERTIBLE:
            raise ImageError(field, f"mode {opened.mode} (16-bit or floating point) would "
                             "lose precision in 8-bit RGB; send an 8-bit image")
        try:
            opened.load()
            return ImageOps.exif_transpose(opened)
        except (OSError, ValueError, SyntaxError) as exc:
            raise ImageError(field, f"truncated or corrupt image ({exc})") from None


def _kept(pixels: Image.Image) -> InputImage:
    out = io.BytesIO()
    pixels.save(out, format="PNG")
    return InputImage(pixel_hash(pixels), pixels.width, pixels.height, out.getvalue())


class ImageStore:
    """A tenant's input images: PNG bytes in the store, and on disk beside it (an image is
    uploaded, not computed: the store's copy is a cache of the file)."""

    def __init__(self, cache: Callable[[], ByteEntries], files_dir: Path) -> None:
        self._cache = cache  # the store client as it stands (the API connects it late)
        self.files = OutputFiles(files_dir, ttl_s=float("inf"))

    def add(self, tenant: str, image: InputImage) -> None:
        key = image_key(tenant, image.hash)
        self.files.write(key, image.png)
        self._cache().write(key, image.png)

    def ensure_stored(self, tenant: str, content_hash: str, field: str = "image") -> None:
        """Put an image the store lost back from its file, before a request that names it
        reaches a worker; ImageError (404, naming ``field``) if the tenant has no such
        image."""
        key = image_key(tenant, content_hash)
        if not self._cache().exists(key) and self._restored(key) is None:
            raise _unknown(field, content_hash)

    def stored_size(self, tenant: str, content_hash: str, field: str) -> tuple[int, int]:
        """The image's width and height, from the header of its PNG (put back in the store
        if the store lost it); ImageError (404, naming ``field``) if the tenant has none."""
        data = self.read(tenant, content_hash)
        if data is None:
            raise _unknown(field, content_hash)
        with Image.open(io.BytesIO(data)) as opened:
            return opened.size

    def read(self, tenant: str, content_hash: str) -> bytes | None:
        """The image's PNG, put back in the store from its file if the store lost it; None if
        the tenant has no image of that hash."""
        key = image_key(tenant, content_hash)
        data = self._cache().read(key)
        return data if data is not None else self._restored(key)

    def _restored(self, key: StoreKey) -> bytes | None:
        """The image's file, written back to the store; None if there is no file."""
        data = self.files.read(key)
        if data is not None:
            self._cache().write(key, data)
        return data


def _unknown(field: str, content_hash: str) -> ImageError:
    """A request names an image its tenant never uploaded (or another tenant's): 404."""
    return ImageError(field, f"no image {content_hash}; upload it with POST /v1/images", 404)
