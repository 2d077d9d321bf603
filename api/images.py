"""``/v1/images``: upload a tenant's input images, and read one back. An upload is the raw
file as the body (PNG, JPEG, WebP, ...), kept as its normalised pixels under their hash (an
inpainting mask as 8-bit grey: ``?kind=mask``)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Request, Response

from admission.request import NotFoundError
from api.deps import Svc, Tenant
from api.schemas import ImageOut

router = APIRouter()
UPLOADS = "/v1/images"
# An image's name is the xxh3-128 of its pixels; anything else is refused before the store.
ContentHash = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$")]


@router.post(UPLOADS, status_code=201, response_model=ImageOut)
async def upload(request: Request, who: Tenant, svc: Svc,
                 kind: Annotated[Literal["image", "mask"], Query(
                     description="mask: kept as an inpainting mask (8-bit grey, white where "
                     "the prompt repaints: its fully transparent pixels if it has "
                     "transparency, else its light ones)")] = "image") -> ImageOut:
    """Store an image; requests refer to it by the hash answered."""
    image = svc.add_image(who, await request.body(), kind)
    return ImageOut(hash=image.hash, width=image.width, height=image.height)


@router.get(UPLOADS + "/{content_hash}", response_class=Response,
            responses={200: {"content": {"image/png": {}}}})
def read(content_hash: ContentHash, who: Tenant, svc: Svc) -> Response:
    """The image as kept (PNG of its normalised pixels); another tenant's reads as unknown."""
    png = svc.images.read(who, content_hash)
    if png is None:
        raise NotFoundError(f"no image {content_hash}; upload it with POST {UPLOADS}")
    return Response(png, media_type="image/png")
