"""Qwen-Image-Edit, groundwork (not a served family yet): the tiny model's build and the
processor that loads without torchvision. The plan for the rest (the image-conditioned
embedding, the condition in the DiT's sequence, the engine's token count) is in the branch's
notes; nothing here is registered in ``workers.families``.

``QwenImageEditPipeline`` takes a ``Qwen2VLProcessor``; transformers builds that one only with
a video processor, which needs torchvision (a CUDA build on this index, which does not import
against the CPU torch). ``EditProcessor`` is the same processor for images only, saved and
loaded like it; a pipeline must be given it explicitly (``processor=``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from workers.families import qwen_image

# QwenImageEditPipeline's prompt template: the image's tokens sit in the user's turn, and the
# first EDIT_DROP_IDX tokens (all before them) are dropped from the hidden states.
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
    "texture, objects, background), then explain how the user's text instruction should "
    "alter or modify the image. Generate a new image that meets the user's requirements while "
    "maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n")
EDIT_DROP_IDX = 64
# The tiny model's image processor: patches of the vision config's size, and an image of at
# most 112x112 pixels, so the prompt carries at most 16 merged image tokens at any size.
PROCESSOR_CONFIG: dict[str, Any] = {"patch_size": 14, "merge_size": 2,
                                    "temporal_patch_size": 2, "min_pixels": 56 * 56,
                                    "max_pixels": 112 * 112}


@functools.cache
def processor_class() -> Any:
    """``EditProcessor``: ``Qwen2VLProcessor`` with no video processor (its signature names
    the image processor and the tokenizer only, which is what it saves and loads)."""
    from transformers import Qwen2VLProcessor

    class EditProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor: Any = None, tokenizer: Any = None,
                     chat_template: str | None = None, **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template,
                             **kwargs)

    return EditProcessor


def load_processor(directory: Path) -> Any:
    """The model folder's processor, loaded as ``EditProcessor``."""
    return processor_class().from_pretrained(directory / "processor")


def build(directory: Path, preset_name: str, seed: int = 0) -> None:
    """A tiny random ``QwenImageEditPipeline`` of the Qwen-Image preset's sizes, saved so that
    its folder reads like a real checkpoint's (its processor named ``Qwen2VLProcessor``)."""
    from diffusers import QwenImageEditPipeline
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    parts = qwen_image.untrained_components(qwen_image.PRESETS[preset_name], seed,
                                            EDIT_TEMPLATE, EDIT_DROP_IDX)
    processor = processor_class()(image_processor=Qwen2VLImageProcessorPil(**PROCESSOR_CONFIG),
                                  tokenizer=parts["tokenizer"])
    pipe: Any = QwenImageEditPipeline(**parts, processor=processor)
    if (pipe.prompt_template_encode != EDIT_TEMPLATE
            or pipe.prompt_template_encode_start_idx != EDIT_DROP_IDX):
        raise RuntimeError("QwenImageEditPipeline's prompt template changed; update this "
                           "family")
    pipe.save_pretrained(directory)
    index_path = directory / "model_index.json"
    index = json.loads(index_path.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def load_pipeline(directory: Path) -> Any:
    """The folder's ``QwenImageEditPipeline``, its processor given explicitly."""
    from diffusers import QwenImageEditPipeline

    return QwenImageEditPipeline.from_pretrained(directory, processor=load_processor(directory))
